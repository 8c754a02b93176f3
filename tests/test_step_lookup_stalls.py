"""StepLookup under a stalled disk: a step whose cold read makes no progress for the read timeout
fails within it, naming the file, with no row of it delivered (its index names the poison row), and
once the disk recovers the next step is exact, across poisoned buffers (the late completion of the
abandoned read lands in a buffer no later step uses).

The pread path (FUSE completes O_DIRECT reads inside io_submit, so the service reads with its
worker thread there) under a FUSE hang; the native AIO path under a blkio cgroup's throttle."""
from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.bf16_bits import bits, expected_bits  # noqa: E402
from support.slowed_disk import SlowedDisk  # noqa: E402

from ple_prep.format.manifest import manifest_path  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.device import steps  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402

pytestmark = pytest.mark.skipif(steps._native is None, reason="needs the compiled helper")
TIMEOUT = 0.5


def spread_ids(table, count: int, seed: int) -> np.ndarray:
    """Ids spread over the whole table: most of their pages are read from the disk."""
    return np.random.default_rng(seed).integers(0, table.num_rows, count).astype(np.int64)


def poison(lookup) -> None:
    lookup.output.fill_(float("nan"))
    lookup.buffers.host_rows[1:].fill(0xFF)
    lookup._host_index[:] = -7


def timed_failing_step(lookup, ids: np.ndarray) -> tuple[BaseException | None, float]:
    lookup.start(torch.from_numpy(ids))
    began = time.monotonic()
    try:
        lookup.finish()
    except OSError as exc:
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


def assert_failed_within_the_timeout(lookup, path, error, waited, count: int) -> None:
    assert isinstance(error, TimeoutError), error
    message = str(error)
    assert str(path) in message and "stalled" in message and f"{TIMEOUT:g} s" in message, message
    assert TIMEOUT * 0.9 < waited < TIMEOUT + 2.0, waited
    # No row of the failed step is delivered: every position names the poison row.
    assert (lookup._host_index[:count] == lookup._poison).all()
    assert lookup.stats()["failed"] == 1


def test_a_hung_pread_fails_its_step_within_the_timeout_and_the_next_step_is_exact(faultfs):
    path = faultfs.path("t.bin")
    faultfs.clear()
    with open_table(path, read_timeout=TIMEOUT) as table:
        lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=512)
        try:
            assert lookup.read_timeout == TIMEOUT  # the table's own
            assert not lookup.reads_async  # FUSE completes O_DIRECT reads inside io_submit
            ids = spread_ids(table, 256, 1)
            pages = table.slot_of(ids) // table.rows_per_page
            start = table.header.data_offset + int(pages.min()) * table.page_size
            evict(path)
            faultfs.fail("t.bin", start, start + table.page_size, "hang")
            error, waited = timed_failing_step(lookup, ids)
            assert_failed_within_the_timeout(lookup, path, error, waited, len(ids))
            # A second step while the disk still hangs fails the same way (a new worker, the same wait).
            error, waited = timed_failing_step(lookup, ids)
            assert isinstance(error, TimeoutError) and waited < TIMEOUT + 2.0, (error, waited)
            # The disk recovers: the abandoned reads complete into their own buffers, not a step's.
            faultfs.clear()
            evict(path)
            for seed, request in enumerate((ids, spread_ids(table, 300, 2), ids[:1])):
                poison(lookup)
                lookup.start(torch.from_numpy(request))
                assert np.array_equal(bits(lookup.finish()), expected_bits(table, request)), seed
            assert lookup.stats()["failed"] == 2 and lookup.stats()["rows_disk"] > 0
        finally:
            faultfs.clear()
            lookup.close()


def test_an_aio_read_past_the_timeout_fails_its_step_and_the_next_step_is_exact(fp8_table, tmp_path):
    """A disk slowed to one read a second (a blkio cgroup's throttle): the service's O_DIRECT reads in
    flight stall, the step fails after the timeout, and once the throttle is lifted the next step
    reads again with a new AIO context and buffer."""
    path = tmp_path / "t.bin"
    shutil.copyfile(fp8_table, path)
    shutil.copyfile(manifest_path(fp8_table), manifest_path(path))
    with SlowedDisk(path, "ple-prep-steps") as disk:
        with open_table(path, read_path="direct", read_timeout=TIMEOUT) as table:
            if table.read_path != "direct":
                pytest.skip("this file system does not serve O_DIRECT")
            # The service thread is made here and moves with the process (cgroup.procs: every thread).
            lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=512)
            try:
                ids = spread_ids(table, 256, 4)
                evict(path)
                disk.throttle()
                disk.enter()
                try:
                    error, waited = timed_failing_step(lookup, ids)
                finally:
                    disk.leave()
                    disk.unthrottle()
                if error is None:
                    pytest.skip("the throttle did not slow this disk's reads")
                assert_failed_within_the_timeout(lookup, path, error, waited, len(ids))
                time.sleep(0.5)  # the abandoned reads complete, into their abandoned buffer
                evict(path)
                for seed, request in enumerate((ids, spread_ids(table, 300, 5))):
                    poison(lookup)
                    lookup.start(torch.from_numpy(request))
                    assert np.array_equal(bits(lookup.finish()), expected_bits(table, request)), seed
            finally:
                lookup.close()
