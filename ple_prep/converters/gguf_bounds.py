"""Bounds-check a GGUF file's header before the `gguf` package parses it.

`gguf.GGUFReader` trusts the counts it reads: a 2 KB file that claims an array of 2**40 strings makes
it loop and allocate until the machine runs out of memory (reads past the end return empty views,
not errors). This walk reads the same structure and refuses, before any allocation, every count
and length that the bytes left in the file cannot hold, so the reader's work is bounded by the
file's size.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..core.errors import BadInput
from ..core.fileio import open_input

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# Bytes of each fixed-size value type (gguf.GGUFValueType), by type id.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MIN_ITEM_BYTES = FIXED_SIZES | {STRING: 8, ARRAY: 12}
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dims count, type, offset


class _Walker:
    def __init__(self, view: memoryview, name: str):
        self.view = view
        self.name = name
        self.position = 0

    def fail(self, what: str) -> BadInput:
        return BadInput(f"{self.name}: not a readable GGUF file: {what} at byte {self.position} "
                        f"cannot fit the {len(self.view)}-byte file (malformed or truncated)")

    def take(self, count: int, what: str) -> memoryview:
        if count > len(self.view) - self.position:
            raise self.fail(what)
        piece = self.view[self.position:self.position + count]
        self.position += count
        return piece

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> None:
        self.take(self.u64(f"{what} length"), what)

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in FIXED_SIZES:
            self.take(FIXED_SIZES[kind], "a value")
        elif kind == STRING:
            self.string("a string value")
        elif kind == ARRAY and depth < MAX_ARRAY_DEPTH:
            item = self.u32("an array's item type")
            count = self.u64("an array's length")
            if item not in MIN_ITEM_BYTES:
                raise BadInput(f"{self.name}: not a readable GGUF file: array item type {item} "
                               f"at byte {self.position} is unknown")
            if count * MIN_ITEM_BYTES[item] > len(self.view) - self.position:
                raise self.fail(f"an array of {count} items")
            if item in FIXED_SIZES:
                self.take(count * FIXED_SIZES[item], "an array")
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
        else:
            raise BadInput(f"{self.name}: not a readable GGUF file: value type {kind} at byte "
                           f"{self.position} is unknown (or arrays nest too deep)")


def check_gguf_bounds(path: Path) -> None:
    """BadInput unless every count and length in the header fits the file; big-endian refused."""
    with open_input(path, "GGUF file") as handle:
        size = handle.seek(0, 2)
        if size < 24:
            raise BadInput(f"{path.name}: not a readable GGUF file: {size} bytes is too short")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            view = memoryview(mapping)
            try:
                _walk(_Walker(view, path.name))
            finally:
                view.release()


def _walk(walker: _Walker) -> None:
    if bytes(walker.take(4, "the magic")) != MAGIC:
        return  # not GGUF at all: the reader's own message says so
    version = walker.u32("the version")
    if version & 0xFFFF == 0 and version >> 16:
        raise BadInput(f"{walker.name} is a big-endian GGUF; convert it to little-endian first")
    if version not in VERSIONS:
        return  # the reader refuses unsupported versions itself
    tensors, pairs = walker.u64("the tensor count"), walker.u64("the key-value count")
    room = len(walker.view) - walker.position
    if pairs * MIN_KV_BYTES > room or tensors * MIN_TENSOR_INFO_BYTES > room:
        raise walker.fail(f"{pairs} key-value pairs and {tensors} tensors")
    for _ in range(pairs):
        walker.string("a key")
        walker.value(walker.u32("a value type"))
    for _ in range(tensors):
        walker.string("a tensor name")
        dims = walker.u32("a tensor's dimension count")
        if dims > MAX_DIMS:
            raise BadInput(f"{walker.name}: not a readable GGUF file: a tensor with {dims} "
                           f"dimensions (at most {MAX_DIMS})")
        walker.take(8 * dims + 4 + 8, "a tensor's dimensions, type and offset")
