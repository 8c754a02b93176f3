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


# Fields only a model with an n-gram PLE table has (docs/MODEL.md); a config with none of them is
# another model's.
PLE_FIELDS = ("ngram_size", "heads_per_ngram", "ngram_vocab_size_base", "ple_embed_dim")


def config_spec(model_dir: str | Path) -> NgramSpec:
    """The hash spec config.json derives, without the weights (a folder may hold only the config
    and the tokenizer: enough to profile traffic before the model is downloaded)."""
    config = load_config(model_dir)
    fields = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(fields, dict):
        raise BadInput(f"{Path(model_dir) / 'config.json'} is not a JSON object")
    if not any(name in fields for name in PLE_FIELDS):
        kind = fields.get("model_type") or config.get("model_type")
        raise BadInput(f"{model_dir} is not a Qwen3.8-Flash-Next checkpoint: its config.json"
                       + (f" (model_type {kind!r})" if isinstance(kind, str) else "")
                       + " has no n-gram PLE fields (ngram_size, heads_per_ngram, ngram_vocab_size_base)")
    return NgramSpec.from_config(fields)
