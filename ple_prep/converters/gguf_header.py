"""The GGUF header: metadata and tensor infos, parsed and bounds-checked in one walk.

The layout (magic, version, counts, key-value pairs, tensor infos, aligned data; docs/INPUTS.md)
is read here; the `gguf` package supplies only its enumerations (value types, GGML types) and
block sizes. Every count and length is checked against the bytes left in the file before anything
is allocated for it, so a hostile file costs at most its own size: a 2 KB file claiming an array of
2**40 strings is refused at once. Metadata comes out as plain Python values, integers never
through float (the hash multipliers need 45 bits); string arrays (a tokenizer's vocabulary) are
walked for their count only.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, QK_K

from ..core.constants import GGML_TYPES
from ..core.errors import BadInput
from ..core.fileio import open_input

MAGIC = b"GGUF"
# The versions whose layout this parser knows (u64 counts and lengths). A later version may change
# it, so it is refused rather than guessed at.
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dims count, type, offset
# struct format of each fixed-size value type.
SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
           GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
           GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
           GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
MIN_ITEM_BYTES = {kind: struct.calcsize(code) for kind, code in SCALARS.items()} | {
    GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
# The GGML types a table may have, as messages name them.
SUPPORTED_TYPES = ", ".join(name for name, _ in GGML_TYPES.values())


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml order: dims[0] is the row width
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    alignment: int


class _Walker:
    def __init__(self, view: memoryview, name: str):
        self.view = view
        self.name = name
        self.position = 0

    def refuse(self, what: str) -> BadInput:
        return BadInput(f"{self.name}: not a readable GGUF file: {what}")

    def fail(self, what: str) -> BadInput:
        return self.refuse(f"{what} at byte {self.position} cannot fit the {len(self.view)}-byte file "
                           f"(malformed or truncated)")

    def take(self, count: int, what: str) -> bytes:
        """The next `count` bytes, copied: no view of the mapping outlives the parse (an error's
        traceback would otherwise keep the file mapped)."""
        if count > len(self.view) - self.position:
            raise self.fail(what)
        piece = bytes(self.view[self.position:self.position + count])
        self.position += count
        return piece

    def skip(self, count: int, what: str) -> None:
        if count > len(self.view) - self.position:
            raise self.fail(what)
        self.position += count

    def unpack(self, code: str, what: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.unpack("Q", f"{what} length"), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} at byte {self.position - len(raw)} is not UTF-8") from None

    def skip_string(self, what: str) -> None:
        self.skip(self.unpack("Q", f"{what} length"), what)

    def value_type(self, what: str) -> GGUFValueType:
        kind = self.unpack("I", what)
        try:
            return GGUFValueType(kind)
        except ValueError:
            raise self.refuse(f"{what} {kind} at byte {self.position - 4} is unknown") from None

    def value(self, kind: GGUFValueType, depth: int = 0) -> Any:
        if kind in SCALARS:
            return self.unpack(SCALARS[kind], "a value")
        if kind == GGUFValueType.STRING:
            return self.string("a string value")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.refuse(f"arrays nest deeper than {MAX_ARRAY_DEPTH} levels at byte {self.position}")
        item = self.value_type("array item type")
        count = self.unpack("Q", "an array's length")
        if count * MIN_ITEM_BYTES[item] > len(self.view) - self.position:
            raise self.fail(f"an array of {count} items")
        if item in SCALARS:
            code = SCALARS[item]
            raw = self.take(count * struct.calcsize(code), "an array")
            return list(struct.unpack(f"<{count}{code}", raw))
        if item == GGUFValueType.STRING:
            # Only the count of a string array is ever needed (a vocabulary's size).
            for _ in range(count):
                self.skip_string("a string in an array")
            return [None] * count
        return [self.value(item, depth + 1) for _ in range(count)]


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header of one GGUF file; BadInput on anything its bytes cannot hold."""
    try:
        with open_input(path, "GGUF file") as handle:
            size = handle.seek(0, 2)
            if size < 24:
                raise BadInput(f"{path.name}: not a readable GGUF file: {size} bytes is too short")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
                view = memoryview(mapping)
                try:
                    return _parse(_Walker(view, path.name), path, size)
                finally:
                    view.release()
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror}") from None


def _parse(walker: _Walker, path: Path, size: int) -> GGUFHeader:
    if bytes(walker.take(4, "the magic")) != MAGIC:
        raise walker.refuse("it does not start with the GGUF magic")
    version = walker.unpack("I", "the version")
    if version & 0xFFFF == 0 and version >> 16:
        raise BadInput(f"{walker.name} is a big-endian GGUF; convert it to little-endian first")
    if version not in VERSIONS:
        raise walker.refuse(f"GGUF version {version}; this reader knows versions "
                            f"{', '.join(map(str, VERSIONS))}")
    tensor_count, pair_count = walker.unpack("Q", "the tensor count"), walker.unpack("Q", "the key-value count")
    room = size - walker.position
    if pair_count * MIN_KV_BYTES > room or tensor_count * MIN_TENSOR_INFO_BYTES > room:
        raise walker.fail(f"{pair_count} key-value pairs and {tensor_count} tensors")
    metadata: dict[str, Any] = {}
    kinds: dict[str, GGUFValueType] = {}
    for _ in range(pair_count):
        key = walker.string("a key")
        kind = walker.value_type("value type")
        if key in metadata:
            raise walker.refuse(f"the key {key!r} appears twice")
        metadata[key], kinds[key] = walker.value(kind), kind
    infos = [_tensor_info(walker) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and (kinds["general.alignment"] != GGUFValueType.UINT32 or alignment == 0
                                            or alignment & (alignment - 1)):
        raise walker.refuse(f"general.alignment {alignment!r} is not a power of two (u32)")
    data_offset = -(-walker.position // alignment) * alignment
    names: set[str] = set()
    tensors, problems = [], []
    for name, dims, type_id, offset in infos:
        if name in names:
            raise walker.refuse(f"the tensor {name!r} appears twice")
        names.add(name)
        ggml_type = _ggml_type(walker, type_id)
        tensor = TensorInfo(name, path, ggml_type, dims, data_offset + offset,
                            _tensor_bytes(walker, name, ggml_type, dims))
        # Every tensor's place is checked against the file before any tensor byte is read.
        if offset % alignment:
            problems.append(f"{name} starts at byte {tensor.offset}, not an aligned offset in the "
                            f"data region (from {data_offset})")
        elif tensor.offset + tensor.nbytes > size:
            problems.append(f"{name} ends at byte {tensor.offset + tensor.nbytes}, past the end of the "
                            f"{size}-byte file (truncated?)")
        tensors.append(tensor)
    problems += _overlaps(tensors)
    if problems:
        raise BadInput(f"{walker.name}: {'; '.join(problems[:5])}"
                       + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    return GGUFHeader(version, metadata, tensors, data_offset, alignment)


def _overlaps(tensors: list[TensorInfo]) -> list[str]:
    """Each tensor whose bytes start inside an earlier one's, named with the one before it."""
    problems, position, previous = [], 0, None
    for tensor in sorted(tensors, key=lambda t: t.offset):
        if tensor.offset < position:
            problems.append(f"{tensor.name} overlaps {previous}")
        position, previous = max(position, tensor.offset + tensor.nbytes), tensor.name
    return problems


def _tensor_info(walker: _Walker) -> tuple[str, tuple[int, ...], int, int]:
    name = walker.string("a tensor name")
    count = walker.unpack("I", "a tensor's dimension count")
    if count > MAX_DIMS:
        raise walker.refuse(f"a tensor with {count} dimensions (at most {MAX_DIMS})")
    dims = struct.unpack(f"<{count}Q", walker.take(8 * count, "a tensor's dimensions"))
    type_id = walker.unpack("I", "a tensor's type")
    offset = walker.unpack("Q", "a tensor's offset")
    return name, tuple(dims), type_id, offset


def _ggml_type(walker: _Walker, type_id: int) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        raise walker.refuse(f"a tensor has GGML type id {type_id}, an unknown GGML type") from None


def _tensor_bytes(walker: _Walker, name: str, ggml_type: GGMLQuantizationType, dims: tuple[int, ...]) -> int:
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    width = dims[0] if dims else 1
    if width % block_values:
        if block_values == QK_K:
            raise walker.refuse(k_quant_refusal(name, ggml_type, width))
        raise walker.refuse(f"{name}'s row of {width} values is not a whole number of blocks "
                            f"({ggml_type.name} blocks hold {block_values} values)")
    return width // block_values * block_bytes * math.prod(dims[1:])


def k_quant_refusal(what: str, ggml_type: GGMLQuantizationType, width: int) -> str:
    """Why a K-quant cannot hold the table: its blocks are wider than a row of `width` values."""
    return (f"{what} is {ggml_type.name}, a K-quant: its {QK_K}-value blocks cannot hold a {width}-value "
            f"row; use a GGUF quantised to {SUPPORTED_TYPES}")
