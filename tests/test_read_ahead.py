"""Read-ahead on its compiled reader (runtime/native/readahead.c): exact rows through a cache far
smaller than the request, each block read once, a lookup of the chunk being read served by the
read-ahead, other lookups first, and every disk fault an exception naming the file, never a hang.

Slow and failing disks come from the FUSE file system of tests/support/faultfs.py, where O_DIRECT
reads complete inside io_submit and the reader reads one block at a time on its worker; each such
case runs in a forked child (a signal or a hang fails the test, not the run).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.isolation import in_child
from support.slowed_disk import SlowedDisk

from ple_prep.core.errors import BadInput
from ple_prep.runtime import hostcache, open_table, readahead
from ple_prep.tools.benchmark import evict

pytestmark = pytest.mark.skipif(readahead._native is None, reason="needs the compiled helper")
POISON = 0xA5
# A read of the slowed disk: the table's blocks take seconds to read ahead one at a time.
DELAY_SECONDS = 0.004


def open_direct(path, **options):
    try:
        table = open_table(path, read_path="direct", **options)
    except BadInput as error:
        pytest.skip(str(error))
    if table.host_cache is None:
        table.close()
        pytest.skip("no host cache on this read path")
    return table


def chunks_of(table, count: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, table.num_rows, size) for _ in range(count)]


def poisoned(count: int, row_bytes: int) -> np.ndarray:
    return np.full((count, row_bytes), POISON, dtype=np.uint8)


def rows_on_pages(table, pages) -> np.ndarray:
    """Ids of the first row of each of these pages (the fixture table is in source order)."""
    ids = np.asarray(pages, dtype=np.int64) * table.rows_per_page
    assert np.array_equal(table.slot_of(ids), ids)
    return ids


def slow_disk(faults, table) -> None:
    """Every read of the table's data waits DELAY_SECONDS first."""
    header = table.header
    faults.fail("t.bin", header.data_offset, header.data_offset + header.num_pages * header.page_size, "delay",
                DELAY_SECONDS)


def test_the_compiled_read_ahead_reads_each_block_once_and_lookups_then_read_nothing(fp8_table, source_rows):
    evict(fp8_table)
    with open_direct(fp8_table, host_cache_bytes=8 << 20) as table:
        tier = table.host_cache
        chunks = chunks_of(table, 6, 900, 1)
        job = table.read_ahead(chunks)
        assert job.wait(30) and job.error is None and job.chunks_done == len(chunks)
        slots = np.unique(np.concatenate([table.slot_of(chunk) for chunk in chunks]))
        assert job.rows_read == len(slots)
        assert job.pages_read == len(np.unique(slots // table.rows_per_page))  # each block once
        for chunk in chunks:
            out = poisoned(len(chunk), table.row_bytes)
            table.gather(chunk, out=out)
            assert np.array_equal(out, source_rows[chunk])
        assert tier.rows_read == 0 and tier.cache.pinned == 0
        assert tier.cache.read_ahead_hits == job.rows_read


def test_read_ahead_and_gathers_on_a_cache_far_smaller_than_a_request_never_yield_wrong_rows(fp8_table,
                                                                                           source_rows):
    """Three sets of the cache: the compiled read-ahead's admissions (pinned, the set full or not),
    the gathers' admissions and their copies out race on the same entries."""
    budget = 3 * (source_rows.shape[1] + 8) * hostcache.WAYS + 3
    errors: list = []
    evict(fp8_table)
    with open_direct(fp8_table, host_cache_bytes=budget) as table:
        assert table.host_cache.cache.entries == 3 * hostcache.WAYS

        def gather(seed: int) -> None:
            try:
                for step in range(20):
                    ids = chunks_of(table, 1, 400, seed * 100 + step)[0]
                    out = poisoned(len(ids), table.row_bytes)
                    table.gather(ids, out=out)
                    if not np.array_equal(out, source_rows[ids]):
                        errors.append(seed)
            except Exception as error:  # noqa: BLE001 (reported by the assertion below)
                errors.append(error)

        jobs = [table.read_ahead(chunks_of(table, 8, 500, 900 + k)) for k in range(3)]
        threads = [threading.Thread(target=gather, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for job in jobs:
            job.cancel()
            assert job.wait(10) and job.error is None
        assert table.host_cache.cache.pinned == 0
    assert errors == []


def test_a_gather_of_the_chunk_being_read_ahead_waits_for_it_instead_of_reading_it(faults, source_rows):
    path = faults.path("t.bin")

    def case():
        with open_direct(path, host_cache_bytes=8 << 20) as table:
            tier = table.host_cache
            slow_disk(faults, table)
            # Every row of the first 400 pages, then of the pages after the 402nd: more rows than
            # read-ahead's batches hold, and no page of one next to a page of the other.
            rows = np.arange(table.num_rows)
            pages = rows // table.rows_per_page
            chunks = [rows[pages < 400], rows[pages >= 402]]
            assert np.array_equal(table.slot_of(rows), rows) and len(chunks[0]) > readahead.BATCH_ROWS
            evict(path)
            job = table.read_ahead(chunks)
            time.sleep(0.2)  # its reads of the first chunk have begun
            out = poisoned(len(chunks[0]), table.row_bytes)
            table.gather(chunks[0], out=out)
            waited_for = job.done
            job.cancel()
            job.wait(10)
            faults.clear()
            return tier.rows_read, np.array_equal(out, source_rows[chunks[0]]), waited_for

    demand_rows, exact, finished_first = in_child(case, timeout=60)
    assert exact
    assert not finished_first  # the read-ahead was still reading when the gather returned
    assert demand_rows == 0    # the gather read nothing itself


def test_a_gather_of_other_rows_goes_before_the_read_ahead(faults, source_rows):
    path = faults.path("t.bin")

    def case():
        with open_direct(path, host_cache_bytes=8 << 20) as table:
            slow_disk(faults, table)
            pages = np.arange(table.header.num_pages)
            # The read-ahead reads the first half of the table's pages (seconds), the gather ten of the second.
            half = len(pages) // 2
            ahead = [rows_on_pages(table, pages[:half])]
            ids = rows_on_pages(table, pages[half + 10:half + 20])
            evict(path)
            job = table.read_ahead(ahead)
            while table.host_cache.cache.pinned == 0 and not job.done:
                time.sleep(0.001)
            began = time.monotonic()
            out = table.gather(ids, out=poisoned(len(ids), table.row_bytes))
            took = time.monotonic() - began
            running = not job.done
            job.cancel()
            job.wait(10)
            faults.clear()
            return took, running, np.array_equal(out, source_rows[ids])

    took, running, exact = in_child(case, timeout=60)
    assert exact and running
    assert took < 0.5  # its ten reads and the read-ahead's reads in flight, not the read-ahead's queue


def test_cancel_stops_a_read_ahead_in_progress_and_releases_its_pins(faults):
    path = faults.path("t.bin")

    def case():
        with open_direct(path, host_cache_bytes=8 << 20) as table:
            slow_disk(faults, table)
            evict(path)
            job = table.read_ahead(chunks_of(table, 4, 3000, 3))  # seconds of reads
            time.sleep(0.3)
            began = time.monotonic()
            job.cancel()
            stopped = job.wait(5)
            took = time.monotonic() - began
            faults.clear()
            return stopped, took, table.host_cache.cache.pinned, job.rows_read, job.error is None

    stopped, took, pinned, rows_read, clean = in_child(case, timeout=60)
    assert stopped and took < 0.5 and clean  # within a read of the slowed disk, not a batch of them
    assert pinned == 0 and rows_read > 0


@pytest.mark.parametrize("fault", ["eio", "short"])
def test_a_failing_read_ends_the_read_ahead_with_an_error_naming_the_file(faults, source_rows, fault):
    path = faults.path("t.bin")

    def case():
        with open_direct(path, host_cache_bytes=8 << 20) as table:
            chunks = chunks_of(table, 4, 800, 4)
            header = table.header
            middle = header.data_offset + header.num_pages // 2 * header.page_size
            faults.fail("t.bin", middle, middle + 40 * header.page_size, fault)
            evict(path)
            job = table.read_ahead(chunks)
            finished = job.wait(10)
            message = repr(job.error)
            faults.clear()
            evict(path)
            again = table.read_ahead(chunks)
            again.wait(10)
            out = poisoned(len(chunks[3]), table.row_bytes)
            table.gather(chunks[3], out=out)
            return finished, isinstance(job.error, OSError), message, again.error is None, \
                np.array_equal(out, source_rows[chunks[3]])

    finished, is_os_error, message, recovered, exact = in_child(case, timeout=60)
    assert finished and is_os_error and str(path) in message, message
    assert any(cause in message for cause in ("Input/output error", "short")), message
    assert recovered and exact


def test_a_hung_read_ends_the_read_ahead_after_the_timeout(faults, source_rows):
    path = faults.path("t.bin")

    def case():
        with open_direct(path, host_cache_bytes=8 << 20, read_timeout=1.0) as table:
            chunks = chunks_of(table, 2, 800, 5)
            header = table.header
            faults.fail("t.bin", header.data_offset, header.data_offset + header.page_size * header.num_pages, "hang")
            evict(path)
            began = time.monotonic()
            job = table.read_ahead(chunks)
            finished = job.wait(10)
            waited = time.monotonic() - began
            faults.clear()
            return finished, waited, isinstance(job.error, TimeoutError), repr(job.error)

    finished, waited, timed_out, message = in_child(case, timeout=60)
    assert finished and timed_out and str(path) in message and "1 s" in message, message
    assert 0.9 < waited < 5.0


def test_an_o_direct_read_ahead_read_past_its_timeout_fails_and_the_next_read_ahead_reads_again(fp8_table,
                                                                                                source_rows):
    """A disk slowed to one read a second (a blkio cgroup's throttle, where root has one): the
    read-ahead's native AIO reads time out after 0.3 s, and once the disk is fast again a read-ahead
    of the same rows brings them."""
    disk = SlowedDisk(fp8_table)

    def case():
        disk.throttle()
        # One read in flight: reads left to the throttle drain at its rate, and the child must exit.
        with open_direct(fp8_table, host_cache_bytes=8 << 20, read_timeout=0.3, queue_depth=1) as table:
            chunks = chunks_of(table, 2, 800, 6)
            evict(fp8_table)
            disk.enter()  # every thread: the read-ahead's too
            began = time.monotonic()
            job = table.read_ahead(chunks)
            finished = job.wait(10)
            waited = time.monotonic() - began
            disk.leave()
            time.sleep(1.1)  # the throttled reads left in flight complete: the disk has recovered
            again = table.read_ahead(chunks)
            again.wait(10)
            out = poisoned(len(chunks[1]), table.row_bytes)
            table.gather(chunks[1], out=out)
            return finished, waited, repr(job.error), isinstance(job.error, TimeoutError), again.error is None, \
                table.host_cache.rows_read, np.array_equal(out, source_rows[chunks[1]])

    with disk:
        finished, waited, message, timed_out, recovered, demand_rows, exact = in_child(case, timeout=60)
    assert finished and timed_out and str(fp8_table) in message and "0.3 s" in message, message
    assert waited < 3.0
    assert recovered and exact and demand_rows == 0
