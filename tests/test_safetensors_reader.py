"""The safetensors reader: finding the table wherever it sits, and reading its exact bytes."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from safetensors import TensorSpec, serialize_file
from support.handmade import INDEX, find, load_tensors, pack_safetensors, save_tensors

from ple_prep.converters import open_source
from ple_prep.converters.safetensors import DTYPE_BITS, open_checkpoint, read_header
from ple_prep.core.constants import Encoding
from ple_prep.core.errors import BadInput
from ple_prep.tools.fixtures import FIXTURE_ROWS, FIXTURE_SCALE_BF16, make_checkpoint

SHARD = "ngram_embedding.shard_{}.weight"


def stored_table(folder, kind="weight"):
    """The table as the concatenation of its shard tensors in index order, read independently."""
    files = load_tensors(folder)
    shards = {}
    for tensors in files.values():
        for name, tensor in tensors.items():
            if ".ngram_embedding.shard_" in name and name.endswith(f".{kind}"):
                shards[int(name.split(".shard_")[1].split(".")[0])] = tensor.rows()
    return np.concatenate([shards[i] for i in range(len(shards))])


@pytest.mark.parametrize("variant, encoding, row_bytes",
                         [("fp8", Encoding.FP8_E4M3, 160), ("bf16", Encoding.BF16, 320),
                          ("nvfp4", Encoding.NVFP4_PACKED, 90)])
def test_open_checkpoint_reads_each_variant(variant, encoding, row_bytes, request):
    folder = request.getfixturevalue(f"{variant}_checkpoint")
    with open_checkpoint(folder) as source:
        assert (source.encoding, source.row_bytes, source.values_per_row) == (encoding, row_bytes, 160)
        assert source.num_rows == FIXTURE_ROWS == source.spec.rows_stored
        assert source.extra["shards"] == 128 and source.extra["shard_rows"] == 132
        rows = source.read_rows(0, source.num_rows)
    if variant == "nvfp4":
        expected = np.concatenate([stored_table(folder), stored_table(folder, "weight_scale")], axis=1)
    else:
        expected = stored_table(folder)
    assert np.array_equal(rows, expected)


def test_open_checkpoint_fp8_scale_exact(fp8_checkpoint):
    with open_checkpoint(fp8_checkpoint) as source:
        assert source.scale.dtype == "BF16"
        assert source.scale.raw == FIXTURE_SCALE_BF16.to_bytes(2, "little")
        assert source.scale.value == struct.unpack("<f", struct.pack("<I", FIXTURE_SCALE_BF16 << 16))[0]


def test_open_checkpoint_without_index_reads_every_header(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "fp8", with_index=False, num_files=4)
    assert not (folder / INDEX).exists()
    with open_checkpoint(folder) as source:
        assert source.num_rows == FIXTURE_ROWS
        assert np.array_equal(source.read_rows(0, source.num_rows), stored_table(folder))
        assert [f.name for f in source.files][1:] == sorted(p.name for p in folder.glob("*.safetensors"))


def test_open_checkpoint_index_limits_files_read(tmp_path):
    # A broken file the index does not name for any PLE tensor is never opened.
    folder = make_checkpoint(tmp_path / "c", "fp8")
    (folder / "unrelated.safetensors").write_bytes(b"garbage")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "unrelated.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    with open_checkpoint(folder) as source:
        assert source.num_rows == FIXTURE_ROWS


def test_open_checkpoint_reexport_prefix(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "bf16", prefix="base_model.model.layers.1.ple.ple_embedding.")
    with open_checkpoint(folder) as source:
        assert source.extra["tensor_prefix"] == "base_model.model.layers.1"
        assert np.array_equal(source.read_rows(0, source.num_rows), stored_table(folder))


def test_open_checkpoint_shards_spread_with_constants_elsewhere(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "fp8", num_files=5)
    files = load_tensors(folder)
    scale_file, _ = find(files, ".ngram_embedding.weight_scale")
    constants_file, _ = find(files, ".ple_embedding.layer_multipliers")
    shard_files = {find(files, f".{SHARD.format(i)}")[0] for i in range(128)}
    assert len(shard_files) == 5 and scale_file != constants_file
    with open_checkpoint(folder) as source:
        assert len(source.extra["constant_tensors"]) == 3
        ids = np.random.default_rng(2).integers(0, source.num_rows, 500)
        assert np.array_equal(source.gather_rows(ids), stored_table(folder)[ids])


def test_open_checkpoint_constants_absent_is_fine(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "bf16")
    files = load_tensors(folder)
    for suffix in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        name, tensor = find(files, suffix)
        del files[name][tensor]
    save_tensors(folder, files)
    with open_checkpoint(folder) as source:
        assert source.extra["constant_tensors"] == []


@pytest.mark.parametrize("num_shards", [5, 100])
def test_open_checkpoint_last_shard_shorter(num_shards, tmp_path):
    folder = make_checkpoint(tmp_path / "c", "fp8", num_shards=num_shards)
    files = load_tensors(folder)
    rows = [files[f][t].shape[0] for f, t in (find(files, f".{SHARD.format(i)}") for i in range(num_shards))]
    assert rows[-1] < rows[0] and set(rows[:-1]) == {rows[0]}
    with open_checkpoint(folder) as source:
        assert source.num_rows == FIXTURE_ROWS
        assert np.array_equal(source.read_rows(0, source.num_rows), stored_table(folder))


def test_open_checkpoint_shards_in_shuffled_file_order(tmp_path):
    # Shard order comes from the names, never from file order or numbering.
    folder = make_checkpoint(tmp_path / "c", "fp8", num_files=3)
    files = load_tensors(folder)
    save_tensors(folder, {f"z-{i}.safetensors": files[name] for i, name in enumerate(reversed(list(files)))})
    with open_checkpoint(folder) as source:
        assert np.array_equal(source.read_rows(0, source.num_rows), stored_table(folder))


def test_open_checkpoint_trusts_header_dtype_over_config(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "bf16")
    config = json.loads((folder / "config.json").read_text())
    config["ple_embedding_dtype"] = "float8_e4m3fn"
    (folder / "config.json").write_text(json.dumps(config))
    with open_checkpoint(folder) as source:
        assert source.encoding is Encoding.BF16 and source.scale is None


def test_open_checkpoint_f32_scale(tmp_path):
    folder = make_checkpoint(tmp_path / "c", "fp8")
    files = load_tensors(folder)
    name, tensor = find(files, ".ngram_embedding.weight_scale")
    files[name][tensor].dtype, files[name][tensor].data = "F32", np.float32(2.5e-4).tobytes()
    save_tensors(folder, files)
    with open_checkpoint(folder) as source:
        assert source.scale.dtype == "F32" and source.scale.value == float(np.float32(2.5e-4))


def test_read_rows_bounded_and_exact(fp8_checkpoint):
    with open_source(fp8_checkpoint) as source:
        expected = stored_table(fp8_checkpoint)
        # Across shard and file boundaries.
        assert np.array_equal(source.read_rows(100, 400), expected[100:400])
        assert source.read_rows(5, 5).shape == (0, 160)
        with pytest.raises(IndexError):
            source.read_rows(0, source.num_rows + 1)
        with pytest.raises(IndexError):
            source.gather_rows(np.array([-1]))


def test_read_header_checks_against_file(tmp_path):
    path = tmp_path / "x.safetensors"
    header = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
              "b": {"dtype": "U8", "shape": [3], "data_offsets": [2, 5]}}
    path.write_bytes(pack_safetensors(header, b"12345"))
    assert {k: (v.dtype, v.shape, v.nbytes) for k, v in read_header(path).items()} == {
        "a": ("U8", (2,), 2), "b": ("U8", (3,), 3)}
    for bad_header, data, message in [
        (header, b"123456", "tensors end at byte"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"123", "expected"),
        ({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 2]}}, b"12", "do not hold"),
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"12", "not a whole number of bytes"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [3, 2]}}, b"12", "do not hold"),
        ({"a": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, b"12", "malformed"),
        ([1, 2], b"", "not a JSON object"),
    ]:
        path.write_bytes(pack_safetensors(json.dumps(bad_header).encode(), data))
        with pytest.raises(BadInput, match=message):
            read_header(path)


def test_read_header_knows_every_dtype_the_format_has(tmp_path):
    # Every dtype the safetensors library writes, with the byte sizes it gives them, plus the two
    # six-bit floats it has no numpy type for (packed by hand: 8 values in 6 bytes).
    library = {"bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
               "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "float32": "F32",
               "float64": "F64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ",
               "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
               "float4_e2m1fn_x2": "F4", "complex64": "C64"}
    buffer = np.zeros(64, np.uint8)
    specs = {}
    for name, code in library.items():
        # float4_e2m1fn_x2 takes the storage shape (8 bytes) and records 16 four-bit values.
        nbytes = 8 if code == "F4" else 8 * DTYPE_BITS[code] // 8
        specs[name] = TensorSpec(dtype=name, shape=[8], data_ptr=buffer.ctypes.data, data_len=nbytes)
    path = tmp_path / "all.safetensors"
    serialize_file(specs, str(path))
    written = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert {entry["dtype"] for key, entry in written.items() if key != "__metadata__"} == set(library.values())
    found = read_header(path)
    for key, entry in written.items():
        if key != "__metadata__":
            begin, end = entry["data_offsets"]
            assert (found[key].dtype, found[key].nbytes) == (entry["dtype"], end - begin)
    six_bit = {"a": {"dtype": "F6_E2M3", "shape": [8], "data_offsets": [0, 6]},
               "b": {"dtype": "F6_E3M2", "shape": [4, 4], "data_offsets": [6, 18]}}
    path.write_bytes(pack_safetensors(six_bit, bytes(18)))
    assert {k: v.nbytes for k, v in read_header(path).items()} == {"a": 6, "b": 12}
    assert set(DTYPE_BITS) == set(library.values()) | {"F6_E2M3", "F6_E3M2"}


def test_unknown_dtype_refused_only_on_a_tensor_the_table_needs(fp8_checkpoint, tmp_path):
    # A tensor of a dtype this reader does not know, outside the table, does not stop a convert.
    model = tmp_path / "ckpt"
    shutil.copytree(fp8_checkpoint, model)
    files = load_tensors(model)
    extra = tmp_path / "extra.safetensors"
    extra.write_bytes(pack_safetensors({"model.vision.patch": {"dtype": "F3_NEW", "shape": [4],
                                                               "data_offsets": [0, 2]}}, b"ab"))
    (model / "extra.safetensors").write_bytes(extra.read_bytes())
    index = json.loads((model / INDEX).read_text())
    index["weight_map"]["model.vision.patch"] = "extra.safetensors"
    (model / INDEX).write_text(json.dumps(index))
    with open_source(model) as source:
        assert source.num_rows == FIXTURE_ROWS
    # The same dtype on a table shard is refused, naming it.
    name, tensor = find(files, ".shard_0.weight")
    raw = (model / name).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    header[tensor]["dtype"] = "F3_NEW"
    (model / name).write_bytes(pack_safetensors(header, raw[8 + header_len:]))
    with pytest.raises(BadInput, match="F3_NEW"):
        open_source(model)
