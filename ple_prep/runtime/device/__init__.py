"""The device path: row ids in, bf16 PLE values on a torch device out (needs torch); the public
entry is `ple_prep.runtime.EmbeddingSource`.

source.py holds EmbeddingSource and its pending start; staging.py its host half (slots, tier
index, disk rows into the pinned span); buffers.py the device buffer layout; device_ids.py the
protocol for ids given on the device; graphs.py the CUDA-graph cache; stats.py what a source
counts; steps.py StepLookup (a step's lookup the device starts and waits for itself, for CUDA
graphs that hold whole steps); dequant.py and triton_gather.py decode rows on the device;
driver.py holds the calls past torch's public API (the compiled runtime's CUDA driver calls; it
imports no torch). EmbeddingSource and StepLookup are imported at first use, so that driver.py
imports without torch.
"""
__all__ = ["EmbeddingSource", "SourceStats", "StepLookup"]


def __getattr__(name: str):
    if name == "EmbeddingSource":
        from .source import EmbeddingSource

        return EmbeddingSource
    if name == "SourceStats":
        from .stats import SourceStats

        return SourceStats
    if name == "StepLookup":
        from .steps import StepLookup

        return StepLookup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
