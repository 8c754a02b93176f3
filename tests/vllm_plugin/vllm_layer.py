"""vLLM 0.33.0's real Qwen4Exp n-gram embedding, built on the CPU for tests (single-process gloo groups).

vLLM must be importable with VLLM_TARGET_DEVICE=cpu (scripts/vllm-test-env.sh builds such an
environment). The plugin is the installed `vllm.general_plugins` entry point, loaded as vLLM loads it.
"""
from __future__ import annotations

import glob
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen4ExpTextConfig
from vllm.config import CUDAGraphMode, LoadConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

from ple_prep.tools.fixtures import PREFIX, fixture_config

LAYER_PREFIX = PREFIX.rstrip(".")
# The config's ple_embedding_dtype that selects each fixture's PLE method in vLLM.
EMBEDDING_DTYPES = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4", "bf16": None}
MAX_TOKENS = 256
EOS = 248044


def text_config(variant: str, **changes: Any) -> Qwen4ExpTextConfig:
    fields = {k: v for k, v in fixture_config().items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = Qwen4ExpTextConfig(**(fields | changes))
    if EMBEDDING_DTYPES[variant] is not None:
        config.ple_embedding_dtype = EMBEDDING_DTYPES[variant]
    return config


def checkpoint_weights(checkpoint: Path, rename: dict[str, torch.Tensor] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The PLE layer's tensors as vLLM's own safetensors iterator reads them, named below the layer.

    `rename` replaces tensors by name, as another checkpoint would hold them.
    """
    files = sorted(glob.glob(str(checkpoint / "*.safetensors")))
    return _below_the_layer(safetensors_weights_iterator(files, False), rename)


def loader_weights(checkpoint: Path, load_format: str = "auto"
                   ) -> Callable[[torch.nn.Module], Iterator[tuple[str, torch.Tensor]]]:
    """For `build_layer`: the layer's tensors as the model loader vLLM picks for `load_format` reads them
    for a model holding the layer (with the plugin installed: its loader)."""
    def weights(layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        loader = get_model_loader(LoadConfig(load_format=load_format))
        model_config = types.SimpleNamespace(model=str(checkpoint), revision=None)
        return _below_the_layer(loader.get_all_weights(model_config, layer), None)

    return weights


def _below_the_layer(weights: Iterable[tuple[str, torch.Tensor]], rename: dict[str, torch.Tensor] | None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's tensors of a checkpoint's, named below the layer. The fixture's NVFP4 global scale
    sits beside every shard; vLLM loads exactly one, beside the shards
    (`ngram_embedding.weight_scale_2`), so the copies (all equal) become that one."""
    for name, tensor in weights:
        if not name.startswith(PREFIX):
            continue
        name = name[len(PREFIX):]
        if name.endswith(".weight_scale_2"):
            if name != "ngram_embedding.shard_0.weight_scale_2":
                continue
            name = "ngram_embedding.weight_scale_2"
        yield name, (rename or {}).get(name, tensor)


def vllm_config(table: str | None = None, *, cudagraph_mode: str | None = None, **settings: Any) -> VllmConfig:
    """A config as a worker receives it. Its graph mode is set after vLLM's checks, which turn any mode
    into NONE on a CPU without a model: a GPU worker gets the mode the engine resolved."""
    additional = {"ple_prep": {"table": table, **settings}} if table else {}
    config = VllmConfig(additional_config=additional)
    if cudagraph_mode is not None:
        config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    return config


def build_layer(config: VllmConfig, text: Qwen4ExpTextConfig, weights, *,
                params_dtype: torch.dtype = torch.bfloat16) -> Qwen4ExpNGramEmbedding:
    """Build the layer as vLLM does (under its config, the model in `params_dtype`), load `weights`
    (None, (name, tensor) pairs, or `loader_weights`' function of the layer) and run the post-load step."""
    with set_current_vllm_config(config):
        layer = Qwen4ExpNGramEmbedding(text, int(text.ple_embed_dim), 0, MAX_TOKENS, data_parallel_rank=0,
                                       prefix=LAYER_PREFIX, params_dtype=params_dtype)
        if callable(weights):
            weights = weights(layer)
        if weights is not None:
            layer.load_weights(weights)
            loader_config = types.SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization=None)
            process_weights_after_loading(layer, loader_config, torch.device("cpu"))
    return layer


def ple_input(layer: Qwen4ExpNGramEmbedding, tokens: torch.Tensor, query_start_loc: torch.Tensor,
              ngram_context: torch.Tensor) -> torch.Tensor:
    """The PLE layer's bf16 input for one step, called in the order the model calls it."""
    hidden = torch.zeros(len(tokens), 8, dtype=torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        layer.start_prefetch(tokens, query_start_loc, ngram_context)
        rows = layer(hidden, tokens, query_start_loc, ngram_context)
        return layer.ngram_embedding.dequantize(rows, torch.bfloat16)


def schedule(seed: int = 0):
    """Steps of a batch as vLLM's scheduler hands them over: (tokens, query_start_loc, ngram_context).

    Four requests: a long prompt prefilled in chunks, a short one, one arriving later, one whose
    prompt holds EOS; then decode steps. Each request's context is its last two tokens (EOS-filled
    while it has fewer), and requests never see each other's tokens.
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 248320, 150), rng.integers(0, 248320, 9), rng.integers(0, 248320, 40),
               np.array([5, 6, EOS, 7, 8, EOS, 9, 10])]
    plan = [{0: 64, 1: 9}, {0: 64, 1: 1, 2: 40}, {0: 22, 1: 1, 2: 1, 3: 8}, {0: 1, 1: 1, 2: 1, 3: 1},
            {0: 1, 2: 1, 3: 1}]
    history = [[] for _ in prompts]
    for step in plan:
        tokens, starts, contexts = [], [0], []
        for request, count in step.items():
            done = len(history[request])
            prompt = prompts[request]
            new = list(prompt[done:done + count]) if done < len(prompt) else \
                list(rng.integers(0, 248320, count))
            contexts.append(([EOS, EOS] + history[request])[-2:])
            history[request] += new
            tokens += new
            starts.append(starts[-1] + len(new))
        yield (torch.tensor(tokens, dtype=torch.int64), torch.tensor(starts, dtype=torch.int32),
               torch.tensor(contexts, dtype=torch.int64))
