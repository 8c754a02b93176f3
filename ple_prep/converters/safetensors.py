"""FP8, BF16 and NVFP4-packed safetensors checkpoints (docs/MODEL.md).

Headers are parsed here rather than through the `safetensors` binding, which cannot hand out FP8 as
numpy; every header is checked against its file before any tensor byte is trusted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..core.constants import (
    ENCODING_BLOCKS,
    HEAD_OFFSETS_SUFFIX,
    HEAD_SIZES_SUFFIX,
    MULTIPLIERS_SUFFIX,
    NVFP4_GLOBAL_SCALE_SUFFIXES,
    PLE_NAME_PART,
    SAFETENSORS_MAX_HEADER,
    SCALE_SUFFIX,
    Encoding,
)
from ..core.errors import BadInput
from ..core.fileio import MAX_JSON_DEPTH, check_json_depth, load_json, open_input
from .base import Scale, Segment, SourceFile, TableSource
from .config import config_spec

# Bits per element of every dtype of the safetensors format (docs/INPUTS.md). A tensor's bytes are
# its element count times these bits, which must come to whole bytes (sub-byte dtypes pack).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
SHARD_PATTERN = re.compile(
    r"\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\."
    r"(weight|weight_scale|weight_scale_2|weight_global_scale)$")
TABLE_ENCODINGS = {"F8_E4M3": Encoding.FP8_E4M3, "BF16": Encoding.BF16, "U8": Encoding.NVFP4_PACKED}
SCALE_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header; refuse anything inconsistent with the file."""
    # Messages name the problem, never the bytes that failed validation.
    try:
        with open_input(path, "shard") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise BadInput(f"{path.name}: {file_size} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > SAFETENSORS_MAX_HEADER:
                raise BadInput(f"{path.name}: the header length field is above the 100 MB limit: "
                               f"not a safetensors file")
            if 8 + header_len > file_size:
                raise BadInput(f"{path.name}: the header length field runs past the end of the "
                               f"{file_size}-byte file (truncated, or not a safetensors file)")
            raw = handle.read(header_len)
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror}") from None
    try:
        check_json_depth(raw, MAX_JSON_DEPTH, f"{path.name}: the header")
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise BadInput(f"{path.name}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path.name}: the header is not a JSON object")
    data_start = 8 + header_len
    data_len = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list)
                    and all(type(v) is int and v >= 0 for v in [*shape, begin, end])):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: malformed entry")
            continue
        bits = math.prod(shape) * DTYPE_BITS.get(dtype, 0)  # Python ints: no overflow
        if dtype not in DTYPE_BITS:
            # A dtype of a later format version: its size cannot be checked, but its place in the
            # data can; only a tensor the table needs is refused for it (open_checkpoint).
            expected = end - begin
        elif bits % 8:
            problems.append(f"{name}: {dtype} {shape} is not a whole number of bytes")
            continue
        else:
            expected = bits // 8
        if end < begin or end - begin != expected:
            problems.append(f"{name}: data_offsets [{begin}, {end}] do not hold {dtype} {shape}")
        elif end > data_len:
            problems.append(f"{name}: data_offsets end {end} is past the {data_len} data bytes")
        else:
            tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)
    if problems:
        raise BadInput(f"{path.name}: {'; '.join(problems[:5])}"
                       + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    # Tensors must tile the data region with no holes or overlaps, and end at the file's end.
    position = data_start
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if info.offset != position:
            raise BadInput(f"{path.name}: tensor {info.name} starts at byte {info.offset}, expected "
                           f"{position}: overlapping or gapped data")
        position += info.nbytes
    if position != file_size:
        raise BadInput(f"{path.name}: tensors end at byte {position} but the file has {file_size}")
    return tensors


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The files to read: those the index names (when there is one), else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        index_json = load_json(index, "safetensors index")
        try:
            weight_map = index_json["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(n, str) for n in names):
                raise TypeError
        except (KeyError, TypeError, AttributeError):
            raise BadInput(f"{index.name} is not a safetensors index (no weight_map)") from None
        # Shards are files of this folder: an absolute name or one with `..` would read elsewhere.
        outside = [n for n in names if PurePosixPath(n).is_absolute() or "\\" in n
                   or ".." in PurePosixPath(n).parts or n in ("", ".")]
        if outside:
            raise BadInput(f"{index.name} names shard files outside the checkpoint folder "
                           f"({', '.join(repr(n) for n in outside[:3])}); refused")
        relevant = sorted({f for t, f in weight_map.items() if PLE_NAME_PART in t})
        missing = [n for n in names if not os.path.lexists(model_dir / n)]
        if missing:
            raise BadInput(f"{index.name} names {', '.join(missing[:5])}, not found in {model_dir}")
        if not relevant:
            raise BadInput(f"{index.name} names no n-gram PLE tensor: is this Qwen3.8-Flash-Next?")
        return [model_dir / n for n in relevant]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BadInput(f"no *.safetensors files and no index in {model_dir}")
    return files


def _read_scalar(info: TensorInfo, what: str) -> Scale:
    if info.dtype not in SCALE_DTYPES:
        raise BadInput(f"{what} {info.name} has dtype {info.dtype}; expected BF16, F16 or F32")
    if math.prod(info.shape) != 1:
        raise BadInput(f"{what} {info.name} has shape {list(info.shape)}: only a scalar (per-tensor) "
                       f"scale is supported")
    with open_input(info.path, "shard") as handle:
        handle.seek(info.offset)
        raw = handle.read(info.nbytes)
    stored = np.frombuffer(raw, dtype=SCALE_DTYPES[info.dtype])
    if info.dtype == "BF16":
        value = float((stored.astype(np.uint32) << 16).view(np.float32)[0])
    else:
        value = float(stored[0])
    if not math.isfinite(value) or value == 0.0:
        raise BadInput(f"{what} {info.name} is {value}: a scale must be finite and non-zero")
    return Scale(info.dtype, raw, value)


def _read_int64(info: TensorInfo, length: int) -> list[int]:
    # Never through float32: the multipliers need 45 bits.
    if info.dtype != "I64" or info.shape != (length,):
        raise BadInput(f"{info.name} is {info.dtype} {list(info.shape)}; expected I64 [{length}]")
    with open_input(info.path, "shard") as handle:
        handle.seek(info.offset)
        return [int(v) for v in np.frombuffer(handle.read(info.nbytes), dtype="<i8")]


def _find_one(tensors: dict[str, TensorInfo], suffix: str) -> TensorInfo | None:
    found = [t for name, t in tensors.items() if name.endswith(suffix)]
    if len(found) > 1:
        raise BadInput(f"{len(found)} tensors end in {suffix}: "
                       f"{', '.join(t.name for t in found)}; keep one")
    return found[0] if found else None


def open_checkpoint(model_dir: str | Path) -> TableSource:
    """Find and validate the n-gram table of a safetensors checkpoint."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir} is not a folder")
    spec = config_spec(model_dir)
    tensors: dict[str, TensorInfo] = {}
    for path in _checkpoint_files(model_dir):
        tensors.update(read_header(path))

    shards: dict[str, dict[int, TensorInfo]] = {}
    for name, info in tensors.items():
        match = SHARD_PATTERN.search(name)
        if match:
            index, kind = int(match.group(1)), match.group(2)
            previous = shards.setdefault(kind, {}).get(index)
            if previous is not None:
                raise BadInput(f"two tensors for shard {index}: {previous.name} in "
                               f"{previous.path.name} and {name} in {info.path.name}")
            shards[kind][index] = info
    weights = shards.get("weight", {})
    if not weights:
        raise BadInput(f"no n-gram PLE table (*.ple.ple_embedding.ngram_embedding.shard_N.weight) "
                       f"in {model_dir}")
    missing = sorted(set(range(max(weights) + 1)) - set(weights))
    if missing:
        raise BadInput(f"shard {', '.join(map(str, missing[:10]))} of the table missing "
                       f"(found {len(weights)} shards up to {max(weights)})")
    ordered = [weights[i] for i in range(len(weights))]
    dtypes = sorted({t.dtype for t in ordered})
    if len(dtypes) > 1:
        raise BadInput(f"table shards mix dtypes {', '.join(dtypes)}")
    dtype = dtypes[0]
    if dtype not in TABLE_ENCODINGS:
        raise BadInput(f"table dtype {dtype} is unsupported; expected F8_E4M3, BF16, or U8 codes "
                       f"with F8_E4M3 block scales (NVFP4)")
    encoding = TABLE_ENCODINGS[dtype]
    values_per_row = spec.values_per_row
    values_per_block, _ = ENCODING_BLOCKS[encoding]
    width = values_per_row // 2 if encoding is Encoding.NVFP4_PACKED else values_per_row
    _check_shard_shapes(ordered, width, "table")

    parts = [_segments(ordered)]
    scale: Scale | None = None
    extra: dict[str, Any] = {}
    scale_info = _find_one(tensors, SCALE_SUFFIX)
    if encoding is Encoding.FP8_E4M3:
        if scale_info is None:
            raise BadInput("FP8 table without its scale (*.ngram_embedding.weight_scale): values "
                           "would be about 5000x too large")
        scale = _read_scalar(scale_info, "scale")
    elif scale_info is not None:
        raise BadInput(f"{dtype} table with a scale tensor {scale_info.name}: unsupported combination")
    if encoding is Encoding.NVFP4_PACKED:
        scale = _nvfp4_scales(shards, len(ordered), values_per_row // values_per_block, parts,
                              tensors)

    constants = {suffix: _find_one(tensors, suffix)
                 for suffix in (MULTIPLIERS_SUFFIX, HEAD_OFFSETS_SUFFIX, HEAD_SIZES_SUFFIX)}
    stored = [None if info is None else _read_int64(info, length)
              for info, length in zip(constants.values(), (spec.ngram_size, spec.heads, spec.heads))]
    spec.check_constants(*stored, where="checkpoint tensor")
    extra["constant_tensors"] = [info.name for info in constants.values() if info is not None]

    num_rows = sum(t.shape[0] for t in ordered)
    if num_rows < spec.rows_used:
        raise BadInput(f"the table has {num_rows} rows but the hash reaches row {spec.rows_used - 1}")
    used = sorted({info.path for name, info in tensors.items() if PLE_NAME_PART in name})
    files = [SourceFile("config.json", (model_dir / "config.json").stat().st_size)]
    files += [SourceFile(p.name, p.stat().st_size) for p in used]
    extra["tensor_prefix"] = ordered[0].name[: ordered[0].name.index(PLE_NAME_PART)]
    extra["shards"] = len(ordered)
    extra["shard_rows"] = ordered[0].shape[0]
    return TableSource(format="safetensors", model_dir=model_dir, encoding=encoding,
                       values_per_row=values_per_row, parts=parts, spec=spec, files=files,
                       scale=scale, extra=extra)


def _check_shard_shapes(ordered: list[TensorInfo], width: int, what: str) -> None:
    shard_rows = ordered[0].shape[0] if len(ordered[0].shape) == 2 else -1
    for index, info in enumerate(ordered):
        if len(info.shape) != 2 or info.shape[1] != width:
            raise BadInput(f"{what} shard {index} ({info.name}) has shape {list(info.shape)}; "
                           f"expected [rows, {width}] (wrong row width)")
        last = index == len(ordered) - 1
        if info.shape[0] > shard_rows or (not last and info.shape[0] != shard_rows):
            raise BadInput(f"{what} shard {index} has {info.shape[0]} rows but shard 0 has "
                           f"{shard_rows}; only the last shard may be shorter")


def _segments(ordered: list[TensorInfo]) -> list[Segment]:
    segments, first_row = [], 0
    for info in ordered:
        segments.append(Segment(info.path, info.offset, first_row, info.shape[0],
                                info.nbytes // max(1, info.shape[0])))
        first_row += info.shape[0]
    return segments


def _nvfp4_scales(shards: dict[str, dict[int, TensorInfo]], count: int, blocks_per_row: int,
                  parts: list[list[Segment]], tensors: dict[str, TensorInfo]) -> Scale:
    """Add the block-scale part to `parts` and return the one global scale."""
    block_scales = shards.get("weight_scale", {})
    if sorted(block_scales) != list(range(count)):
        raise BadInput(f"NVFP4 table: {count} code shards but block scales for "
                       f"{len(block_scales)}; each shard needs its .weight_scale")
    ordered = [block_scales[i] for i in range(count)]
    if {t.dtype for t in ordered} != {"F8_E4M3"}:
        raise BadInput("NVFP4 block scales must be F8_E4M3")
    _check_shard_shapes(ordered, blocks_per_row, "NVFP4 block-scale")
    for index, info in enumerate(ordered):
        if info.shape[0] != parts[0][index].num_rows:
            raise BadInput(f"NVFP4 shard {index}: {parts[0][index].num_rows} code rows but "
                           f"{info.shape[0]} block-scale rows")
    parts.append(_segments(ordered))
    globals_found = {kind: shards.get(kind, {}) for kind in NVFP4_GLOBAL_SCALE_SUFFIXES}
    infos = [info for found in globals_found.values() for info in found.values()]
    # Some exports keep the one global scale beside the shards instead of in each of them.
    infos += [info for kind in NVFP4_GLOBAL_SCALE_SUFFIXES
              if (info := _find_one(tensors, f"{PLE_NAME_PART}ngram_embedding.{kind}"))]
    if not infos:
        raise BadInput("NVFP4 table without a global scale (weight_scale_2 or weight_global_scale)")
    values = {_read_scalar(info, "NVFP4 global scale").raw for info in infos}
    if len(values) > 1:
        raise BadInput("NVFP4 shards carry different global scales; expected one for the table")
    scale = _read_scalar(infos[0], "NVFP4 global scale")
    if scale.dtype != "F32":
        raise BadInput(f"NVFP4 global scale {infos[0].name} is {scale.dtype}; expected F32")
    return scale

