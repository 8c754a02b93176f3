"""The sidecar manifest `<table>.json` (docs/FORMAT.md, docs/manifest.schema.json). Standard library only."""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from ..core.constants import FORMAT_VERSION, GGML_TYPES, MANIFEST_SUFFIX, Encoding
from ..core.errors import BadInput
from ..core.fileio import create_partial, load_json

MANIFEST_FORMAT = "ple-prep-table"
MAX_MANIFEST_BYTES = 64 << 20
# How a scale's stored little-endian bytes become its value.
_SCALE_FORMATS = {"F32": "<f", "F16": "<e", "BF16": "<H"}

# (key, type) pairs a reader relies on; the schema file holds the full description.
_REQUIRED: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("format", str), ("format_version", int), ("file_id", str), ("tool_version", str),
    ("encoding", str), ("row_bytes", int), ("values_per_row", int), ("num_rows", int),
    ("first_row", int), ("total_rows", int), ("page_size", int), ("rows_per_page", int),
    ("data_offset", int), ("file_size", int), ("scale", (dict, type(None))), ("ngram", dict),
    ("source", dict), ("checksums", dict), ("layout", dict), ("residency", list),
)


def manifest_path(table_path: str | Path) -> Path:
    table_path = Path(table_path)
    return table_path.with_name(table_path.name + MANIFEST_SUFFIX)


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read a manifest and check the fields a reader trusts; BadInput on anything else."""
    path = Path(path)
    if not os.path.lexists(path):
        raise BadInput(f"manifest {path} not found: a table needs the .json written beside it")
    manifest = load_json(path, "manifest", limit=MAX_MANIFEST_BYTES)
    validate_manifest(manifest, path.name)
    return manifest


def scale_value(scale: dict[str, Any], name: str = "manifest") -> float:
    """The value a scale's exact bytes (`dtype`, `hex`) give; BadInput when `value` disagrees."""
    fmt = _SCALE_FORMATS.get(scale.get("dtype"))
    try:
        raw = bytes.fromhex(scale.get("hex"))
        (stored,) = struct.unpack(fmt, raw)
    except (TypeError, ValueError, struct.error):
        raise BadInput(f"{name}: the scale must be BF16, F16 or F32 with the hex of its bytes") from None
    value = struct.unpack("<f", struct.pack("<I", stored << 16))[0] if scale["dtype"] == "BF16" else stored
    if not math.isfinite(value) or value == 0:
        raise BadInput(f"{name}: the scale's bytes give {value}; a scale must be finite and non-zero")
    if scale.get("value") != value:
        raise BadInput(f"{name}: the scale's value {scale.get('value')!r} disagrees with its bytes "
                       f"({scale['dtype']} 0x{scale['hex']} is {value!r})")
    return value


def spec_digest(scale: dict[str, Any] | None, ngram: dict[str, Any]) -> bytes:
    """SHA-256 of what turns tokens into rows and rows into values: the scale's exact bytes and the
    hash spec, as canonical JSON. The data file's header holds it (docs/FORMAT.md)."""
    covered = {"scale": None if scale is None else {"dtype": scale.get("dtype"), "hex": scale.get("hex")},
               "ngram": ngram}
    return hashlib.sha256(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()).digest()


def validate_manifest(manifest: Any, name: str = "manifest") -> None:
    if not isinstance(manifest, dict):
        raise BadInput(f"{name}: the manifest is not a JSON object")
    wrong = [key for key, kind in _REQUIRED
             if key not in manifest or not isinstance(manifest[key], kind)
             or (kind is int and isinstance(manifest[key], bool))]
    if wrong:
        raise BadInput(f"{name}: missing or mistyped manifest fields: {', '.join(wrong)}")
    if manifest["format"] != MANIFEST_FORMAT or manifest["format_version"] != FORMAT_VERSION:
        raise BadInput(f"{name}: not a ple-prep v{FORMAT_VERSION} manifest")
    try:
        encoding = Encoding.from_label(manifest["encoding"])
    except ValueError:
        raise BadInput(f"{name}: unknown encoding {manifest['encoding']!r}") from None
    # `ggml_type` came with GGUF input; manifests of other encodings may lack it or hold null.
    ggml_type = manifest.get("ggml_type")
    expected = GGML_TYPES.get(encoding)
    if expected is None and ggml_type is not None:
        raise BadInput(f"{name}: ggml_type {ggml_type!r} given for a {encoding.label} table")
    if expected is not None and ggml_type != {"name": expected[0], "id": expected[1]}:
        raise BadInput(f"{name}: a {encoding.label} table needs ggml_type "
                       f"{{\"name\": \"{expected[0]}\", \"id\": {expected[1]}}}, not {ggml_type!r}")
    scale = manifest["scale"]
    if scale is not None:
        value = scale.get("value")
        # A huge JSON integer cannot become a float: refuse it rather than overflow.
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not -1e308 < value < 1e308 or not math.isfinite(value) or value == 0
                or not isinstance(scale.get("hex"), str) or not isinstance(scale.get("dtype"), str)):
            raise BadInput(f"{name}: the scale must have a finite non-zero value, dtype and hex")
        scale_value(scale, name)
    checksums = manifest["checksums"]
    blocks = checksums.get("blocks")
    block_bytes = checksums.get("block_bytes")
    if (checksums.get("algorithm") != "crc32" or not isinstance(blocks, list)
            or not isinstance(block_bytes, int) or block_bytes <= 0
            or not all(isinstance(b, int) for b in blocks)):
        raise BadInput(f"{name}: checksums must be crc32 blocks")
    data_bytes = manifest["file_size"] - manifest["data_offset"]
    if len(blocks) != -(-data_bytes // block_bytes):
        raise BadInput(f"{name}: {len(blocks)} checksum blocks do not cover {data_bytes} data bytes")
    if not 0 <= manifest["first_row"] <= manifest["first_row"] + manifest["num_rows"] <= manifest["total_rows"]:
        raise BadInput(f"{name}: rows [{manifest['first_row']}, +{manifest['num_rows']}) are outside "
                       f"the table of {manifest['total_rows']}")
    _validate_tensor_parallel(manifest, name)


def _validate_tensor_parallel(manifest: dict[str, Any], name: str) -> None:
    """A rank file's manifest records {"rank", "size"}, and its rows must be that rank's block."""
    tp = manifest.get("tensor_parallel")
    if tp is None:
        return
    if (not isinstance(tp, dict) or not all(type(tp.get(k)) is int for k in ("rank", "size"))
            or not 0 <= tp["rank"] < tp["size"]):
        raise BadInput(f"{name}: tensor_parallel must be {{rank, size}} with 0 <= rank < size")
    per_rank, remainder = divmod(manifest["total_rows"], tp["size"])
    if remainder or (manifest["first_row"], manifest["num_rows"]) != (tp["rank"] * per_rank, per_rank):
        raise BadInput(f"{name}: rows [{manifest['first_row']}, +{manifest['num_rows']}) are not "
                       f"rank {tp['rank']} of {tp['size']}'s block of the {manifest['total_rows']} rows")


def write_manifest(manifest: dict[str, Any], final: Path, token: str | None = None) -> Path:
    """Write the manifest of `final` to a new temporary file (fsynced); the caller publishes it."""
    data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    descriptor, temporary = create_partial(final, token)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary
