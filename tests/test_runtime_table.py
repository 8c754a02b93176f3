"""The runtime reader: exact bytes and values back, and refusal of any file that does not belong."""
from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.core.constants import ORDER_DTYPE
from ple_prep.core.errors import BadInput
from ple_prep.format import order as order_module
from ple_prep.format.layout import TableLayout
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table
from ple_prep.tools.benchmark import cached_fraction, evict
from ple_prep.tools.fixtures import FIXTURE_ROWS


@pytest.fixture(scope="module")
def tables(fp8_checkpoint, bf16_checkpoint, nvfp4_checkpoint, tmp_path_factory, converted_table):
    """{variant: (table path, source rows, source scale bytes)} converted once for this module."""
    folder = tmp_path_factory.mktemp("runtime")
    made = {}
    for variant, checkpoint in (("fp8", fp8_checkpoint), ("bf16", bf16_checkpoint),
                                ("nvfp4", nvfp4_checkpoint)):
        table = converted_table(checkpoint, folder / f"{variant}.bin", with_rows=True)
        made[variant] = (table.path, table.rows, table.scale_raw)
    return made


# --- Independent reference decoders (plain Python, per docs/MODEL.md) -----------------------

def e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)
    return sign * math.ldexp(8 + mantissa, exponent - 10)


def bf16_round(value: float) -> float:
    """Round to the nearest bf16 (8 significant bits), ties to even."""
    if value == 0 or math.isnan(value):
        return value
    fraction, exponent = math.frexp(value)
    return math.copysign(math.ldexp(round(abs(fraction) * 256), exponent - 8), value)


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def reference_values(variant: str, rows: np.ndarray, scale_raw: bytes | None) -> np.ndarray:
    if variant == "fp8":
        scale = bf16_value(int.from_bytes(scale_raw, "little"))
        # bf16(e4m3) * bf16(scale), rounded once to bf16; 256 codes give 256 values.
        by_code = np.array([bf16_round(bf16_round(e4m3(c)) * scale) for c in range(256)], np.float32)
        return by_code[rows]
    if variant == "bf16":
        by_bits = np.array([bf16_value(b) for b in range(1 << 16)], dtype=np.float32)
        return by_bits[rows.view("<u2").astype(np.int64)]
    (global_scale,) = struct.unpack("<f", scale_raw)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    e2m1 = [math.copysign(magnitudes[c & 7], -1.0 if c & 8 else 1.0) for c in range(16)]
    # e2m1(code) * e4m3(block scale) is exact; times the F32 global scale, rounded once to f32.
    by_pair = np.array([[e2m1[c] * e4m3(s) * global_scale for s in range(256)] for c in range(16)],
                       dtype=np.float32)
    codes = rows[:, :80]
    nibbles = np.empty((len(rows), 160), dtype=np.int64)
    nibbles[:, 0::2], nibbles[:, 1::2] = codes & 0xF, codes >> 4
    block_scales = np.repeat(rows[:, 80:].astype(np.int64), 16, axis=1)
    return by_pair[nibbles, block_scales]


@pytest.mark.parametrize("variant", ["fp8", "bf16", "nvfp4"])
def test_open_table_gather_returns_source_bytes(variant, tables):
    path, rows, _ = tables[variant]
    with open_table(path) as table:
        ids = np.random.default_rng(3).integers(0, table.num_rows, 5000)
        ids[:3] = [0, table.num_rows - 1, 0]  # first, last, repeated
        got = table.gather(ids)
        assert got.dtype == np.uint8 and got.shape == (len(ids), table.row_bytes)
        assert np.array_equal(got, rows[ids])
        assert np.array_equal(table.gather(np.arange(table.num_rows)), rows)
        assert table.gather(np.zeros(0, dtype=np.int64)).shape == (0, table.row_bytes)


@pytest.mark.parametrize("variant", ["fp8", "bf16", "nvfp4"])
def test_open_table_values_match_model_formula(variant, tables):
    path, rows, scale_raw = tables[variant]
    with open_table(path) as table:
        ids = np.arange(table.num_rows)
        values = table.values(ids)
    assert values.dtype == np.float32 and values.shape == (len(ids), 160)
    expected = reference_values(variant, rows, scale_raw)
    assert np.array_equal(values.view(np.uint32), expected.view(np.uint32))


def test_open_table_fp8_values_match_torch(tables):
    torch = pytest.importorskip("torch")
    path, rows, scale_raw = tables["fp8"]
    scale = torch.frombuffer(bytearray(scale_raw), dtype=torch.bfloat16)
    expected = (torch.from_numpy(rows.copy()).view(torch.float8_e4m3fn).to(torch.bfloat16) * scale)
    with open_table(path) as table:
        values = table.values(np.arange(table.num_rows))
    assert np.array_equal(values, expected.to(torch.float32).numpy())


def test_open_table_fields(tables):
    path, rows, scale_raw = tables["fp8"]
    with open_table(path) as table:
        assert (table.num_rows, table.row_bytes, table.values_per_row) == (FIXTURE_ROWS, 160, 160)
        assert table.encoding == "fp8_e4m3" and table.row_range == (0, FIXTURE_ROWS)
        assert table.scale == bf16_value(int.from_bytes(scale_raw, "little"))
    with open_table(tables["bf16"][0]) as table:
        assert table.encoding == "bf16" and table.scale is None and table.row_bytes == 320


@pytest.mark.parametrize("ids", [[FIXTURE_ROWS], [-1], [0, 5, 20000], [2**40], [-2**63], [2**63 - 1]])
def test_open_table_gather_out_of_range_raises(ids, tables):
    with open_table(tables["fp8"][0]) as table:
        with pytest.raises(IndexError, match="outside"):
            table.gather(np.array(ids, dtype=np.int64))
        with pytest.raises(IndexError):
            table.values(np.array(ids, dtype=np.int64))


def test_open_table_gather_refuses_float_ids(tables):
    with open_table(tables["fp8"][0]) as table, pytest.raises(TypeError):
        table.gather(np.array([1.0]))


def copy_pair(path, folder):
    target = folder / path.name
    shutil.copyfile(path, target)
    shutil.copyfile(manifest_path(path), manifest_path(target))
    return target


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw[:-1], "truncated or extended"),
    (lambda raw: raw[:-4096], "truncated or extended"),
    (lambda raw: raw + b"\0" * 4096, "truncated or extended"),
    (lambda raw: raw[:100], "too short"),
    (lambda raw: b"XLEPREP\0" + raw[8:], "not a ple-prep table"),
    (lambda raw: raw[:8] + struct.pack("<I", 9) + raw[12:], "format version 9"),
    (lambda raw: raw[:24] + struct.pack("<I", 2) + raw[28:], "160-byte rows cannot hold 160 bf16 values"),
])
def test_open_table_refuses_damaged_file(change, message, tables, tmp_path):
    target = copy_pair(tables["fp8"][0], tmp_path)
    target.write_bytes(change(target.read_bytes()))
    with pytest.raises(BadInput, match=message):
        open_table(target)


def test_open_table_refuses_mismatched_manifest(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "a.bin")
        convert(source, tmp_path / "b.bin")
    shutil.copyfile(manifest_path(tmp_path / "b.bin"), manifest_path(tmp_path / "a.bin"))
    with pytest.raises(BadInput, match="different conversions"):
        open_table(tmp_path / "a.bin")


def test_open_table_refuses_missing_or_broken_manifest(tables, tmp_path):
    target = copy_pair(tables["fp8"][0], tmp_path)
    manifest = json.loads(manifest_path(target).read_text())
    manifest["file_size"] += 4096
    manifest_path(target).write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="checksum blocks|disagrees"):
        open_table(target)
    manifest_path(target).write_text("{not json")
    with pytest.raises(BadInput, match="not JSON"):
        open_table(target)
    manifest_path(target).unlink()
    with pytest.raises(BadInput, match="manifest .* not found"):
        open_table(target)


def test_open_table_gather_hands_out_copies(tables, tmp_path):
    target = copy_pair(tables["fp8"][0], tmp_path)
    with open_table(target) as table:
        rows = table.gather(np.array([0, 1]))
        rows[:] = 0
        assert np.array_equal(table.gather(np.array([0, 1])), tables["fp8"][1][:2])


def test_import_runtime_pulls_numpy_only():
    code = ("import sys, ple_prep.runtime; "
            "print(sorted(m for m in ('click', 'tqdm', 'gguf', 'torch', 'safetensors', 'zstandard', "
            "'tokenizers', 'huggingface_hub', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['numpy']"


# --- Host lookups on an access-ordered table: cost independent of the order map's size ---------------

def _every_other_row_placed(num_placed: int) -> RowOrder:
    """A map placing rows 0, 2, 4, ... in ascending slots (built directly: a 21M-row map in 0.1 s)."""
    return RowOrder(2 * num_placed, np.arange(0, 2 * num_placed, 2, dtype=ORDER_DTYPE))


def _expected_slots(num_placed: int, rows: np.ndarray) -> np.ndarray:
    return np.where(rows % 2 == 0, rows // 2, num_placed + rows // 2)


def _allocated_peak(call) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _fastest_ns(call, repeats: int) -> int:
    best = None
    for _ in range(repeats):
        started = time.perf_counter_ns()
        call()
        elapsed = time.perf_counter_ns() - started
        best = elapsed if best is None else min(best, elapsed)
    return best


@pytest.fixture(scope="module")
def real_size_order():
    """An order map of the real table's default size (21M placed rows, 252 MB)."""
    return _every_other_row_placed(21_000_000)


@pytest.mark.parametrize("loops", [pytest.param("compiled", marks=pytest.mark.needs_helper), "numpy"])
@pytest.mark.parametrize("count", [16, 1000])
def test_row_order_lookup_cost_does_not_grow_with_the_map(real_size_order, count, loops, monkeypatch):
    if loops == "numpy":
        monkeypatch.setattr(order_module, "_native", None)
    small = _every_other_row_placed(1000)
    rng = np.random.default_rng(count)
    for order in (small, real_size_order):
        rows = rng.integers(0, order.num_rows, count)
        assert np.array_equal(order.slot_of(rows), _expected_slots(order.num_placed, rows))
    big_rows = rng.integers(0, real_size_order.num_rows, count)
    small_rows = rng.integers(0, small.num_rows, count)
    # No copy or conversion of the map: a lookup allocates about what its answer takes, not the
    # map's 84 MB per array (converting `sorted_rows` to int64 would take 168 MB).
    assert _allocated_peak(lambda: real_size_order.slot_of(big_rows)) < 256 * count + (64 << 10)
    # And no pass over it: a map 21,000 times larger costs a few cache misses more per id, not
    # 21,000 times the work (the fastest of many calls, so load from other work cancels out).
    big = _fastest_ns(lambda: real_size_order.slot_of(big_rows), 300)
    little = _fastest_ns(lambda: small.slot_of(small_rows), 300)
    assert big < 20 * little, (big, little)


def _searched_slots(order: RowOrder, rows: np.ndarray) -> np.ndarray:
    """Slots by a plain binary search of the map (the definition the rank index must match)."""
    sorted_rows = order.sorted_rows.astype(np.int64)
    position = np.searchsorted(sorted_rows, rows)
    clipped = np.minimum(position, max(order.num_placed - 1, 0))
    placed = (sorted_rows[clipped] == rows) if order.num_placed else np.zeros(len(rows), bool)
    return np.where(placed, order.sorted_slots[clipped].astype(np.int64) if order.num_placed else 0,
                    order.num_placed + rows - position)


@pytest.mark.parametrize("loops", [pytest.param("compiled", marks=pytest.mark.needs_helper), "numpy", "numpy < 2.0"])
def test_row_order_rank_index_matches_a_binary_search(monkeypatch, loops):
    if loops != "compiled":
        monkeypatch.setattr(order_module, "_native", None)
    if loops == "numpy < 2.0":  # no bitwise_count: the fallback counts bits the same
        monkeypatch.delattr(np, "bitwise_count", raising=False)
    rng = np.random.default_rng(3)
    for num_rows, num_placed in ((130, 64), (5000, 0), (5000, 1), (5000, 4999), (100_000, 37_000)):
        order = RowOrder.from_placed(rng.permutation(num_rows)[:num_placed], num_rows)
        rows = np.concatenate([rng.integers(0, num_rows, 3000), [0, num_rows - 1], np.arange(64)])
        assert np.array_equal(order.slot_of(rows), _searched_slots(order, rows))
        assert np.array_equal(np.sort(order.slot_of(np.arange(num_rows))), np.arange(num_rows))
        assert np.array_equal(order.rows_at(0, num_rows)[order.slot_of(rows)], rows)
        # A rank file's ids start at its first row: the same slots, and its edges refused.
        assert np.array_equal(order.slot_of(rows + 1000, 1000), order.slot_of(rows))
        for outside in (999, 1000 + num_rows):
            with pytest.raises(IndexError, match=f"row id {outside} is outside this table's rows"):
                order.slot_of(np.array([outside]), 1000)


def test_table_lookups_do_not_convert_the_order_map(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        num_rows = source.num_rows
        placed = np.random.default_rng(8).permutation(num_rows)[:15_000]
        convert(source, tmp_path / "t.bin", layout=TableLayout(RowOrder.from_placed(placed, num_rows)))
        rows = source.read_rows(0, num_rows)
    with open_table(tmp_path / "t.bin") as table:
        table.resident(budget_bytes=100 * table.row_bytes)
        ids = np.random.default_rng(9).integers(0, num_rows, 16)
        out = np.empty((16, table.row_bytes), dtype=np.uint8)
        table.gather(ids)
        # The map's int64 conversion would take 120 kB here; a 16-row answer takes 2.5 kB.
        for call in (lambda: table.gather(ids), lambda: table.lookup(ids, out=out),
                     lambda: table.slot_of(ids)):
            assert _allocated_peak(call) < 32 << 10
        assert np.array_equal(table.gather(ids), rows[ids]) and np.array_equal(out, rows[ids])


def test_row_order_threads_looking_up_at_once_build_the_rank_index_once(monkeypatch):
    order = RowOrder.from_placed(np.random.default_rng(4).permutation(200_000)[:90_000], 200_000)
    builds = []
    build = order.build_rank_index
    monkeypatch.setattr(order, "build_rank_index", lambda: builds.append(1) or build())
    rows = np.random.default_rng(5).integers(0, 200_000, 5000)
    start = threading.Barrier(8)

    def look_up(_):
        start.wait()
        return order.slot_of(rows)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(look_up, range(8)))
    assert len(builds) == 1
    expected = _searched_slots(order, rows)
    assert all(np.array_equal(result, expected) for result in results)


def test_a_closed_table_no_longer_pins_its_files_pages(fp8_checkpoint, converted_table, tmp_path):
    """After close, even while the Table object lives, the pages it read through its mapping can be
    evicted (a closed table that kept its mapping, held by its row order's views, would pin them)."""
    path = converted_table(fp8_checkpoint, tmp_path / "ordered.bin",
                           placed=lambda rows, spec: np.arange(rows - 1, rows // 2, -1)).path
    control = tmp_path / "control.bin"
    shutil.copy(path, control)
    control.read_bytes()
    evict(control)
    if cached_fraction(control) in (None, 1.0):
        pytest.skip("this file system keeps no evictable page cache (or mincore is unavailable)")
    table = open_table(path, read_path="mapped")
    table.values(np.arange(table.first_row, table.first_row + table.num_rows))  # every page read
    table.close()
    evict(path)
    assert cached_fraction(path) < 0.05
    assert table.path == path  # the object itself is still alive
