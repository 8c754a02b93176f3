"""Source formats. Each module validates its format and yields the same row stream (`TableSource`)."""
from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from .base import Scale, Segment, SourceFile, TableSource


def open_source(model: str | Path) -> TableSource:
    """Open the table of a checkpoint folder, whatever its format."""
    path = Path(model)
    if not path.exists():
        raise BadInput(f"{path} does not exist")
    from .safetensors import open_checkpoint

    return open_checkpoint(path)


__all__ = ["Scale", "Segment", "SourceFile", "TableSource", "open_source"]
