"""Callers a serving process must survive: buffers freed or written while the helper uses them,
ids at the ends of int64, requests too large to allocate, and what gather refuses everywhere. Each
ends in a Python exception or the right rows, never a segfault (cases that could crash run in a
forked child: tests/support/isolation.py)."""
from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest
from support.isolation import in_child

from ple_prep.runtime import gather as gather_module
from ple_prep.runtime import open_table


def needs_helper() -> None:
    if gather_module._native is None:
        pytest.skip("the compiled helper is not built here (no compiler at install)")


def stage_buffers(table, count: int):
    return (np.empty(count, np.int64), np.empty(count, np.int32), np.empty((count, table.row_bytes), np.uint8))


def test_a_stage_when_job_holds_its_flags_until_it_is_done(fp8_table):
    """The caller may drop its flags array before the join: the job keeps it alive (no poll of freed memory)."""
    needs_helper()
    with open_table(fp8_table, read_path="mapped") as table:
        ids = np.arange(2000)
        flags = np.zeros(2, np.int32)
        alive = weakref.ref(flags)
        job = table._stage_when(flags, 1, 1, ids, 0, *stage_buffers(table, len(ids)), threads=2)
        del flags
        gc.collect()
        assert alive() is not None
        alive()[:] = 1  # the device's writes, through the only reference left
        disk, staged, copied = job.join()
        assert disk == len(ids) and not copied
        del job
        gc.collect()
        assert alive() is None


def test_a_caller_writing_its_slots_buffer_during_stage_never_crashes(fp8_table, source_rows):
    needs_helper()

    def case():
        with open_table(fp8_table, read_path="mapped") as table:
            table.gather(np.arange(table.num_rows))  # cached: stage copies
            ids = np.random.default_rng(2).integers(0, table.num_rows, 200_000)
            slots, index, out = stage_buffers(table, len(ids))
            stop = threading.Event()

            def scribble():
                rng = np.random.default_rng(3)
                while not stop.is_set():
                    slots[rng.integers(0, len(slots), 1000)] = rng.integers(-2**62, 2**62, 1000)

            writer = threading.Thread(target=scribble)
            writer.start()
            outcomes = set()
            try:
                for _ in range(30):
                    try:
                        table._stage(ids, 100, slots, index, out, threads=4)
                        outcomes.add("staged")
                    except RuntimeError as exc:
                        assert "slots buffer changed" in str(exc)
                        outcomes.add("refused")
            finally:
                stop.set()
                writer.join()
            # Served again once the caller leaves its buffer alone.
            disk, staged = table._stage(ids, 100, slots, index, out, threads=4)
            assert staged and np.array_equal(out[len(out) - disk:], source_rows[ids[slots >= 100]])
            return outcomes

    assert in_child(case)


@pytest.mark.parametrize("bad_id", [-2**63, 2**63 - 1, -1])
def test_ids_at_the_ends_of_int64_are_refused_on_a_rank_table(fp8_rank_tables, bad_id, loops):
    with open_table(fp8_rank_tables / "ple.tp1of2.bin", read_path="mapped") as table:
        assert table.first_row > 0
        ids = np.array([table.first_row, bad_id, table.first_row + 1], dtype=np.int64)
        with pytest.raises(IndexError, match=f"row id {bad_id} is outside"):
            table.gather(ids)
        slots, index, out = stage_buffers(table, len(ids))
        with pytest.raises(IndexError, match=f"row id {bad_id} is outside"):
            table._stage(ids, 0, slots, index, out)


def test_a_request_past_max_request_rows_is_refused_before_anything_is_allocated(fp8_table):
    with open_table(fp8_table) as table:
        huge = np.broadcast_to(np.int64(0), (10**8,))  # 10^8 ids in no memory at all
        tracemalloc.start()
        try:
            for call in (table.gather, table.values, table.lookup):
                with pytest.raises(ValueError, match=r"10+ rows is more than the 4194304 one call may ask for"):
                    call(huge)
            slots, index, out = stage_buffers(table, 1)
            with pytest.raises(ValueError, match="max_request_rows"):
                table._stage(huge, 0, slots, index, out)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
    with open_table(fp8_table, max_request_rows=10) as table:
        assert table.gather(np.arange(10)).shape == (10, table.row_bytes)
        with pytest.raises(ValueError, match="11 rows is more than the 10"):
            table.gather(np.arange(11))


def test_values_needs_less_than_twice_its_result(fp8_table):
    with open_table(fp8_table) as table:
        ids = np.random.default_rng(4).integers(0, table.num_rows, 100_000)
        table.values(ids[:10])
        tracemalloc.start()
        try:
            values = table.values(ids)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * values.nbytes, f"peak {peak / values.nbytes:.2f}x the result"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stage_refuses_the_float_ids_gather_refuses(fp8_table, dtype, loops):
    with open_table(fp8_table) as table:
        ids = np.array([1.7, 2.2], dtype=dtype)
        with pytest.raises(TypeError, match="row ids must be integers"):
            table.gather(ids)
        with pytest.raises(TypeError, match="row ids must be integers"):
            table._stage(ids, 0, *stage_buffers(table, 2))


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int64])
def test_lookup_refuses_an_out_buffer_that_does_not_hold_row_bytes(fp8_table, dtype):
    with open_table(fp8_table) as table:
        out = np.zeros((3, table.row_bytes), dtype=dtype)
        with pytest.raises(ValueError, match="out must hold uint8 row bytes"):
            table.lookup(np.arange(3), out=out)
        assert not out.any()


@pytest.mark.parametrize("read_path", ["direct", "pread", "mapped"])
@pytest.mark.parametrize("bad_slot", [-1, 10**6, 2**62])
def test_gather_slots_refuses_slots_outside_the_table_on_every_path(fp8_table, read_path, bad_slot, loops):
    with open_table(fp8_table, read_path=read_path) as table:
        slots = np.array([0, bad_slot, 5], dtype=np.int64)
        with pytest.raises(IndexError, match=f"slot {bad_slot} is outside the table's {table.num_rows} slots"):
            table.gather_slots(slots)
        with pytest.raises(TypeError, match="slots must be integers"):
            table.gather_slots(np.array([0.5]))


@pytest.mark.parametrize("read_path", ["direct", "pread", "mapped"])
def test_the_numpy_fallback_gives_the_compiled_helpers_rows(fp8_table, source_rows, read_path, loops):
    with open_table(fp8_table, read_path=read_path) as table:
        ids = np.random.default_rng(5).integers(0, table.num_rows, 5000)
        assert np.array_equal(table.gather(ids), source_rows[ids])
        slots, index, out = stage_buffers(table, len(ids))
        disk, staged = table._stage(ids, 100, slots, index, out)
        if staged:
            assert np.array_equal(out[len(out) - disk:], source_rows[ids[slots >= 100]])


def test_the_helpers_threads_sleep_when_idle(fp8_table):
    """After a stage split over 4 threads, the pool's workers stop spinning: the process uses next
    to no CPU while nothing is asked of it."""
    needs_helper()
    with open_table(fp8_table, read_path="mapped") as table:
        ids = np.random.default_rng(6).integers(0, table.num_rows, 100_000)
        table.gather(ids)
        slots, index, out = stage_buffers(table, len(ids))
        table._stage(ids, 100, slots, index, out, threads=4)
        time.sleep(0.05)  # past the workers' short spin after a job
        before = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - before < 0.05
