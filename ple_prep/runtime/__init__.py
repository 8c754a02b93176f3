"""The reader a serving stack imports: `open_table` and `Table` need numpy alone (no click, tqdm,
gguf or torch); `EmbeddingSource` and `StepLookup` (runtime/device/, need torch) are imported at
their first use, so importing this package never imports torch."""
from .compiled import CompiledHelperMissing, compiled_helper_missing
from .failure_record import RECORD_BYTES, FailureRecord
from .recording import TrafficRecorder
from .table import READ_PATHS, Table, open_table

__all__ = ["READ_PATHS", "RECORD_BYTES", "CompiledHelperMissing", "EmbeddingSource", "FailureRecord", "StepLookup",
           "Table", "TrafficRecorder", "compiled_helper_missing", "open_table"]


def __getattr__(name: str):
    if name == "EmbeddingSource":
        from .device import EmbeddingSource

        return EmbeddingSource
    if name == "StepLookup":
        from .device import StepLookup

        return StepLookup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
