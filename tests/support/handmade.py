"""Helpers that rewrite fixture checkpoints into odd or broken ones, and hand-pack hostile files.

Rewritten files still go through the `safetensors` library; only files no library would write
(bad header lengths, non-JSON headers, offsets past the end) are packed by hand with struct.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from ple_prep.converters.safetensors import read_header

INDEX = "model.safetensors.index.json"
# safetensors header dtype -> the name TensorSpec takes.
SPEC_DTYPES = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F16": "float16", "F32": "float32",
               "U8": "uint8", "I64": "int64", "I32": "int32"}


class Tensor:
    """One tensor as stored: header dtype, shape and raw bytes (editable)."""

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes):
        self.dtype, self.shape, self.data = dtype, tuple(shape), data

    def rows(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.shape[0], -1)


def load_tensors(folder: Path) -> dict[str, dict[str, Tensor]]:
    """{file name: {tensor name: Tensor}} for every *.safetensors file of a checkpoint."""
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        raw = path.read_bytes()
        files[path.name] = {name: Tensor(info.dtype, info.shape, raw[info.offset:info.offset + info.nbytes])
                            for name, info in read_header(path).items()}
    return files


def save_tensors(folder: Path, files: dict[str, dict[str, Tensor]], index: bool = True) -> None:
    """Rewrite a checkpoint's safetensors files (and its index) from `load_tensors`'s form."""
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / INDEX).unlink(missing_ok=True)
    weight_map = {}
    for name, tensors in files.items():
        buffers = {key: np.frombuffer(t.data, dtype=np.uint8).copy() if t.data else np.zeros(1, np.uint8)
                   for key, t in tensors.items()}
        specs = {key: TensorSpec(dtype=SPEC_DTYPES[t.dtype], shape=list(t.shape),
                                 data_ptr=buffers[key].ctypes.data, data_len=len(t.data))
                 for key, t in tensors.items()}
        serialize_file(specs, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    if index:
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def find(files: dict[str, dict[str, Tensor]], suffix: str) -> tuple[str, str]:
    """(file name, tensor name) of the one tensor whose name ends in `suffix`."""
    found = [(f, t) for f, tensors in files.items() for t in tensors if t.endswith(suffix)]
    assert len(found) == 1, found
    return found[0]


def pack_safetensors(header: bytes | dict, data: bytes = b"", header_len: int | None = None) -> bytes:
    """A safetensors file by hand: u64 little-endian header length, header bytes, data."""
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    return struct.pack("<Q", len(header) if header_len is None else header_len) + header + data
