"""The reader a serving stack imports. numpy only: no click, tqdm, gguf or torch."""
from .compiled import CompiledHelperMissing, compiled_helper_missing
from .table import READ_PATHS, Table, open_table

__all__ = ["READ_PATHS", "CompiledHelperMissing", "Table", "compiled_helper_missing", "open_table"]
