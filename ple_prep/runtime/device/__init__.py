"""The device path: row ids in, bf16 PLE values on a torch device out (needs torch).

    from ple_prep.runtime import open_table
    from ple_prep.runtime.device import EmbeddingSource

source.py holds EmbeddingSource; buffers.py its device buffer layout, device_ids.py the protocol
for ids given on the device, graphs.py its CUDA-graph cache; dequant.py and triton_gather.py decode
rows on the device; driver.py wraps the compiled runtime's CUDA driver calls (no torch needed).
EmbeddingSource is imported at first use, so that driver.py imports without torch.
"""
__all__ = ["EmbeddingSource"]


def __getattr__(name: str):
    if name == "EmbeddingSource":
        from .source import EmbeddingSource

        return EmbeddingSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
