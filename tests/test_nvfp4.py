"""NVFP4-packed safetensors: 80 code bytes and 10 block scales interleaved per row, docs/MODEL.md's formula."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ple_prep.cli import cli
from ple_prep.converters import open_source
from ple_prep.core.constants import Encoding
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table
from ple_prep.runtime.dequant import decode
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint, write_safetensors

# safetensors dtype: (name for write_safetensors, numpy dtype holding the stored bytes)
SAFETENSORS_DTYPES = {"U8": ("uint8", "u1"), "F8_E4M3": ("float8_e4m3fn", "u1"), "F32": ("float32", "<f4"),
                      "BF16": ("bfloat16", "<u2"), "I64": ("int64", "<i8")}


def read_tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors file as (dtype, shape, raw bytes), parsed here independently."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], entry["shape"],
                   data[8 + length + entry["data_offsets"][0]:8 + length + entry["data_offsets"][1]])
            for name, entry in header.items()}


def shard_arrays(checkpoint, kind: str) -> np.ndarray:
    """All shards' `kind` tensors concatenated in shard order, as uint8 rows."""
    shards = {}
    for path in checkpoint.glob("*.safetensors"):
        for name, (_, shape, raw) in read_tensors(path).items():
            if name.endswith(f".{kind}") and ".shard_" in name:
                index = int(name.split(".shard_")[1].split(".")[0])
                shards[index] = np.frombuffer(raw, dtype=np.uint8).reshape(shape[0], -1)
    return np.concatenate([shards[i] for i in range(len(shards))])


def e2m1_by_formula(nibbles: np.ndarray) -> np.ndarray:
    nibbles = nibbles.astype(np.int64)
    sign = np.where(nibbles & 8, -1.0, 1.0)
    exponent, mantissa = (nibbles >> 1) & 3, nibbles & 1
    return sign * np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def e4m3_by_formula(codes: np.ndarray) -> np.ndarray:
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    return sign * np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))


def nvfp4_by_formula(rows: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """e2m1(code) * e4m3(block_scale) * global_scale: exact in float64, then one float32 rounding."""
    codes = rows[:, :80]
    nibbles = np.empty((len(rows), 160), dtype=np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = codes & 0xF, codes >> 4
    scales = np.repeat(e4m3_by_formula(rows[:, 80:]), 16, axis=1)
    return (e2m1_by_formula(nibbles) * scales * float(global_scale)).astype(np.float32)


@pytest.mark.parametrize("global_bits", [0x3C4985F0, 0x3F800000, 0x00000003, 0x7E000000, 0xBB000001])
def test_nvfp4_decoder_follows_the_spec_formula(global_bits):
    rng = np.random.default_rng(global_bits)
    rows = rng.integers(0, 256, size=(3000, 90), dtype=np.uint8)
    # Every non-NaN block-scale code, subnormal and negative ones included.
    scales = rows[:, 80:].reshape(-1)
    scales[(scales & 0x7F) == 0x7F] = 0x00
    scales[:254] = [c for c in range(256) if c & 0x7F != 0x7F]
    rows[:, 80:] = scales.reshape(-1, 10)
    global_scale = np.array([global_bits], dtype=np.uint32).view(np.float32)[0]
    with np.errstate(over="ignore"):
        expected = nvfp4_by_formula(rows, global_scale)
        got = decode(Encoding.NVFP4_PACKED, rows, 160, float(global_scale))
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_nvfp4_decoder_nan_block_scale_gives_nan():
    rows = np.zeros((1, 90), dtype=np.uint8)
    rows[0, :80] = 0x22
    rows[0, 80:] = [0x7F, 0xFF] + [0x38] * 8
    values = decode(Encoding.NVFP4_PACKED, rows, 160, 1.0)
    assert np.isnan(values[0, :32]).all() and np.array_equal(values[0, 32:], np.ones(128, np.float32))


def test_convert_nvfp4_interleaves_codes_and_block_scales(nvfp4_checkpoint, tmp_path):
    codes, block_scales = shard_arrays(nvfp4_checkpoint, "weight"), shard_arrays(nvfp4_checkpoint,
                                                                                 "weight_scale")
    assert codes.shape == (FIXTURE_ROWS, 80) and block_scales.shape == (FIXTURE_ROWS, 10)
    expected = np.concatenate([codes, block_scales], axis=1)
    with open_source(nvfp4_checkpoint) as source:
        assert source.row_bytes == 90 and source.part_bytes == [80, 10]
        manifest = convert(source, tmp_path / "t.bin")
    global_scale = np.float32(0.0123)
    assert manifest["encoding"] == "nvfp4_packed" and manifest["row_bytes"] == 90
    assert manifest["scale"] == {"dtype": "F32", "hex": global_scale.tobytes().hex(),
                                 "value": float(global_scale)}
    with open_table(tmp_path / "t.bin") as table:
        assert table.rows_per_page == 4096 // 90
        ids = np.random.default_rng(2).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])
        values = table.values(ids)
        assert np.array_equal(values.view(np.uint32),
                              nvfp4_by_formula(expected[ids], global_scale).view(np.uint32))


def test_convert_nvfp4_reads_one_table_level_global_scale(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "nvfp4")

    def one_global_scale(name, dtype, shape, raw):
        if name.endswith("shard_0.weight_scale_2"):
            return name.replace("shard_0.weight_scale_2", "weight_scale_2"), dtype, shape, raw
        return None if name.endswith("weight_scale_2") else (name, dtype, shape, raw)

    rewrite(checkpoint, one_global_scale)
    with open_source(checkpoint) as source:
        assert source.scale.raw == np.float32(0.0123).tobytes()


def rewrite(checkpoint, edit) -> None:
    """Rewrite every file through `edit(name, dtype, shape, raw)`: None drops the tensor, or it
    returns (name, dtype, shape, raw) to store instead."""
    for path in sorted(checkpoint.glob("*.safetensors")):
        tensors = {}
        for name, (dtype, shape, raw) in read_tensors(path).items():
            kept = edit(name, dtype, shape, raw)
            if kept is not None:
                name, dtype, shape, raw = kept
                name_for_writer, stored = SAFETENSORS_DTYPES[dtype]
                tensors[name] = (name_for_writer, np.frombuffer(raw, dtype=stored).reshape(shape))
        path.unlink()
        write_safetensors(path, tensors)


def _drop_block_scale(name, dtype, shape, raw):
    return None if name.endswith("shard_7.weight_scale") else (name, dtype, shape, raw)


def _block_scale_u8(name, dtype, shape, raw):
    return name, ("U8" if name.endswith(".weight_scale") else dtype), shape, raw


def _block_scale_width(name, dtype, shape, raw):
    if name.endswith("shard_3.weight_scale"):
        return name, dtype, [shape[0], 9], raw[:shape[0] * 9]
    return name, dtype, shape, raw


def _block_scale_rows(name, dtype, shape, raw):
    if name.endswith("shard_127.weight_scale"):
        return name, dtype, [shape[0] - 1, 10], raw[:-10]
    return name, dtype, shape, raw


def _no_global_scale(name, dtype, shape, raw):
    return None if name.endswith("weight_scale_2") else (name, dtype, shape, raw)


def _global_scales_differ(name, dtype, shape, raw):
    if name.endswith("shard_9.weight_scale_2"):
        return name, dtype, shape, np.float32(0.5).tobytes()
    return name, dtype, shape, raw


def _global_scale_bf16(name, dtype, shape, raw):
    if name.endswith("weight_scale_2"):
        return name, "BF16", [1], np.array([0x3C49], dtype=np.uint16).tobytes()
    return name, dtype, shape, raw


def _code_width(name, dtype, shape, raw):
    if name.endswith("shard_0.weight"):
        return name, dtype, [shape[0] // 2, 160], raw
    return name, dtype, shape, raw


BAD_NVFP4 = {
    "missing block scales": (_drop_block_scale, ["block scales for 127"]),
    "block scales not e4m3": (_block_scale_u8, ["block scales must be F8_E4M3"]),
    "block-scale width": (_block_scale_width, ["block-scale shard 3", "[rows, 10]"]),
    "block-scale rows": (_block_scale_rows, ["NVFP4 shard 127: 132 code rows but 131 block-scale rows"]),
    "no global scale": (_no_global_scale, ["without a global scale"]),
    "global scales differ": (_global_scales_differ, ["different global scales"]),
    "global scale bf16": (_global_scale_bf16, ["expected F32"]),
    "code width": (_code_width, ["[rows, 80]"]),
}


@pytest.mark.parametrize("case", BAD_NVFP4)
def test_convert_nvfp4_bad_input_exits_2(runner, tmp_path, case):
    edit, fragments = BAD_NVFP4[case]
    checkpoint = make_checkpoint(tmp_path / "ckpt", "nvfp4")
    rewrite(checkpoint, edit)
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(cli, ["convert", "--model", str(checkpoint), "--out", str(out / "t.bin")])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert list(out.iterdir()) == []
