"""A Hugging Face checkpoint's config.json: the hash parameters of a safetensors checkpoint."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.errors import BadInput
from ..core.fileio import load_json
from ..ngram import NgramSpec

# A real config.json is a few KB.
MAX_CONFIG_BYTES = 16 << 20


def load_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not os.path.lexists(path):
        raise BadInput(f"{path} not found: is this a checkpoint folder?")
    return load_json(path, "config", limit=MAX_CONFIG_BYTES)


def config_spec(model_dir: str | Path) -> NgramSpec:
    """The hash spec config.json derives, without the weights (a folder may hold only the config
    and the tokenizer: enough to profile traffic before the model is downloaded)."""
    return NgramSpec.from_config(load_config(model_dir))
