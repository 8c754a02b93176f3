"""The sidecar manifest `<table>.json` (docs/FORMAT.md). Standard library only.

Its JSON Schema, `manifest.schema.json` beside this module, is the one description of the format:
`validate_with_schema` checks a manifest against all of it (`write_manifest` before writing one,
verify and inspect too, with the `jsonschema` package), and the reader's check at open
(`validate_manifest`) is a subset of it that takes its required keys, enumerations and patterns
from the same file, so the two cannot disagree on those; tests/test_manifest_schema.py holds the
subset to the schema on every manifest convert writes and on every broken one it lists.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

from ..core.constants import GGML_TYPES, MANIFEST_SUFFIX, READ_VERSIONS, Encoding
from ..core.errors import BadInput
from ..core.fileio import load_json, partial_output

MANIFEST_FORMAT = "ple-prep-table"
MAX_MANIFEST_BYTES = 64 << 20
# How a scale's stored little-endian bytes become its value.
_SCALE_FORMATS = {"F32": "<f", "F16": "<e", "BF16": "<H"}

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
_PROPERTIES = SCHEMA["properties"]
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "object": dict, "array": list, "number": (int, float), "null": type(None)}
_FILE_ID = re.compile(_PROPERTIES["file_id"]["pattern"])
_SHA256 = re.compile(_PROPERTIES["source"]["properties"]["table_sha256"]["pattern"])
_PAGE_SIZES = frozenset(_PROPERTIES["page_size"]["enum"])
_LAYOUT_KINDS = frozenset(_PROPERTIES["layout"]["properties"]["kind"]["enum"])
_ENCODINGS_WITH_SCALE = frozenset(("fp8_e4m3", "nvfp4_packed"))
# JSON, and so the schema, does not tell 1.0 from 1. A double holds every integer below 2**53
# exactly, so a whole number below it is that integer; one at or above it may have been rounded on
# its way (the hash's multipliers need all 64 bits), so it stays a float, which an integer field refuses.
_EXACT_IN_A_DOUBLE = 2**53


def _json_types(key: str) -> type | tuple[type, ...] | None:
    """The Python types a top-level property of the schema allows (None: not a plain type)."""
    prop = _PROPERTIES[key]
    if "type" in prop:
        return _JSON_TYPES[prop["type"]]
    if "oneOf" in prop and all("type" in choice for choice in prop["oneOf"]):
        return tuple(_JSON_TYPES[choice["type"]] for choice in prop["oneOf"])
    if "const" in prop or "enum" in prop:
        values = prop.get("enum", [prop.get("const")])
        return tuple({type(value) for value in values})
    return None


_REQUIRED = tuple((key, _json_types(key)) for key in SCHEMA["required"])


def manifest_path(table_path: str | Path) -> Path:
    table_path = Path(table_path)
    return table_path.with_name(table_path.name + MANIFEST_SUFFIX)


def load_table_manifest(table_path: str | Path, manifest: str | Path | None = None) -> dict[str, Any]:
    """The manifest of the prepared table at `table_path` (`manifest`, else the table's name + .json),
    after checking that `table_path` names a table: a missing path, a folder, or the manifest itself
    given in its place each get a message that says so."""
    table_path = Path(table_path)
    if table_path.is_dir():
        raise BadInput(f"{table_path} is a folder; give the prepared table file in it (the one beside "
                       f"its {MANIFEST_SUFFIX} manifest)")
    if table_path.suffix == MANIFEST_SUFFIX and manifest is None and table_path.is_file():
        table = table_path.with_suffix("")
        raise BadInput(f"{table_path} is a manifest; give the table it describes"
                       + (f" ({table})" if table.is_file() else ""))
    if not table_path.exists():
        beside = sorted(p.name for p in table_path.parent.glob("*" + MANIFEST_SUFFIX)
                        if p.with_suffix("").is_file())[:5] if table_path.parent.is_dir() else []
        raise BadInput(f"no such file: {table_path}"
                       + (f" (tables in {table_path.parent}: {', '.join(n[:-len(MANIFEST_SUFFIX)] for n in beside)})"
                          if beside else ""))
    return load_manifest(Path(manifest) if manifest is not None else manifest_path(table_path))


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


def check_spec_digest(header_digest: bytes, manifest: dict[str, Any], name: str, manifest_name: str) -> None:
    """Refuse a manifest whose scale or hash spec is not what the table was written with: the data
    file's CRC-covered header holds their digest (`header_digest`; docs/FORMAT.md)."""
    if not any(header_digest):
        raise BadInput(f"{name} has no spec digest in its header (written by an older ple-prep): "
                       f"convert it again")
    if header_digest != spec_digest(manifest["scale"], manifest["ngram"]):
        raise BadInput(f"{manifest_name} was changed after conversion: its scale or hash spec (ngram) "
                       f"is not what {name} was written with; refusing to serve wrong values")


def validate_manifest(manifest: Any, name: str = "manifest") -> None:
    """BadInput unless `manifest` holds what a reader trusts. Whole numbers written with a fraction
    (1.0) become the integers they are, in place."""
    if not isinstance(manifest, dict):
        raise BadInput(f"{name}: the manifest is not a JSON object")
    _whole_numbers_as_ints(manifest)
    wrong = [key for key, kind in _REQUIRED
             if key not in manifest or (kind is not None and not isinstance(manifest[key], kind))
             or (isinstance(manifest[key], bool) and kind is not None and bool not in _as_tuple(kind))]
    if wrong:
        raise BadInput(f"{name}: missing or mistyped manifest fields: {', '.join(wrong)}")
    if manifest["format"] != MANIFEST_FORMAT or manifest["format_version"] not in READ_VERSIONS:
        raise BadInput(f"{name}: not a ple-prep manifest of version "
                       f"{' or '.join(map(str, READ_VERSIONS))}")
    if not _FILE_ID.fullmatch(manifest["file_id"]):
        raise BadInput(f"{name}: file_id {manifest['file_id']!r} is not 32 lowercase hex digits")
    if not manifest["data_file"]:
        raise BadInput(f"{name}: data_file is empty")
    if manifest["page_size"] not in _PAGE_SIZES:
        raise BadInput(f"{name}: page size {manifest['page_size']} is not a power of two from 512 to 64 MiB")
    for key in ("row_bytes", "values_per_row", "num_rows", "rows_per_page", "total_rows"):
        if manifest[key] < 1:
            raise BadInput(f"{name}: {key} {manifest[key]} must be at least 1")
    source, layout = manifest["source"], manifest["layout"]
    for key in ("table_sha256", "sample_sha256"):
        if not isinstance(source.get(key), str) or not _SHA256.fullmatch(source[key]):
            raise BadInput(f"{name}: source.{key} must be 64 lowercase hex digits")
    if layout.get("kind") not in _LAYOUT_KINDS or not _is_count(layout.get("num_placed")):
        raise BadInput(f"{name}: layout must be one of {sorted(_LAYOUT_KINDS)} with num_placed >= 0, "
                       f"not {layout.get('kind')!r}")
    _validate_ngram(manifest["ngram"], name)
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
    if (scale is not None) != (encoding.label in _ENCODINGS_WITH_SCALE):
        raise BadInput(f"{name}: a {encoding.label} table "
                       + ("needs a scale" if scale is None else "has no scale"))
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
            or not blocks or not all(type(b) is int and 0 <= b < 2**32 for b in blocks)):
        raise BadInput(f"{name}: checksums must be crc32 blocks")
    data_bytes = manifest["file_size"] - manifest["data_offset"]
    if len(blocks) != -(-data_bytes // block_bytes):
        raise BadInput(f"{name}: {len(blocks)} checksum blocks do not cover {data_bytes} data bytes")
    if not 0 <= manifest["first_row"] <= manifest["first_row"] + manifest["num_rows"] <= manifest["total_rows"]:
        raise BadInput(f"{name}: rows [{manifest['first_row']}, +{manifest['num_rows']}) are outside "
                       f"the table of {manifest['total_rows']}")
    _validate_tensor_parallel(manifest, name)


def _whole_numbers_as_ints(manifest: dict[str, Any]) -> None:
    """Each float of `manifest`, at any depth, that is whole and below 2**53 replaced by its int."""
    pending: list[dict[str, Any] | list[Any]] = [manifest]
    while pending:
        node = pending.pop()
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, float):
                if value.is_integer() and abs(value) < _EXACT_IN_A_DOUBLE:
                    node[key] = int(value)
            elif isinstance(value, (dict, list)):
                pending.append(value)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _validate_ngram(ngram: dict[str, Any], name: str) -> None:
    """The hash constants are integers (never floats: multipliers need up to 64 bits)."""
    required = _PROPERTIES["ngram"]["required"]
    lists = ("multipliers", "head_sizes", "head_offsets")
    missing = [key for key in required if key not in ngram]
    wrong = [key for key in required if key in ngram and key not in lists and not _is_count(ngram[key])]
    wrong += [key for key in lists if key in ngram and not (
        isinstance(ngram[key], list) and ngram[key] and all(_is_count(v) and v < 2**64 for v in ngram[key]))]
    if missing or wrong:
        raise BadInput(f"{name}: ngram fields missing or not non-negative integers: {', '.join(missing + wrong)}")


def validate_with_schema(manifest: Any, name: str = "manifest") -> None:
    """Check a manifest against the whole JSON Schema (needs `jsonschema`); BadInput naming the first
    problems. The offline tools call it; the reader's fast check at open is `validate_manifest`."""
    import jsonschema

    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(manifest), key=lambda e: list(e.path))
    if errors:
        problems = [f"{'.'.join(map(str, error.path)) or '(top)'}: {error.message[:200]}" for error in errors[:3]]
        raise BadInput(f"{name} does not match the manifest schema: {'; '.join(problems)}"
                       + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))


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
    """Write the manifest of `final` to a new temporary file (fsynced); the caller publishes it.
    BadInput, and nothing written, when the manifest does not match the schema."""
    data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    # What is checked is what readers will parse (the dict holds tuples, which JSON makes arrays).
    validate_with_schema(json.loads(data), final.name)
    with partial_output(final, token) as (handle, temporary):
        handle.write(data)
    return temporary
