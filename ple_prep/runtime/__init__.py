"""The reader a serving stack imports. numpy only: no click, tqdm, gguf or torch."""
from .table import Table, open_table

__all__ = ["Table", "open_table"]
