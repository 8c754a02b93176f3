"""Hostile input: random and mutated headers, metadata and manifests give BadInput and nothing else.

Property-based (hypothesis) over the four parsers that see untrusted bytes: the safetensors header,
the GGUF metadata (file parse and spec_from_metadata), the prepared file's header, and the
manifest. Example counts are fixed per test (EXAMPLES below; docs/RELIABILITY.md sums them).
"""
from __future__ import annotations

import io
import json
import os
import re
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ple_prep.converters.gguf import open_gguf, spec_from_metadata
from ple_prep.converters.safetensors import DTYPE_BITS, read_header
from ple_prep.core.constants import HEADER_SIZE, HEADER_STRUCT, MAGIC, Encoding
from ple_prep.core.errors import BadInput
from ple_prep.format.header import Header
from ple_prep.format.manifest import load_manifest, validate_manifest, validate_with_schema
from ple_prep.ngram import NgramSpec
from ple_prep.offline.profile import Profiler, load_profile, save_profile
from ple_prep.offline.prompts import PromptReader
from ple_prep.tools.fixtures import FIXTURE_ROWS, add_gguf_metadata, fixture_config, write_safetensors

# PLE_FUZZ_SCALE multiplies every count for a longer stress run (docs/RELIABILITY.md).
SCALE = int(os.environ.get("PLE_FUZZ_SCALE", "1"))
EXAMPLES = {"safetensors_random": 300, "safetensors_structured": 200, "safetensors_mutated": 300,
            "gguf_metadata": 200, "gguf_file_mutated": 300, "header_random": 300,
            "header_fields": 300, "manifest_random": 200, "manifest_mutated": 300,
            "manifest_bytes": 200, "profile_mutated": 300, "prompts_mutated": 300}
EXAMPLES = {name: count * SCALE for name, count in EXAMPLES.items()}
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCRATCH = Path(tempfile.mkdtemp(prefix="ple-fuzz-"))
U64 = st.integers(0, 2**64 - 1)
HOSTILE_INTS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from(
    [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | HOSTILE_INTS | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=10)


def _mutate(data: bytes, draw_ops) -> bytes:
    """Apply (kind, position, value) edits: flip a byte, write a hostile u64, cut, or insert."""
    buffer = bytearray(data)
    for kind, position, value in draw_ops:
        position %= max(1, len(buffer))
        if kind == "flip" and buffer:
            buffer[position] ^= (value % 255) + 1
        elif kind == "u64" and len(buffer) >= 8:
            position = min(position, len(buffer) - 8)
            buffer[position:position + 8] = struct.pack("<Q", value % 2**64)
        elif kind == "cut":
            del buffer[position:]
        elif kind == "insert":
            buffer[position:position] = value.to_bytes(8, "little", signed=False)[: 1 + value % 8]
    return bytes(buffer)


MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "flip", "u64", "cut", "insert"]),
                               st.integers(0, 2**20), st.sampled_from(
                                   [0, 1, 255, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]) | U64),
                     min_size=1, max_size=4)


def _write(name: str, data: bytes) -> Path:
    path = SCRATCH / name
    path.write_bytes(data)
    return path


# --- safetensors header ---------------------------------------------------------------------------

def _reference_accepts(data: bytes) -> bool | None:
    """The `safetensors` library's verdict: True or False, or None where the two may differ by
    design: a dtype one of them does not know (this reader places such a tensor and refuses it only
    if the table needs it)."""
    from safetensors import deserialize

    try:
        tensors = deserialize(data)
    except Exception as exc:  # the binding raises its own SafetensorError and plain errors
        return None if "unknown variant" in str(exc) else False
    return True if all(entry["dtype"] in DTYPE_BITS for _, entry in tensors) else None


def _read_header_bytes(data: bytes) -> None:
    """Accepted exactly when the format's reference implementation accepts it."""
    expected = _reference_accepts(data)
    try:
        tensors = read_header(_write("fuzz.safetensors", data))
    except BadInput:
        assert expected is not True, "refused a file the safetensors library reads"
        return
    assert expected is not False, "accepted a file the safetensors library refuses"
    # Accepted: every tensor lies inside the file, exactly sized.
    for info in tensors.values():
        assert 0 <= info.offset and info.offset + info.nbytes <= len(data)


@settings(max_examples=EXAMPLES["safetensors_random"], **FAST)
@given(st.binary(max_size=512))
def test_read_header_random_bytes_give_bad_input(data):
    _read_header_bytes(data)


ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(sorted(DTYPE_BITS)) | st.text(max_size=6) | HOSTILE_INTS,
    "shape": st.lists(HOSTILE_INTS, max_size=4) | JSON_VALUES,
    "data_offsets": st.lists(HOSTILE_INTS, min_size=0, max_size=3) | JSON_VALUES,
})


@settings(max_examples=EXAMPLES["safetensors_structured"], **FAST)
@given(st.dictionaries(st.text(max_size=12), ENTRY | JSON_VALUES, max_size=4),
       st.integers(-8, 8), st.binary(max_size=64))
def test_read_header_hostile_json_entries_give_bad_input(header, length_error, data):
    raw = json.dumps(header).encode()
    _read_header_bytes(struct.pack("<Q", max(0, len(raw) + length_error)) + raw + data)


def _real_safetensors() -> bytes:
    path = SCRATCH / "real.safetensors"
    write_safetensors(path, {
        "a.ple.ple_embedding.ngram_embedding.shard_0.weight": ("float8_e4m3fn", np.zeros((4, 160), np.uint8)),
        "a.ple.ple_embedding.ngram_embedding.weight_scale": ("bfloat16", np.array([0x3953], np.uint16)),
        "a.ple.ple_embedding.layer_multipliers": ("int64", np.array([1, 3, 5], np.int64)),
    })
    return path.read_bytes()


REAL_SAFETENSORS = _real_safetensors()


@settings(max_examples=EXAMPLES["safetensors_mutated"], **FAST)
@given(MUTATIONS)
def test_read_header_mutated_real_file_gives_bad_input(ops):
    _read_header_bytes(_mutate(REAL_SAFETENSORS, ops))


def test_read_header_refuses_absurd_lengths_before_allocating():
    # Claims of a 99 MB header or a 2**63-byte one, in files of a few bytes.
    for claimed in (99_000_000, 2**63, 2**64 - 1):
        path = _write("claim.safetensors", struct.pack("<Q", claimed) + b"{}")
        tracemalloc.start()
        with pytest.raises(BadInput, match="limit|past the end"):
            read_header(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
        tracemalloc.stop()
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadInput, match="nests deeper than 64 levels"):
        read_header(_write("deep.safetensors", struct.pack("<Q", len(deep)) + deep))
    huge_shape = json.dumps({"t": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}).encode()
    with pytest.raises(BadInput, match="do not hold"):
        read_header(_write("shape.safetensors", struct.pack("<Q", len(huge_shape)) + huge_shape + bytes(16)))


# --- GGUF metadata --------------------------------------------------------------------------------

SPEC = NgramSpec.from_config(fixture_config())
GGUF_KEYS = {
    "qwen4exp.vocab_size": 248320, "qwen4exp.embedding_length_per_layer_input": 160,
    "qwen4exp.ple.ngram_size": 3, "qwen4exp.ple.heads_per_ngram": 8,
    "qwen4exp.ple.eos_token_id": 248044, "qwen4exp.ple.layer_multipliers": list(SPEC.multipliers),
    "qwen4exp.ple.head_offsets": list(SPEC.head_offsets),
    "qwen4exp.ple.head_vocab_sizes": list(SPEC.head_sizes),
}


@settings(max_examples=EXAMPLES["gguf_metadata"], **FAST)
@given(st.dictionaries(st.sampled_from(sorted(GGUF_KEYS) + ["qwen4exp.ple.seed"]),
                       JSON_VALUES | st.lists(HOSTILE_INTS, max_size=17), max_size=3),
       st.sets(st.sampled_from(sorted(GGUF_KEYS)), max_size=2))
def test_spec_from_metadata_hostile_values_give_bad_input(changes, dropped):
    metadata = {k: v for k, v in GGUF_KEYS.items() if k not in dropped} | changes
    try:
        spec = spec_from_metadata(metadata)
    except BadInput:
        return
    assert spec.rows_used == sum(spec.head_sizes)


def test_spec_from_metadata_refuses_absurd_sizes_quickly():
    # Head sizes near 2**63 would make the consecutive-prime check run for hours.
    for first in (10**17, 2**62):
        sizes = [first + 2 * i for i in range(16)]
        offsets = [sum(sizes[:i]) for i in range(16)]
        with pytest.raises(BadInput):
            spec_from_metadata(GGUF_KEYS | {"qwen4exp.ple.head_vocab_sizes": sizes,
                                                      "qwen4exp.ple.head_offsets": offsets})
    many = 100_000
    with pytest.raises(BadInput):
        spec_from_metadata(GGUF_KEYS | {
            "qwen4exp.ple.heads_per_ngram": many // 2, "qwen4exp.ple.head_vocab_sizes": [3] * many,
            "qwen4exp.ple.head_offsets": [3 * i for i in range(many)]})


def _real_gguf() -> bytes:
    from gguf import GGMLQuantizationType, GGUFWriter

    path = SCRATCH / "real.gguf"
    writer = GGUFWriter(path, "qwen4exp")
    add_gguf_metadata(writer, SPEC)
    writer.add_tensor("per_layer_token_embd.weight", np.zeros((4, 170), np.uint8),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


REAL_GGUF = _real_gguf()


def test_open_gguf_real_small_file_parses_then_refuses_its_short_table():
    with pytest.raises(BadInput, match="has 4 rows but the hash reaches row"):
        open_gguf(_write("model.gguf", REAL_GGUF))


@settings(max_examples=EXAMPLES["gguf_file_mutated"], **FAST)
@given(MUTATIONS)
def test_open_gguf_mutated_file_gives_bad_input(ops):
    with pytest.raises(BadInput):
        open_gguf(_write("model.gguf", _mutate(REAL_GGUF, ops)))


def _gguf(tensors: int, pairs: int, body: bytes, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, pairs) + body + bytes(64)


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


@pytest.mark.parametrize("data, message", [
    # The file that made gguf.GGUFReader allocate until killed: an array of 2**40 strings.
    (_gguf(0, 1, _key(b"a") + struct.pack("<IIQ", 9, 8, 2**40)), "an array of 1099511627776 items"),
    (_gguf(0, 1, _key(b"a") + struct.pack("<IIQ", 9, 0, 2**63)), "an array of"),
    (_gguf(0, 2**60, b""), "key-value pairs"),
    (_gguf(2**60, 0, b""), "tensors"),
    (_gguf(0, 1, struct.pack("<Q", 2**62)), "a key"),
    (_gguf(0, 1, _key(b"a") + struct.pack("<IQ", 8, 2**50)), "a string value"),
    (_gguf(0, 1, _key(b"a") + struct.pack("<I", 77)), "value type 77"),
    (_gguf(0, 1, _key(b"a") + struct.pack("<II", 9, 99)), "array item type 99"),
    (_gguf(1, 0, _key(b"t") + struct.pack("<I", 2**31)), "dimensions"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0) + bytes(64), "big-endian"),
])
def test_open_gguf_refuses_hostile_counts_before_allocating(data, message):
    tracemalloc.start()
    with pytest.raises(BadInput, match=message):
        open_gguf(_write("hostile.gguf", data))
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


# --- prepared-file header -------------------------------------------------------------------------

VALID_HEADER = Header.for_table(page_size=4096, row_bytes=160, encoding=Encoding.FP8_E4M3,
                                values_per_row=160, num_rows=FIXTURE_ROWS, first_row=0, num_placed=300,
                                file_id=bytes(range(16)))


# Bytes per block and values per block of each encoding, as docs/FORMAT.md's table lists them.
FORMAT_BLOCKS = {1: (1, 1), 2: (1, 2), 3: (16, 9), 10: (1, 4), 11: (1, 2), 12: (1, 2), 13: (32, 34),
                 14: (32, 18), 15: (32, 20), 16: (32, 22), 17: (32, 24), 18: (32, 18)}


def _format_accepts(raw: bytes, file_size: int) -> bool:
    """The header rules of docs/FORMAT.md, restated independently of format/header.py."""
    if len(raw) < 128 or file_size < 128:
        return False
    (magic, version, page_size, row_bytes, rows_per_page, encoding, values_per_row, num_rows, first_row,
     num_placed, order_offset, data_offset, _, _) = struct.unpack_from("<8sIIIIIIQQQQQ16s32s", raw)
    if magic != b"PLEPREP\0" or version not in (1, 2) or any(raw[120:128]) or encoding not in FORMAT_BLOCKS:
        return False
    values_per_block, bytes_per_block = FORMAT_BLOCKS[encoding]
    if values_per_row == 0 or values_per_row % values_per_block:
        return False
    if row_bytes != values_per_row // values_per_block * bytes_per_block:
        return False
    if page_size not in [2**k for k in range(9, 27)] or not 0 < row_bytes <= page_size:
        return False
    if rows_per_page != page_size // row_bytes or not 0 < num_rows <= 2**32 - 1:
        return False
    if not 0 <= num_placed <= num_rows or first_row + num_rows > 2**32 - 1 or order_offset != 128:
        return False
    # The order map: 4 bytes a placed row, 12 in format v1.
    if data_offset != -(-(128 + {1: 12, 2: 4}[version] * num_placed) // page_size) * page_size:
        return False
    return file_size == data_offset + -(-num_rows // rows_per_page) * page_size


def _unpack(raw: bytes, file_size: int) -> None:
    """Accepted exactly when docs/FORMAT.md's rules hold."""
    expected = _format_accepts(raw, file_size)
    try:
        header = Header.unpack(raw, file_size)
    except BadInput:
        assert not expected, "refused a header the format allows"
        return
    assert expected, "accepted a header the format refuses"
    assert header.file_size == file_size and header.rows_per_page * header.row_bytes <= header.page_size
    assert header.first_row + header.num_rows <= 2**32 - 1


@settings(max_examples=EXAMPLES["header_random"], **FAST)
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 8), st.integers(0, 2**64))
def test_header_unpack_random_bytes_give_bad_input(raw, file_size):
    _unpack(MAGIC + raw[8:] if raw[:1] == b"\x00" else raw, file_size)


FIELD_INTS = st.one_of(st.sampled_from([0, 1, 160, 4096, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
FIELD_U64 = st.one_of(st.sampled_from([0, 1, 4096, FIXTURE_ROWS, 2**32, 2**63, 2**64 - 1]), U64)


@settings(max_examples=EXAMPLES["header_fields"], **FAST)
@given(st.integers(0, 10), st.tuples(FIELD_INTS, FIELD_INTS, FIELD_INTS, FIELD_INTS, FIELD_INTS,
                                     FIELD_INTS, FIELD_U64, FIELD_U64, FIELD_U64, FIELD_U64, FIELD_U64),
       st.booleans(), st.integers(-8192, 8192))
def test_header_unpack_hostile_fields_give_bad_input(keep, fields, size_from_header, size_error):
    valid = HEADER_STRUCT.unpack(VALID_HEADER.pack()[:HEADER_STRUCT.size])
    # Keep some of the valid fields so that deep checks (geometry, file size) are reached too.
    mixed = [valid[1 + i] if i < keep else fields[i] for i in range(11)]
    raw = HEADER_STRUCT.pack(MAGIC, *mixed, bytes(16), bytes(32)).ljust(HEADER_SIZE, b"\0")
    file_size = (VALID_HEADER.file_size if size_from_header else 0) + size_error
    _unpack(raw, max(0, file_size))


# --- manifest -------------------------------------------------------------------------------------

def _valid_manifest() -> dict:
    return _as_json({
        "format": "ple-prep-table", "format_version": 1, "file_id": "00" * 16, "tool_version": "0.1.0",
        "data_file": "t.bin", "ggml_type": None, "file_size": VALID_HEADER.file_size, "page_size": 4096,
        "rows_per_page": 25, "data_offset": VALID_HEADER.data_offset, "encoding": "fp8_e4m3",
        "row_bytes": 160, "values_per_row": 160, "num_rows": FIXTURE_ROWS, "first_row": 0,
        "total_rows": FIXTURE_ROWS, "scale": {"dtype": "BF16", "hex": "5339", "value": 0.00020122528076171875},
        "ngram": SPEC.to_json(),
        "source": {"format": "safetensors", "model": "m", "files": [{"name": "model.safetensors", "size": 1}],
                   "table_sha256": "0" * 64, "sample_rows": 256, "sample_sha256": "1" * 64},
        "checksums": {"algorithm": "crc32", "block_bytes": 64 << 20, "header_crc32": 0, "blocks": [0]},
        "layout": {"kind": "source-order", "num_placed": 0}, "residency": [],
    })


def _as_json(manifest: dict) -> dict:
    """As a reader gets it from the file (tuples become lists)."""
    return json.loads(json.dumps(manifest))


def test_valid_manifest_fixture_is_valid():
    validate_manifest(_valid_manifest())
    validate_with_schema(_valid_manifest())


@settings(max_examples=EXAMPLES["manifest_random"], **FAST)
@given(JSON_VALUES)
def test_validate_manifest_random_values_give_bad_input(value):
    with pytest.raises(BadInput):
        validate_manifest(value)


PATHS = st.lists(st.sampled_from(sorted(_valid_manifest()) + ["scale.value", "scale.hex",
                                 "checksums.blocks", "checksums.block_bytes", "checksums.algorithm",
                                 "tensor_parallel"]), min_size=1, max_size=3)


def _cross_fields_hold(m: dict) -> bool:
    """The manifest rules no JSON Schema can state (docs/FORMAT.md), restated: the scale's value is
    what its bytes give, the checksum blocks cover the data, the rows lie in the table, and a rank
    file holds its rank's block."""
    scale = m["scale"]
    if scale is not None:
        raw = bytes.fromhex(scale["hex"])
        if scale["dtype"] == "BF16" and len(raw) == 2:
            value = struct.unpack("<f", b"\0\0" + raw)[0]
        elif (scale["dtype"], len(raw)) in (("F16", 2), ("F32", 4)):
            value = struct.unpack("<e" if scale["dtype"] == "F16" else "<f", raw)[0]
        else:
            return False
        if value != scale["value"] or not np.isfinite(value) or value == 0:
            return False
    data_bytes = m["file_size"] - m["data_offset"]
    if len(m["checksums"]["blocks"]) != -(-data_bytes // m["checksums"]["block_bytes"]):
        return False
    if not 0 <= m["first_row"] <= m["first_row"] + m["num_rows"] <= m["total_rows"]:
        return False
    tp = m.get("tensor_parallel")
    if tp is not None:
        per_rank, remainder = divmod(m["total_rows"], tp["size"])
        if remainder or (m["first_row"], m["num_rows"]) != (tp["rank"] * per_rank, per_rank):
            return False
    return True


def _holds_rounded_whole_float(value) -> bool:
    if isinstance(value, dict):
        return any(_holds_rounded_whole_float(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_rounded_whole_float(item) for item in value)
    return isinstance(value, float) and value.is_integer() and abs(value) >= 2**53


@settings(max_examples=EXAMPLES["manifest_mutated"], **FAST)
@given(PATHS, st.lists(JSON_VALUES | HOSTILE_INTS, min_size=3, max_size=3), st.booleans())
def test_validate_manifest_mutated_fields_give_bad_input(paths, values, delete):
    manifest = _valid_manifest()
    for path, value in zip(paths, values):
        parent, _, key = path.rpartition(".")
        target = manifest.get(parent) if parent else manifest
        if not isinstance(target, dict):
            continue
        if delete:
            target.pop(key, None)
        else:
            target[key] = value
    try:
        validate_with_schema(manifest)
        # A whole float at or above 2**53 is an integer to the schema, which cannot tell 1.0 from
        # 1, but a double may have rounded it: the reader refuses it where an integer is needed.
        expected = None if _holds_rounded_whole_float(manifest) else _cross_fields_hold(manifest)
    except BadInput:
        expected = None  # the reader's fast check is a subset of the schema: it may accept this
    try:
        validate_manifest(manifest)
    except BadInput:
        assert expected is not True, "refused a manifest the schema and the cross-field rules allow"
        return
    assert expected is not False, "accepted a manifest that breaks a cross-field rule"
    # Accepted: what a reader relies on still holds.
    assert isinstance(manifest["num_rows"], int) and isinstance(manifest["checksums"]["blocks"], list)
    if manifest["scale"] is not None:
        assert np.isfinite(float(manifest["scale"]["value"]))


@settings(max_examples=EXAMPLES["manifest_bytes"], **FAST)
@given(MUTATIONS)
def test_load_manifest_mutated_bytes_give_bad_input(ops):
    raw = json.dumps(_valid_manifest(), indent=2).encode()
    mutated = _mutate(raw, ops)
    try:
        parsed = json.loads(mutated)
    except ValueError:
        parsed = None
    try:
        load_manifest(_write("t.bin.json", mutated))
    except BadInput:
        # Refused: never the valid manifest itself (a change only in its whitespace).
        assert parsed != _valid_manifest()
        return
    # Accepted: it parses to an object (a mutation the reader's fast check lets through is caught
    # at open, where the header is compared).
    assert isinstance(parsed, dict)


def test_load_manifest_refuses_huge_or_deep_files_before_reading():
    huge = SCRATCH / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate((64 << 20) + 1)  # sparse: costs no disk
    tracemalloc.start()
    with pytest.raises(BadInput, match="over the 64 MiB limit"):
        load_manifest(huge)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()
    huge.unlink()
    with pytest.raises(BadInput, match="nests deeper than 64 levels"):
        load_manifest(_write("deep.json", b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000))


# --- profile ----------------------------------------------------------------------------------------

def _real_profile_stream() -> bytes:
    """A real profile's stream before compression: random token ids through the fixture's hash."""
    import zstandard

    profiler = Profiler(SPEC)
    rng = np.random.default_rng(0)
    for _ in range(40):
        profiler.add_request(rng.integers(0, SPEC.vocab_size, size=int(rng.integers(1, 200))))
    path = SCRATCH / "real.prof"
    save_profile(profiler.finish(model="fuzz", tokenizer_sha256=None, inputs=[]), path)
    with open(path, "rb") as handle:
        return zstandard.ZstdDecompressor().stream_reader(handle).read()


REAL_PROFILE = _real_profile_stream()


@settings(max_examples=EXAMPLES["profile_mutated"], **FAST)
@given(MUTATIONS)
def test_load_profile_mutated_stream_gives_bad_input_or_a_profile(ops):
    import zstandard

    path = _write("fuzz.prof", zstandard.ZstdCompressor().compress(_mutate(REAL_PROFILE, ops)))
    try:
        profile = load_profile(path)
    except BadInput:
        return
    # Accepted: what the planner relies on holds (each order's keys ascend, a count a key).
    for part in profile.parts.values():
        for keys, counts in part.groups.values():
            assert keys.shape == counts.shape and bool(np.all(keys[1:] > keys[:-1]))


# --- prompt files ---------------------------------------------------------------------------------

def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


PROMPT_FILES = {
    ".jsonl": "".join(json.dumps(record) + "\n" for record in (
        {"text": "the quick brown fox"}, {"prompt": "def f(x): return x"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"token_ids": [1, 2, 3, 400, 5]})).encode(),
    ".txt": "Some text, é ü 漢字 and more.\n".encode() * 20,
    ".npy": _npy_bytes(np.arange(50, dtype=np.int64)),
}


@settings(max_examples=EXAMPLES["prompts_mutated"], **FAST)
@given(st.sampled_from(sorted(PROMPT_FILES)), MUTATIONS)
def test_mutated_prompt_files_give_bad_input_or_token_ids(fp8_checkpoint, suffix, ops):
    reader = PromptReader(fp8_checkpoint, SPEC)
    try:
        requests = list(reader.requests(_write("fuzz" + suffix, _mutate(PROMPT_FILES[suffix], ops))))
    except BadInput:
        return
    for tokens in requests:
        assert tokens.dtype == np.int64 and tokens.ndim == 1
        assert not len(tokens) or (tokens.min() >= 0 and tokens.max() < SPEC.vocab_size)


# --- no pickle ------------------------------------------------------------------------------------

def _unpickling_lines(folder: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """Lines of the .py files under `folder` that unpickle or hand data through a pickling channel."""
    offenders = []
    for path in folder.rglob("*.py"):
        if path in skip:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            # The process pools and queues of concurrent.futures and multiprocessing pickle what they carry.
            if (re.search(r"\bimport pickle|\bpickle\.|\bcPickle|\bdill\b|\bjoblib\b", code)
                    or re.search(r"ProcessPoolExecutor|multiprocessing\.(Pool|Queue|SimpleQueue|Pipe|Manager)\b", code)
                    or re.search(r"context\.(Pool|Queue|SimpleQueue|Pipe|Manager)\(", code)
                    or re.search(r"allow_pickle\s*=\s*True", code)
                    or re.search(r"torch\.load\((?!.*weights_only=True)", code)
                    or (re.search(r"\bnp\.load\(", code) and "allow_pickle=False" not in code)):
                offenders.append(f"{path.relative_to(folder)}:{number}: {line.strip()}")
    return offenders


def test_package_never_unpickles():
    assert _unpickling_lines(Path(__file__).resolve().parent.parent / "ple_prep") == []


def test_benchmarks_and_tests_never_unpickle():
    root = Path(__file__).resolve().parent.parent
    for folder in ("bench", "tests", "scripts"):
        assert _unpickling_lines(root / folder, skip=(Path(__file__).resolve(),)) == []
