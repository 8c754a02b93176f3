"""vLLM's default model loader, less the reads of the PLE shards a prepared table serves.

vLLM's safetensors iterator reads every tensor of the checkpoint (`get_tensor`), so a boot with the
plugin would read the whole PLE table (47.7 GiB for the FP8 model) through the page cache only for
the plugin to drop it. vLLM offers plugins `register_model_loader`; the plugin registers
`PreparedTableLoader` under vLLM's default load formats (`auto`, `safetensors`). It is vLLM's
`DefaultModelLoader` unchanged unless the model it loads holds a `PreparedTableEmbedding`; then the
checkpoint's PLE shard tensors (`...ngram_embedding.shard_<i>.weight`, and NVFP4's per-shard block
scales) are handed to the model as meta tensors of their header's shape and dtype, read from the
safetensors header only: the model's loader still checks their shapes and dtypes, and the scale
and hash constants (small tensors beside them) are read as before, so the plugin's checks against
the checkpoint hold. Load strategies that read whole files (eager, prefetch, multi-threaded and
the other formats) are vLLM's own; with them the shards are read, and the log says so.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Generator

import torch
from safetensors import safe_open
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
from vllm.model_executor.model_loader.weight_utils import filter_safetensors_files_by_weight_name

logger = init_logger(__name__)

# The load formats whose loader is vLLM's DefaultModelLoader reading safetensors lazily.
LOAD_FORMATS = ("auto", "safetensors")
# The checkpoint's PLE rows (docs: any prefix; NVFP4's block scales are split into shards like the rows).
PLE_SHARD = re.compile(r"(^|\.)ple\.ple_embedding\.ngram_embedding\.shard_\d+\.(weight|weight_scale)$")
# safetensors' dtype names, as torch dtypes.
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
           "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
           "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
           "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}


def read_header(path: str) -> tuple[int, dict]:
    """A safetensors file's data offset and header (an 8-byte little-endian length, then JSON)."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        size = os.fstat(file.fileno()).st_size
        if not 0 < length <= size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _read_tensor(descriptor: int, data_offset: int, entry: dict) -> torch.Tensor:
    """One tensor's bytes read exactly (pread), as a tensor of its header's dtype and shape."""
    low, high = entry["data_offsets"]
    data = bytearray(high - low)
    view = memoryview(data)
    done = 0
    while done < len(data):
        got = os.preadv(descriptor, [view[done:]], data_offset + low + done)
        if got == 0:
            raise ValueError("a safetensors file ends inside a tensor")
        done += got
    tensor = torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]) if data else \
        torch.empty(0, dtype=_DTYPES[entry["dtype"]])
    return tensor.reshape(entry["shape"])


def checkpoint_weights(files: list[str], local_expert_ids: set[int] | None = None
                       ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """vLLM's lazy safetensors iteration, the PLE shards left unread.

    A file without PLE shards is read as vLLM reads it (`get_tensor` through safetensors' mapping).
    In a file with shards the other tensors are read exactly, with the kernel's read-ahead off:
    a mapping's page fault reads ahead up to the device's read-ahead window (8 MiB on some
    virtual disks), which would read megabytes of the shards around each small tensor (the FP8
    scale, the hash constants). The shards themselves become meta tensors of their header's
    shape and dtype."""
    skipped = 0
    for path in sorted(files):
        data_offset, header = read_header(path)
        if not any(PLE_SHARD.search(name) for name in header):
            with safe_open(path, framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if not should_skip_weight(name, local_expert_ids):
                        yield name, checkpoint.get_tensor(name)
            continue
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)
            for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                if should_skip_weight(name, local_expert_ids):
                    continue
                if PLE_SHARD.search(name) and entry["dtype"] in _DTYPES:
                    skipped += 1
                    yield name, torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device="meta")
                elif entry["dtype"] in _DTYPES:
                    yield name, _read_tensor(descriptor, data_offset, entry)
                else:  # a dtype this torch has no name for here: safetensors reads it
                    with safe_open(path, framework="pt") as checkpoint:
                        yield name, checkpoint.get_tensor(name)
        finally:
            os.close(descriptor)
    logger.info("ple-prep: %d PLE shard tensors of the checkpoint not read (the prepared table serves them)",
                skipped)


def serves_prepared_table(model: nn.Module) -> bool:
    from .storage import PreparedTableEmbedding

    return any(isinstance(module, PreparedTableEmbedding) for module in model.modules())


class PreparedTableLoader(DefaultModelLoader):
    """DefaultModelLoader; for a model whose PLE layer the plugin serves, its shards stay unread."""

    _skip_shards = False

    def get_all_weights(self, model_config, model: nn.Module):
        self._skip_shards = serves_prepared_table(model)
        try:
            yield from super().get_all_weights(model_config, model)
        finally:
            self._skip_shards = False

    def _whole_file_options(self) -> list[str]:
        """The load options set under which vLLM reads whole checkpoint files (none: it reads lazily)."""
        config = self.load_config
        return [option for option, applies in (
            (f"load format {config.load_format}", config.load_format not in LOAD_FORMATS),
            (f"safetensors strategy {config.safetensors_load_strategy}",
             config.safetensors_load_strategy not in (None, "lazy")),
            ("multi-threaded loading", bool(config.model_loader_extra_config.get("enable_multithread_load"))),
            ("an encoder-only model's prefixes", self._encoder_only_lm_prefixes is not None)) if applies]

    def _get_weights_iterator(self, source: DefaultModelLoader.Source):
        if not self._skip_shards:
            return super()._get_weights_iterator(source)
        whole_file_options = self._whole_file_options()
        if whole_file_options:
            logger.warning("ple-prep: vLLM's load options (%s) read whole checkpoint files: the PLE shards are read "
                           "at boot and dropped", ", ".join(whole_file_options))
            return super()._get_weights_iterator(source)
        _, files, use_safetensors, _ = self._prepare_weights(
            source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt,
            source.allow_patterns_overrides)
        if not use_safetensors:
            return super()._get_weights_iterator(source)
        if source.is_unused_weight is not None:
            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        if self.counter_before_loading_weights == 0.0:  # as vLLM's own iterator does, for its log line
            self.counter_before_loading_weights = time.perf_counter()
        return ((source.prefix + name, tensor) for name, tensor in checkpoint_weights(files, self.local_expert_ids))


_registered = False


def register() -> None:
    """Make PreparedTableLoader vLLM's loader of its default formats, once (vLLM logs that it replaces them)."""
    global _registered
    if not _registered:
        for load_format in LOAD_FORMATS:
            register_model_loader(load_format)(PreparedTableLoader)
        _registered = True
