"""The reader a serving stack imports. numpy only: no click, tqdm, gguf or torch."""
from .compiled import CompiledHelperMissing, compiled_helper_missing
from .recording import TrafficRecorder
from .table import READ_PATHS, Table, open_table

__all__ = ["READ_PATHS", "CompiledHelperMissing", "Table", "TrafficRecorder", "compiled_helper_missing",
           "open_table"]
