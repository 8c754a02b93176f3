"""ple-prep's vLLM plugin: Qwen4Exp's n-gram embedding served from a prepared table.

`register` is the `vllm.general_plugins` entry point (pyproject.toml); vLLM calls it in every
process before a model is built and before the process first uses CUDA. It imports nothing of vLLM.
With a table in `PLE_PREP_TABLE` it sizes the driver's launch queues (`environment.py`). For
the rest it only arranges that, when vLLM imports the module that picks the n-gram embedding's
storage class, `storage.install` swaps that choice, that, when vLLM imports its model loaders,
`loader.register` makes its default load formats skip the PLE shards a prepared table serves, and
that its model runners and worker feed and check the lookups (`traffic.py`). The table is
configured by `PLE_PREP_TABLE` or vLLM's additional config (`settings.py`); without either, vLLM
builds its own storage, loads every tensor and runs its driver as before.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType

from .environment import LAUNCH_QUEUES_VARIABLE, PLUGIN_LAUNCH_QUEUES, scale_launch_queues

# vLLM's modules that choose the n-gram embedding's storage class: CUDA, and ROCm's copy.
NVIDIA_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
ROCM_MODULE = "vllm.models.qwen4_exp.amd.ple_layer"
# vLLM's registry of model loaders by load format.
LOADER_MODULE = "vllm.model_executor.model_loader"
# vLLM's model runners, whose schedule feeds read-ahead and recording and raises failed lookups
# (traffic.py): the V1 runner and the V2 runner (vLLM's default on CUDA).
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
# vLLM's worker, whose steps' outputs are handed over only after the failed lookups are raised.
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
_PATCHED = (NVIDIA_MODULE, ROCM_MODULE, LOADER_MODULE, WORKER_MODULE) + RUNNER_MODULES


def _patch(module: ModuleType) -> None:
    if module.__name__ == LOADER_MODULE:
        from . import loader

        loader.register()
        return
    if module.__name__ in RUNNER_MODULES:
        from . import traffic

        traffic.install(module)
        return
    if module.__name__ == WORKER_MODULE:
        from . import traffic

        traffic.install_output_check(module)
        return
    from . import storage

    storage.install(module, storage.select_storage if module.__name__ == NVIDIA_MODULE else storage.refuse_storage)


class _PatchingLoader(importlib.abc.Loader):
    """vLLM's own loader of a storage-choosing module, then `_patch` on the module."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _patch(module)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path, target=None):
        if name not in _PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def register() -> None:
    """vLLM's general plugin hook; safe to call many times."""
    if scale_launch_queues(os.environ):
        logging.getLogger(__name__).info("ple-prep: %s=%s (a table is served; set the variable to keep another size)",
                                         LAUNCH_QUEUES_VARIABLE, PLUGIN_LAUNCH_QUEUES)
    for name in _PATCHED:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
