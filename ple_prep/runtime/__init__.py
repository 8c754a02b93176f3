"""The reader a serving stack imports. numpy only: no click, tqdm, gguf or torch."""
from .table import READ_PATHS, Table, open_table

__all__ = ["READ_PATHS", "Table", "open_table"]
