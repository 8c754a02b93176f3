"""Source formats. Each module validates its format and yields the same row stream (`TableSource`)."""
from __future__ import annotations

from pathlib import Path

from ..core.errors import BadInput
from ..ngram import NgramSpec
from .base import Scale, Segment, SourceFile, TableSource


def open_source(model: str | Path) -> TableSource:
    """Open the table of a checkpoint, whatever its format.

    A .gguf file, or a folder holding *.gguf and no *.safetensors, is read as GGUF; any other
    folder as a safetensors checkpoint.
    """
    path = Path(model)
    if not path.exists():
        raise BadInput(f"{path} does not exist")
    if _is_gguf(path):
        if path.is_file() and path.suffix != ".gguf":
            raise BadInput(f"{path} is a file but not a .gguf; give a checkpoint folder or a .gguf file")
        if path.is_dir() and any(path.glob("*.safetensors")):
            raise BadInput(f"{path} holds both *.gguf and *.safetensors files; pass the .gguf file "
                           f"itself to convert the GGUF")
        from .gguf import open_gguf

        return open_gguf(path)
    from .safetensors import open_checkpoint

    return open_checkpoint(path)


def _is_gguf(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.glob("*.gguf")))


def read_spec(model: str | Path) -> NgramSpec:
    """The hash spec of a checkpoint: a GGUF model's from its metadata; a folder's from config.json,
    checked against the weights' stored constants when the folder holds weights. A folder with
    only config.json (and the tokenizer) is enough: profiling needs no weights."""
    path = Path(model)
    if path.is_dir() and not _is_gguf(path) and not any(path.glob("*.safetensors")):
        from .config import config_spec

        return config_spec(path)
    with open_source(path) as source:
        return source.spec


__all__ = ["Scale", "Segment", "SourceFile", "TableSource", "open_source", "read_spec"]
