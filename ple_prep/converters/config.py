"""A Hugging Face checkpoint's config.json: the hash parameters of a safetensors checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import BadInput
from ..ngram import NgramSpec


def load_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path} not found: is this a checkpoint folder?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path} is not JSON: {exc}") from None


def config_spec(model_dir: str | Path) -> NgramSpec:
    """The hash spec config.json derives, without the weights (a folder may hold only the config
    and the tokenizer: enough to profile traffic before the model is downloaded)."""
    return NgramSpec.from_config(load_config(model_dir))
