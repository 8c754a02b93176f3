"""The gather path and the resident/disk split, against the source bytes, with poisoned buffers."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.format.layout import TableLayout
from ple_prep.format.order import RowOrder
from ple_prep.offline.writer import WriteOptions, convert
from ple_prep.runtime import gather as gather_module
from ple_prep.runtime import open_table
from ple_prep.runtime.device import driver
from ple_prep.runtime.gather import Gatherer
from ple_prep.tools.benchmark import evict

POISON = 0xA5


@pytest.fixture(scope="module", params=["source-order", "access-order"])
def table_path(request, fp8_checkpoint, tmp_path_factory, converted_table):
    # Access order: a scattered hot set placed first, so slot order differs from row order.
    placed = (lambda rows, _: np.random.default_rng(5).permutation(rows)[:3000]) \
        if request.param == "access-order" else None
    return converted_table(fp8_checkpoint, tmp_path_factory.mktemp("gather") / "t.bin", placed=placed).path


@pytest.fixture(params=["mapped", "direct"])
def read_path(request):
    return request.param


@pytest.fixture(params=["cold", "cached"])
def table(request, table_path, read_path, monkeypatch, loops):
    """The table with the page-cache probe forced, so every copy path runs whatever the cache holds."""
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: request.param == "cached")
    with open_table(table_path, read_path=read_path) as opened:
        yield opened


def real_like_ids(num_rows: int, count: int, seed: int) -> np.ndarray:
    """Ids with repeats and neighbours, like a chunk of text: some rows hot, most cold."""
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, num_rows, 20)
    ids = rng.integers(0, num_rows, count)
    repeated = rng.random(count) < 0.3
    ids[repeated] = rng.choice(hot, int(repeated.sum()))
    return ids


@pytest.mark.parametrize("window_pages", [0, 1, 3, 64])
def test_gather_returns_source_bytes_for_every_window(table, source_rows, window_pages):
    table.window_pages = window_pages
    ids = real_like_ids(table.num_rows, 5000, window_pages)
    assert np.array_equal(table.gather(ids), source_rows[ids])


def test_gather_writes_every_position_of_a_poisoned_out(table, source_rows):
    out = np.full((4000, table.row_bytes), POISON, dtype=np.uint8)
    for seed in range(3):
        ids = real_like_ids(table.num_rows, 4000, seed)
        assert table.gather(ids, out=out) is out
        assert np.array_equal(out, source_rows[ids])


def test_gather_small_and_empty_requests(table, source_rows):
    assert table.gather(np.array([], dtype=np.int64)).shape == (0, table.row_bytes)
    for ids in ([7], [7, 7], [5, 3, 5, 9000, 3]):
        assert np.array_equal(table.gather(np.array(ids)), source_rows[ids])


def test_gather_refuses_bad_out(table):
    with pytest.raises(ValueError, match="out must be uint8"):
        table.gather(np.arange(4), out=np.zeros((4, 3), dtype=np.uint8))


def test_gather_into_a_strided_out(table, source_rows):
    wide = np.full((600, table.row_bytes + 8), POISON, dtype=np.uint8)
    ids = real_like_ids(table.num_rows, 300, 4)
    table.gather(ids, out=wide[::2, 4:4 + table.row_bytes])
    assert np.array_equal(wide[::2, 4:4 + table.row_bytes], source_rows[ids])
    assert np.all(wide[1::2] == POISON) and np.all(wide[::2, :4] == POISON)


def test_gather_byte_cap_of_zero_turns_advice_off(table):
    table.window_bytes = 0
    assert table.advice_window == 0
    table.window_bytes = table.page_size * 5
    assert table.advice_window == 5


class _Recorder:
    """Stands in for the mapping and the rows view, logging advice and copies in order."""

    def __init__(self, units, units_per_page, page_size, data_offset):
        self.units, self.units_per_page = units, units_per_page
        self.page_size, self.data_offset = page_size, data_offset
        self.events: list[tuple[str, list[int]]] = []

    def madvise(self, option, start, length):
        first = (start - self.data_offset) // self.page_size
        self.events.append(("advise", list(range(first, first + -(-length // self.page_size)))))

    def __getitem__(self, units):
        self.events.append(("copy", sorted(set((np.asarray(units) // self.units_per_page).tolist()))))
        return self.units[units]


@pytest.mark.parametrize("window_pages", [1, 4, 16])
def test_gather_advice_stays_within_the_window_ahead_of_the_copy(table_path, source_rows,
                                                                 window_pages, monkeypatch):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: False)
    # The numpy copy, which the recorder below stands in for (the compiled one copies the same rows).
    monkeypatch.setattr("ple_prep.runtime.gather._core_native", None)
    with open_table(table_path, window_pages=window_pages, read_path="mapped") as table:
        gatherer = table._gatherer
        recorder = _Recorder(gatherer._units, gatherer._units_per_page, table.page_size,
                             table.header.data_offset)
        gatherer._mapping = gatherer._units = recorder
        ids = real_like_ids(table.num_rows, 3000, 1)
        assert np.array_equal(table.gather(ids), source_rows[ids])
    advised: list[int] = []
    copied: list[int] = []
    for kind, pages in recorder.events:
        if kind == "advise":
            advised += pages
            # Pages in flight: advised but not yet copied.
            assert len(set(advised) - set(copied)) <= window_pages
        else:
            assert set(pages) <= set(advised)
            copied += pages
    assert advised == sorted(advised) and len(advised) == len(set(advised)) == len(set(copied))


def test_lookup_merges_tiers_into_poisoned_reused_buffers(table, source_rows):
    resident = table.resident(budget_bytes=1000 * table.row_bytes + 17)
    assert resident.num_slots == 1000 and resident.rows.shape == (1000, table.row_bytes)
    out = np.full((3000, table.row_bytes), POISON, dtype=np.uint8)
    for seed in range(4):
        ids = real_like_ids(table.num_rows, 3000, seed + 10)
        found = table.lookup(ids, out=out)
        slots = table.slot_of(ids)
        assert np.array_equal(found.resident_positions, np.flatnonzero(slots < 1000))
        assert np.array_equal(found.disk_positions, np.flatnonzero(slots >= 1000))
        assert np.array_equal(found.resident_slots, slots[slots < 1000])
        assert np.array_equal(found.disk_rows, source_rows[ids[found.disk_positions]])
        assert 0 < len(found.resident_positions) < len(ids)
        assert np.array_equal(out, source_rows[ids])
        assert np.array_equal(out, table.gather(ids))


def test_lookup_without_a_resident_tier_reads_everything_from_disk(table, source_rows):
    ids = real_like_ids(table.num_rows, 500, 3)
    found = table.lookup(ids)
    assert len(found.resident_positions) == 0
    assert np.array_equal(found.disk_rows, source_rows[ids])


def test_resident_holds_the_leading_slots(table, source_rows):
    resident = table.resident(budget_bytes=table.num_rows * table.row_bytes * 10)
    assert resident.num_slots == table.num_rows
    slots = np.arange(table.num_rows)
    rows_of_slots = table.order.rows_at(0, table.num_rows)
    assert np.array_equal(resident.rows[slots], source_rows[rows_of_slots])
    assert table.resident(budget_bytes=0).num_slots == 0


def test_the_tables_resident_tier_is_in_ram_and_a_gpu_tier_is_the_embedding_sources(table):
    """One tier on a GPU, EmbeddingSource's: Table.resident refuses a device and says where to go,
    and a lookup merges into numpy arrays only."""
    with pytest.raises(ValueError, match="EmbeddingSource"):
        table.resident(budget_bytes=1000 * table.row_bytes, device="cuda")
    table.resident(budget_bytes=1000 * table.row_bytes)
    with pytest.raises(TypeError, match="out must be a numpy array"):
        table.lookup(np.arange(10), out=bytearray(10 * table.row_bytes))


@pytest.mark.parametrize("page_size", [1024, 16384])
@pytest.mark.parametrize("cached", [False, True])
def test_gather_other_page_sizes(fp8_checkpoint, source_rows, tmp_path, monkeypatch, page_size,
                                 cached, read_path):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: cached)
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "t.bin", WriteOptions(page_size=page_size))
    with open_table(tmp_path / "t.bin", window_pages=2, read_path=read_path) as table:
        ids = real_like_ids(table.num_rows, 2000, 6)
        assert np.array_equal(table.gather(ids), source_rows[ids])


@pytest.mark.parametrize("threads", [2, 3])
def test_gather_cached_rows_on_threads(table_path, source_rows, monkeypatch, threads, loops):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: True)
    monkeypatch.setattr("ple_prep.runtime.gather.THREAD_MIN_ROWS", 100)
    # Through the mapping: without the compiled copy, the default path reads every row with its
    # disk reader instead (docs/RELIABILITY.md).
    with open_table(table_path, read_path="mapped") as table:
        table.threads = threads
        out = np.full((1000, table.row_bytes), POISON, dtype=np.uint8)
        for seed in range(2):
            ids = real_like_ids(table.num_rows, 1000, seed)
            assert np.array_equal(table.gather(ids, out=out), source_rows[ids])
            assert np.array_equal(table.gather(ids), source_rows[ids])


def test_gather_probe_sees_an_evicted_file_cold_and_a_gathered_request_cached(table_path, loops):
    """The real mincore probe (not forced): after posix_fadvise(DONTNEED) the request is cold, so
    gather takes the advised path; once gathered through the mapping, the same request reads as cached."""
    evict(table_path)
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 2000, 11)
        assert not table.in_page_cache(ids)
        table.gather(ids)
        assert table.in_page_cache(ids)


@pytest.mark.needs_helper
def test_compiled_copy_refuses_slots_outside_the_table(table_path, monkeypatch):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: True)
    with open_table(table_path) as table:
        for slot in (table.num_rows, -1, 2**62):
            with pytest.raises(IndexError, match=f"slot {slot} is outside"):
                table.gather_slots(np.array([0, slot]))


def test_install_without_a_compiler_falls_back_to_numpy(tmp_path, fp8_checkpoint, source_rows):
    """`pip install .` on a machine without a C compiler (the build in its own environment, as pip
    runs it): the wheel builds without the helper, and the installed package gathers the same bytes
    from an access-ordered table with numpy."""
    with open_source(fp8_checkpoint) as source:
        placed = np.random.default_rng(6).permutation(source.num_rows)[:4000]
        convert(source, tmp_path / "t.bin", layout=TableLayout(RowOrder.from_placed(placed, source.num_rows)))
    repository = Path(__file__).resolve().parents[1]
    source = tmp_path / "src"
    shutil.copytree(repository / "ple_prep", source / "ple_prep",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(repository / name, source / name)
    no_compiler = os.environ | {"CC": "false", "LDSHARED": "false"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"),
                            str(source)], env=no_compiler, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [name for name in archive.namelist() if name.endswith(".so")]
        archive.extractall(tmp_path / "site")
    code = ("import sys, numpy as np; from ple_prep.runtime import open_table, gather; "
            "from ple_prep.format import order; "
            "assert gather._native is None and gather._core_native is None and order._native is None; "
            "t = open_table(sys.argv[1], read_path='mapped'); ids = np.arange(t.num_rows)[::-7]; "
            "t.gather(ids); sys.stdout.buffer.write(t.gather(ids).tobytes())")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.bin")], capture_output=True, check=True,
                          env=os.environ | {"PYTHONPATH": str(tmp_path / "site")}, cwd=tmp_path)
    ids = np.arange(len(source_rows))[::-7]
    assert done.stdout == source_rows[ids].tobytes()


@pytest.mark.parametrize("page_size", [1024, 16384])
def test_gather_probe_on_other_page_sizes(fp8_checkpoint, source_rows, tmp_path, page_size, loops):
    """The probe reads one result byte per memory page it asks about, whatever the table's page size."""
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "t.bin", WriteOptions(page_size=page_size))
    evict(tmp_path / "t.bin")
    with open_table(tmp_path / "t.bin", read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 2000, 12)
        assert not table.in_page_cache(ids)
        assert np.array_equal(table.gather(ids), source_rows[ids])
        assert table.in_page_cache(ids)
        assert np.array_equal(table.gather(ids), source_rows[ids])


@pytest.mark.needs_helper
def test_stage_in_a_forked_child_after_the_parent_used_the_thread_pool(table_path):
    """The compiled helper's thread pool lives in one process: a child forked after the parent used
    it (as vLLM's workers may be) starts its own and stages the same rows."""
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 4000, 41)
        table.gather(ids)  # every row cached: stage copies them all

        def staged() -> tuple[np.ndarray, np.ndarray]:
            slots, index = np.empty(len(ids), np.int64), np.full(len(ids), -1, np.int32)
            out = np.zeros((len(ids), table.row_bytes), np.uint8)
            disk, done = table._stage(ids, 100, slots, index, out, threads=4)
            assert done and disk == np.count_nonzero(slots >= 100)
            return index, out

        index, out = staged()
        slots = table.slot_of(ids)
        assert np.array_equal(index[slots < 100], slots[slots < 100])
        child = os.fork()
        if child == 0:  # the child: exit status 0 only if its stage gives the parent's bytes
            try:
                again = staged()
                os._exit(0 if np.array_equal(again[0], index) and np.array_equal(again[1], out) else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 60
        while (waited := os.waitpid(child, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(child, 9)
                pytest.fail("the forked child hung in stage")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(waited[1]) == 0
        rows = np.flatnonzero(index >= 100)
        assert np.array_equal(out[index[rows] - 100], table.gather(ids[rows]))


@pytest.mark.parametrize("offset", [0, 1, 8])
def test_stage_writes_the_same_rows_and_index_into_buffers_at_any_alignment(table_path, loops, offset):
    """The compiled stage writes whole 16-byte pieces past the CPU caches where a row starts on
    a 16-byte boundary, and copies plainly elsewhere: the bytes are the same either way."""
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 3000, 44)
        table.gather(ids)  # every row cached: stage copies them all
        count, row_bytes = len(ids), table.row_bytes
        out = np.frombuffer(bytearray(count * row_bytes + offset), np.uint8, count * row_bytes,
                            offset).reshape(count, row_bytes)
        index = np.frombuffer(bytearray(4 * count + offset), np.int32, count, offset - offset % 4)
        slots = np.empty(count, np.int64)
        assert table._stage(ids, 100, slots, index, out, threads=2) == (np.count_nonzero(slots >= 100), True)
        want = table.slot_of(ids)
        assert np.array_equal(index[want < 100], want[want < 100])
        disk = np.flatnonzero(want >= 100)
        assert np.array_equal(index[disk], 100 + count - len(disk) + np.arange(len(disk)))
        assert np.array_equal(out[count - len(disk):], table.gather(ids[disk]))


def test_stage_refuses_buffers_of_the_wrong_type_or_size(table_path, loops):
    with open_table(table_path) as table:
        ids = np.arange(10)
        slots, index = np.empty(10, np.int64), np.empty(10, np.int32)
        out = np.empty((10, table.row_bytes), np.uint8)
        for wrong in ({"slots": np.empty(10, np.int32)}, {"slots": np.empty(9, np.int64)},
                      {"index": np.empty(10, np.int64)}, {"index": np.empty(20, np.int32)[::2]},
                      {"out": np.empty((10, table.row_bytes + 1), np.uint8)}, {"out": out.T.copy().T}):
            given = {"slots": slots, "index": index, "out": out} | wrong
            with pytest.raises(ValueError, match=f"{next(iter(wrong))} must be"):
                table._stage(ids, 0, given["slots"], given["index"], given["out"])


@pytest.mark.parametrize("threads", [1, 4])
def test_stage_refuses_an_id_outside_the_table_in_any_part(table_path, loops, threads):
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 4000, 43)
        ids[3500] = table.num_rows  # in the last of four parts
        slots, index = np.empty(len(ids), np.int64), np.empty(len(ids), np.int32)
        out = np.empty((len(ids), table.row_bytes), np.uint8)
        with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
            table._stage(ids, 100, slots, index, out, threads=threads)


def wait_for_a_look_after(job, timeout: float = 10.0) -> None:
    """Return once the job's thread has read its flags (and found them not set) after this call
    began: two more reads than now, so one began after any write made before this call."""
    target = job.flag_checks() + 2
    deadline = time.monotonic() + timeout
    while job.flag_checks() < target:
        assert time.monotonic() < deadline, "the job's thread stopped reading its flags"


@pytest.mark.needs_helper
def test_stage_when_waits_for_both_flags_then_stages_as_stage_does(table_path):
    """The helper thread touches no buffer before the device has written both flag values (its
    ids copied, its last read of `out` done), then stages exactly what `stage` does."""
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 4000, 47)
        table.gather(ids)

        def buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return (np.full(len(ids), -1, np.int64), np.full(len(ids), -1, np.int32),
                    np.full((len(ids), table.row_bytes), POISON, np.uint8))

        want = buffers()
        want_result = table._stage(ids, 100, *want, threads=2)
        flags = np.zeros(2, np.int32)
        got = buffers()
        job = table._stage_when(flags, 7, 3, ids, 100, *got, threads=2)
        for value in (7, 0):  # the ids' flag alone, then neither: the thread sees it, stages nothing
            flags[0] = value
            wait_for_a_look_after(job)
            assert (got[0] == -1).all() and (got[2] == POISON).all()
        flags[:] = 7, 3
        assert job.join() == (*want_result, False)  # staged, and no device copy asked for
        for array, expected in zip(got, want):
            assert np.array_equal(array, expected)


@pytest.mark.needs_helper
def test_stage_when_with_a_negative_free_value_waits_for_the_ids_flag_alone(table_path):
    """The caller that knows the device's last read of `out` is done passes free_value < 0: the
    job then starts on the ids' flag, whatever flags[1] holds."""
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 3000, 50)

        def buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return (np.full(len(ids), -1, np.int64), np.full(len(ids), -1, np.int32),
                    np.full((len(ids), table.row_bytes), POISON, np.uint8))

        want = buffers()
        want_result = table._stage(ids, 100, *want, threads=2)
        slots, index, out = buffers()
        flags = np.array([0, 9], np.int32)
        job = table._stage_when(flags, 5, -1, ids, 100, slots, index, out, threads=2)
        wait_for_a_look_after(job)  # at flags[1] == 9 too: only the ids' flag is waited for
        assert (slots == -1).all() and (out == POISON).all()
        flags[0] = 5
        assert job.join() == (*want_result, False)  # staged, and no device copy asked for
        for array, expected in zip((slots, index, out), want):
            assert np.array_equal(array, expected)


@pytest.mark.needs_helper
def test_a_stage_when_job_cancelled_before_its_flags_stages_nothing(table_path):
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 2000, 48)
        slots, index = np.full(len(ids), -1, np.int64), np.full(len(ids), -1, np.int32)
        out = np.full((len(ids), table.row_bytes), POISON, np.uint8)
        flags = np.zeros(2, np.int32)
        # cancel() returns once the job's thread has ended: nothing runs after it.
        table._stage_when(flags, 1, 1, ids, 0, slots, index, out, threads=2).cancel()
        flags[:] = 1
        assert (slots == -1).all() and (out == POISON).all()
        # A job dropped without join or cancel stops too (its thread must not outlive its buffers):
        # the drop ends its thread before the statement returns.
        flags[:] = 0
        table._stage_when(flags, 1, 1, ids, 0, slots, index, out, threads=2)
        flags[:] = 1
        assert (slots == -1).all() and (out == POISON).all()


@pytest.mark.needs_helper
def test_stage_when_raises_a_bad_id_at_join(table_path):
    with open_table(table_path, read_path="mapped") as table:
        ids = real_like_ids(table.num_rows, 4000, 49)
        ids[100] = -1
        slots, index = np.empty(len(ids), np.int64), np.empty(len(ids), np.int32)
        out = np.empty((len(ids), table.row_bytes), np.uint8)
        flags = np.ones(2, np.int32)
        job = table._stage_when(flags, 1, 1, ids, 100, slots, index, out, threads=4)
        with pytest.raises(IndexError, match="row id -1 is outside"):
            job.join()


@pytest.mark.needs_helper
def test_a_device_copy_or_a_graph_launch_is_refused_where_no_cuda_driver_loads(table_path):
    try:
        driver.device_context(0)
        pytest.skip("a CUDA driver loads here (tests/test_torch_source.py covers the copy and the launch)")
    except OSError as error:
        assert "libcuda" in str(error)
    with open_table(table_path, read_path="mapped") as table:
        ids = np.arange(10)
        slots, index, out = np.empty(10, np.int64), np.empty(10, np.int32), np.empty((10, table.row_bytes), np.uint8)
        with pytest.raises(OSError, match="CUDA driver"):
            table._stage_when(np.zeros(2, np.int32), 1, 1, ids, 0, slots, index, out, device_copy=(1, 2, 3, 4, 5))
        with pytest.raises(OSError, match="CUDA driver"):
            table._stage_and_launch(ids, 0, slots, index, out, context=1, events=(2, 3), graph=4, stream=5)


@pytest.mark.needs_helper
def test_stage_when_refuses_a_device_copy_whose_index_does_not_follow_out(table_path):
    """The job copies from the staged rows to the end of the index: an index before `out` would
    make that a copy of the wrong bytes, so it is refused before anything is queued."""
    try:
        driver.device_context(0)
    except OSError:
        pytest.skip("no CUDA driver loads here")
    except RuntimeError:
        pass  # a driver without a device: the refusal comes before any CUDA call
    with open_table(table_path, read_path="mapped") as table:
        span = np.zeros(4 * 10 + 10 * table.row_bytes, np.uint8)
        index, out = span[:40].view(np.int32), span[40:].reshape(10, table.row_bytes)
        with pytest.raises(ValueError, match="index after out"):
            table._stage_when(np.zeros(2, np.int32), 1, 1, np.arange(10), 0, np.empty(10, np.int64), index, out,
                             device_copy=(1, 2, 3, 4, 5))


def test_stage_and_launch_needs_the_compiled_helper(table_path, monkeypatch):
    monkeypatch.setattr(gather_module, "_native", None)
    with open_table(table_path, read_path="mapped") as table:
        with pytest.raises(RuntimeError, match="stage_and_launch needs the compiled helper"):
            table._stage_and_launch(np.arange(10), 0, np.empty(10, np.int64), np.empty(10, np.int32),
                                   np.empty((10, table.row_bytes), np.uint8), context=1, events=(), graph=0,
                                   stream=0)


def test_stage_when_needs_the_compiled_helper(table_path, monkeypatch):
    monkeypatch.setattr(gather_module, "_native", None)
    with open_table(table_path, read_path="mapped") as table:
        assert not table.compiled
        ids = np.arange(10)
        with pytest.raises(RuntimeError, match="stage_when needs the compiled helper"):
            table._stage_when(np.zeros(2, np.int32), 1, 1, ids, 0, np.empty(10, np.int64), np.empty(10, np.int32),
                             np.empty((10, table.row_bytes), np.uint8))


@pytest.mark.needs_helper
@pytest.mark.parametrize("page_size, row_bytes", [(4096, 160), (4096, 2048), (4096, 4096), (512, 7), (8192, 80)])
def test_the_compiled_copy_finds_every_slots_page_for_any_rows_per_page(page_size, row_bytes):
    """Every slot of pages holding 1, 2, 25, 73 or 102 rows (after a data offset) is copied from
    its page and position."""
    native = gather_module._core_native
    rows_per_page, pages, offset = page_size // row_bytes, 40, 64
    mapping = np.random.default_rng(row_bytes).integers(0, 256, offset + pages * page_size, dtype=np.uint8)
    num_slots = rows_per_page * pages
    slots = np.random.default_rng(1).permutation(num_slots).astype(np.int64)
    out = np.full((num_slots, row_bytes), POISON, np.uint8)
    native.copy_rows(mapping, slots, out, offset, page_size, rows_per_page, row_bytes, num_slots)
    pages_of, positions = np.divmod(slots, rows_per_page)
    starts = offset + pages_of * page_size + positions * row_bytes
    assert np.array_equal(out, mapping[starts[:, None] + np.arange(row_bytes)])
