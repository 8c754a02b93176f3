"""A serving process under a failing disk: every fault ends in an exception naming the file and the
cause, never a signal or a hang, and the next request is served once the disk recovers.

Faults come from a FUSE file system (tests/faultfs.py), as they were found; each case runs in a
forked child, so that a SIGBUS or a segfault fails the test instead of killing the test run.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support.isolation import in_child
from support.slowed_disk import SlowedDisk

from ple_prep.core.errors import BadInput
from ple_prep.format import pagesums as pagesums_module
from ple_prep.format.manifest import manifest_path
from ple_prep.format.pages import row_offsets
from ple_prep.format.pagesums import page_sums, pagesums_path
from ple_prep.runtime import open_table
from ple_prep.tools.benchmark import evict

READ_PATHS = ("direct", "pread", "mapped")


def data_range(table, slots) -> tuple[int, int]:
    """The byte range of the pages holding these slots."""
    pages = np.asarray(slots) // table.rows_per_page
    start = table.header.data_offset + int(pages.min()) * table.page_size
    return start, table.header.data_offset + (int(pages.max()) + 1) * table.page_size


def cold_request(table) -> np.ndarray:
    """Ids spread over the whole table, so that no probe of a few of them is all that is read."""
    return np.random.default_rng(1).integers(0, table.num_rows, 3000)


@pytest.mark.parametrize("read_path", READ_PATHS)
@pytest.mark.parametrize("fault", ["eio", "short"])
def test_a_failing_read_raises_naming_the_file_and_the_next_request_is_served(faults, source_rows, read_path,
                                                                              fault):
    path = faults.path("t.bin")

    def case():
        with open_table(path, read_path=read_path) as table:
            ids = cold_request(table)
            start, end = data_range(table, table.slot_of(ids[1500:1600]))
            evict(path)
            faults.fail("t.bin", start, end, fault)
            try:
                table.gather(ids)
            except OSError as exc:
                message = str(exc)
            else:
                message = None
            faults.clear()
            evict(path)
            return message, np.array_equal(table.gather(ids), source_rows[ids])

    message, recovered = in_child(case)
    assert message is not None and str(path) in message, message
    assert any(cause in message for cause in ("Input/output error", "I/O error", "short")), message
    assert recovered


def test_a_direct_request_whose_probed_rows_are_cached_raises_on_a_truncated_file(fp8_table, tmp_path):
    """The probe sees cached pages, another row's page is gone: the copy must not fault."""
    path = tmp_path / "t.bin"
    shutil.copyfile(fp8_table, path)
    shutil.copyfile(manifest_path(fp8_table), manifest_path(path))

    def case():
        with open_table(path, read_path="direct") as table:
            ids = np.array([0, 10, 20, table.num_rows - 5, 30])
            table.gather(ids[[0, 1, 2, 4]])
            with open(path, "rb") as file:
                # Cache the probed rows' pages through a buffered read, as a convert or cp leaves them.
                file.read(table.header.data_offset + 4 * table.page_size)
            os.truncate(path, os.path.getsize(path) // 2)
            try:
                table.gather(ids)
            except (OSError, ValueError) as exc:
                return f"{type(exc).__name__}: {exc}"
            return None

    message = in_child(case)
    assert message is not None and "t.bin" in message, message


def test_a_lookup_step_whose_copy_through_the_mapping_faults_fails_alone(fp8_table, tmp_path):
    """StepLookup (the vLLM plugin's lookup): a page cut from a cached file under the mapping fails
    the step that reads it, naming the mapping, and the next steps of cached rows are served again."""
    torch = pytest.importorskip("torch")
    from support.bf16_bits import bits, expected_bits

    from ple_prep.runtime.device import steps
    if steps._native is None:
        pytest.skip("needs the compiled helper")
    path = tmp_path / "t.bin"
    shutil.copyfile(fp8_table, path)
    shutil.copyfile(manifest_path(fp8_table), manifest_path(path))
    size = path.stat().st_size

    def case():
        path.read_bytes()  # every page cached: the step copies through the mapping
        with open_table(path, read_path="mapped") as table:
            lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=64)
            try:
                early = np.arange(64, dtype=np.int64)
                faulting = early.copy()
                faulting[1] = table.num_rows - 1  # never a row the page-cache probe looks at
                os.truncate(path, size - 16 * table.page_size)
                outcomes = []
                lookup.start(torch.from_numpy(faulting))
                try:
                    lookup.finish()
                except OSError as exc:
                    outcomes.append(str(exc))
                os.truncate(path, size)
                for _ in range(2):
                    lookup.start(torch.from_numpy(early))
                    outcomes.append(bool(np.array_equal(bits(lookup.finish()), expected_bits(table, early))))
                return outcomes, lookup.stats()["failed"]
            finally:
                lookup.close()

    (message, *served), failed = in_child(case)
    assert "through the mapping failed at byte" in message and "t.bin" in message, message
    assert served == [True, True] and failed == 1


def test_a_lookup_on_a_file_system_whose_reads_complete_inside_io_submit_opens_without_reading(faults, source_rows):
    """StepLookup on FUSE, where a slow O_DIRECT read would hold io_submit: made at once with the
    first block's reads slowed past the read timeout, and its step of that block fails after it."""
    torch = pytest.importorskip("torch")
    from support.bf16_bits import bits, expected_bits

    from ple_prep.runtime.device import steps
    if steps._native is None:
        pytest.skip("needs the compiled helper")
    path = faults.path("t.bin")

    def case():
        with open_table(path, read_timeout=1.0, host_cache_bytes=0) as table:
            end = data_range(table, np.arange(1))[1]
            evict(path)
            faults.fail("t.bin", table.header.data_offset, end, "delay", 3.0)
            began = time.monotonic()
            lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=64)
            made = time.monotonic() - began
            try:
                ids = np.arange(16, dtype=np.int64)
                lookup.start(torch.from_numpy(ids))
                try:
                    lookup.finish()
                    message = None
                except TimeoutError as exc:
                    message = str(exc)
                faults.clear()
                evict(path)
                lookup.start(torch.from_numpy(ids))
                return made, message, bool(np.array_equal(bits(lookup.finish()), expected_bits(table, ids)))
            finally:
                lookup.close()

    made, message, recovered = in_child(case, timeout=60)
    assert made < 0.5, made
    assert message is not None and "stalled" in message, message
    assert recovered


def test_a_failing_page_cache_probe_raises_its_errno_and_names_the_table(fp8_table, tmp_path):
    """mincore failing (here by a preloaded stand-in returning ENOMEM) under the device source's
    lookup: an OSError with that errno, naming the table and what failed."""
    pytest.importorskip("torch")
    from ple_prep.runtime.device import steps
    compiler = shutil.which("cc") or shutil.which("gcc")
    if steps._native is None or compiler is None:
        pytest.skip("needs the compiled helper and a C compiler")
    shim = tmp_path / "failing_mincore.c"
    shim.write_text("#include <errno.h>\n#include <stddef.h>\n"
                    "int mincore(void *a, size_t n, unsigned char *v) { (void)a; (void)n; (void)v; "
                    "errno = ENOMEM; return -1; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "failing_mincore.so"), str(shim)], check=True)
    code = ("import sys, numpy as np\n"
            "from ple_prep.runtime import EmbeddingSource, open_table\n"
            "with open_table(sys.argv[1], read_path='mapped') as table:\n"
            "    try:\n"
            "        EmbeddingSource(table, device='cpu', max_ids=64)(np.arange(40))\n"
            "    except OSError as error:\n"
            "        print(error.errno, error)\n")
    done = subprocess.run([sys.executable, "-c", code, str(fp8_table)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LD_PRELOAD": str(tmp_path / "failing_mincore.so")})
    expected = f"12 [Errno 12] {fp8_table}: mincore failed on the table's mapping (Cannot allocate memory)"
    assert done.stdout.strip() == expected, done.stdout + done.stderr[-2000:]


def test_the_default_path_reads_with_pread_where_o_direct_completes_inside_io_submit(faults, source_rows):
    """FUSE does O_DIRECT reads synchronously: one at a time, and a hung one out of the timeout's reach."""
    with open_table(faults.path("t.bin")) as table:
        assert table.read_path == "pread" and "inside io_submit" in table.read_path_note
        ids = cold_request(table)
        assert np.array_equal(table.gather(ids), source_rows[ids])
    # Asked for by name, O_DIRECT is kept, and the note says what the timeout then cannot reach.
    with open_table(faults.path("t.bin"), read_path="direct") as table:
        assert table.read_path == "direct" and "out of reach of the read timeout" in table.read_path_note
        assert np.array_equal(table.gather(ids), source_rows[ids])


def test_a_hung_read_fails_the_request_after_the_timeout_then_the_disk_recovers(faults, source_rows):
    path = faults.path("t.bin")

    def case():
        with open_table(path, read_timeout=1.0) as table:
            ids = cold_request(table)
            start, end = data_range(table, table.slot_of(ids[:1]))
            evict(path)
            faults.fail("t.bin", start, end, "hang")
            began = time.monotonic()
            try:
                table.gather(ids)
                message = None
            except TimeoutError as exc:
                message = str(exc)
            waited = time.monotonic() - began
            faults.clear()
            evict(path)
            return message, waited, np.array_equal(table.gather(ids), source_rows[ids])

    message, waited, recovered = in_child(case)
    assert message is not None and str(path) in message and "1 s" in message, message
    assert 0.9 < waited < 5.0
    assert recovered


def test_an_o_direct_read_past_its_timeout_fails_and_the_next_request_reads_again(fp8_table, source_rows):
    """A disk slowed to one read a second (a blkio cgroup's throttle, where root has one): a read
    timeout of 0.3 s fails the request, and once the disk is fast again the next one is served."""
    disk = SlowedDisk(fp8_table)

    def case():
        disk.throttle()
        with open_table(fp8_table, read_path="direct", read_timeout=0.3, queue_depth=1, host_cache_bytes=0) as table:
            if table.read_path != "direct":
                return "skip"
            ids = cold_request(table)
            messages = []
            for request in (ids, ids[:1]):  # the refill loop and the one-submission path
                evict(fp8_table)
                disk.enter(every_thread=False)
                began = time.monotonic()
                try:
                    table.gather(request)
                    messages.append((None, time.monotonic() - began))
                except TimeoutError as exc:
                    messages.append((str(exc), time.monotonic() - began))
                disk.leave(every_thread=False)
                time.sleep(1.1)  # the throttled read left in flight completes: the disk has recovered
                assert np.array_equal(table.gather(request), source_rows[request])
            return messages

    with disk:
        outcome = in_child(case)
    if outcome == "skip":
        pytest.skip("O_DIRECT is refused here")
    for message, waited in outcome:
        assert message and str(fp8_table) in message and "0.3 s" in message, outcome
        assert waited < 3.0


def longest_stall(work) -> tuple[float, object]:
    """The longest gap, in seconds, between the ticks of another Python thread while `work()` runs."""
    gaps = []
    stop = threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    return max(gaps), result


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_a_stalled_disk_never_stops_other_python_threads(faults, source_rows, read_path):
    path = faults.path("t.bin")

    def case():
        with open_table(path, read_path=read_path) as table:
            ids = cold_request(table)[:10]
            start, end = data_range(table, table.slot_of(ids))
            evict(path)
            faults.fail("t.bin", start, end, "delay", seconds=0.2)
            began = time.monotonic()
            stall, rows = longest_stall(lambda: table.gather(ids))
            return stall, time.monotonic() - began, np.array_equal(rows, source_rows[ids])

    # A shared 2-core host can deschedule the ticking thread on its own: the best of three runs
    # (a path holding the GIL stalls the ticker for the whole 0.2 s delay in every one).
    stalls = []
    for _ in range(3):
        stall, took, equal = in_child(case)
        assert took > 0.2 and equal
        stalls.append(stall)
        if stall < 0.05:
            break
    assert min(stalls) < 0.05, f"another thread stood still for {min(stalls) * 1000:.0f} ms"


@pytest.mark.parametrize("data, expected", [(bytes(range(64)), 0xf7c67301db6713f0), (bytes(4096), 0xac869b6f32d8bbdb),
                                            (bytes(i * 7 % 256 for i in range(4096)), 0xc8066d80a6fe1426)])
def test_page_sums_are_xxh64_with_and_without_the_helper(data, expected):
    """Reference values from the xxhash package's XXH64 (seed 0)."""
    pages = np.frombuffer(data, dtype=np.uint8).reshape(1, -1)
    assert int(page_sums(pages)[0]) == expected & 0xFFFFFFFF
    assert int(pagesums_module._sums_numpy(pages)[0]) == expected & 0xFFFFFFFF


@pytest.fixture(scope="module")
def summed_faultfs(faultfs):
    """The FUSE mount's table with its page sums, written through the CLI from the source folder."""
    from click.testing import CliRunner

    from ple_prep.cli import cli

    source = faultfs.source / "t.bin"
    result = CliRunner().invoke(cli, ["pagesums", str(source)])
    assert result.exit_code == 0 and "676 pages" in result.output, result.output
    yield faultfs
    pagesums_path(source).unlink()


@pytest.mark.parametrize("read_path", ["direct", "pread"])
def test_a_disk_returning_zeros_is_refused_with_verify_reads_and_served_without(summed_faultfs, source_rows,
                                                                             read_path):
    faults = summed_faultfs
    path = faults.path("t.bin")

    def case():
        outcomes = []
        for verify in (False, True):
            # No host cache: it would keep the wrong rows an unverified read admitted (section 10).
            with open_table(path, read_path=read_path, verify_reads=verify, host_cache_bytes=0) as table:
                ids = cold_request(table)
                row = int(row_offsets(table.header, table.slot_of(ids[7:8]))[0])
                evict(path)
                faults.fail("t.bin", row, row + table.row_bytes, "zeros")
                try:
                    rows = table.gather(ids)
                    outcomes.append(("served", bool(np.array_equal(rows, source_rows[ids]))))
                except OSError as exc:
                    outcomes.append(("refused", str(exc)))
                faults.clear()
                evict(path)
                outcomes.append(np.array_equal(table.gather(ids), source_rows[ids]))
        return outcomes

    unverified, recovered, verified, recovered_again = in_child(case)
    assert unverified == ("served", False)  # what the issue found: wrong rows, silently
    assert verified[0] == "refused" and str(path) in verified[1] and "page sum differs" in verified[1], verified
    assert recovered and recovered_again


def test_a_lookup_step_reading_other_bytes_fails_with_verify_reads_and_its_rows_stay_out_of_the_cache(
        summed_faultfs, source_rows):
    """StepLookup's thread (the vLLM plugin's lookup) reads pages itself: with `verify_reads` it checks
    them against the page sums as the table's readers do, so a disk returning zeros fails the step
    with EIO naming the file, and the zeros are never admitted into the host cache that later steps
    and `Table.gather` read; without it they are served and kept (the cache's documented trade)."""
    torch = pytest.importorskip("torch")
    from support.bf16_bits import bits, expected_bits

    from ple_prep.runtime.device import steps
    if steps._native is None:
        pytest.skip("needs the compiled helper")
    faults = summed_faultfs
    path = faults.path("t.bin")

    def case():
        outcomes = []
        for verify in (False, True):
            with open_table(path, read_path="direct", verify_reads=verify, host_cache_bytes=64 << 20) as table:
                ids = cold_request(table)[:64]
                with open_table(faults.source / "t.bin", host_cache_bytes=0) as truth:  # not through the faults
                    want = expected_bits(truth, ids)
                lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=64)
                try:
                    row = int(row_offsets(table.header, table.slot_of(ids[7:8]))[0])
                    evict(path)
                    faults.fail("t.bin", row, row + table.row_bytes, "zeros")
                    lookup.start(torch.from_numpy(ids))
                    try:
                        outcomes.append(("served", bool(np.array_equal(bits(lookup.finish()), want))))
                    except OSError as exc:
                        outcomes.append(("refused", str(exc)))
                    faults.clear()
                    evict(path)
                    lookup.start(torch.from_numpy(ids))
                    again = bool(np.array_equal(bits(lookup.finish()), want))
                    outcomes.append((again, bool(np.array_equal(table.gather(ids), source_rows[ids]))))
                finally:
                    lookup.close()
        return outcomes

    unverified, kept, verified, recovered = in_child(case)
    assert unverified == ("served", False) and kept == (False, False)  # the zeros, then from the cache
    assert verified[0] == "refused" and "t.bin" in verified[1] and "page sum differs" in verified[1], verified
    assert recovered == (True, True)


def summed_copy(table_path, folder) -> Path:
    """A copy of the table with its page sums (written through the CLI) in `folder`, which must be
    on a block device's file system (native AIO reads; skips elsewhere)."""
    from click.testing import CliRunner
    from support.file_systems import skip_unless_on_a_block_file_system

    from ple_prep.cli import cli
    skip_unless_on_a_block_file_system(folder)
    path = folder / "t.bin"
    shutil.copyfile(table_path, path)
    shutil.copyfile(manifest_path(table_path), manifest_path(path))
    assert CliRunner().invoke(cli, ["pagesums", str(path)]).exit_code == 0
    return path


def test_a_lookup_step_checks_its_native_aio_reads_against_the_page_sums(fp8_table, tmp_path):
    """The same check on the thread's native AIO path (a block device's file system): a page changed
    after its sum was written fails the step that reads it, naming the page's byte; a step of other
    pages is served bit for bit."""
    torch = pytest.importorskip("torch")
    from support.bf16_bits import bits, expected_bits

    from ple_prep.runtime.device import steps
    if steps._native is None:
        pytest.skip("needs the compiled helper")
    path = summed_copy(fp8_table, tmp_path)
    with open_table(path, read_path="direct", verify_reads=True, host_cache_bytes=0) as table:
        lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=64)
        try:
            assert lookup.reads_async
            pages = table.slot_of(np.arange(table.num_rows)) // table.rows_per_page
            changed = np.flatnonzero(pages == pages[100])[:8]
            others = np.flatnonzero(pages != pages[100])[:8]
            offset = table.header.data_offset + int(pages[100]) * table.page_size
            with open(path, "r+b") as file:
                file.seek(offset + 100)
                file.write(b"\x5a" * 16)
            evict(path)
            lookup.start(torch.from_numpy(changed.astype(np.int64)))
            with pytest.raises(OSError, match=f"t.bin: the page at byte {offset} read back other bytes.*page sum "
                                              "differs"):
                lookup.finish()
            lookup.start(torch.from_numpy(others.astype(np.int64)))
            assert np.array_equal(bits(lookup.finish()), expected_bits(table, others))
        finally:
            lookup.close()


def read_ahead_around_a_changed_page(table, source_rows, page: int) -> tuple:
    """Read ahead the first row of each of 41 pages around `page` (changed on the disk), with
    `verify_reads`: the read-ahead's error, whether the rows of the blocks before the changed one
    were admitted (a gather of them reads nothing and is exact), and the error of a gather of the
    changed page's row (a demand read checks it too: it was not admitted)."""
    from ple_prep.runtime.readcheck import MIN_BLOCK

    pages = np.arange(max(0, page - 20), min(table.header.num_pages, page + 21))
    ids = pages * table.rows_per_page
    assert np.array_equal(table.slot_of(ids), ids)  # the fixture table is in source order
    block = max(table.page_size, MIN_BLOCK)
    blocks = (table.header.data_offset + pages * table.page_size) // block
    before = ids[blocks < blocks[pages == page][0]]
    assert len(before) >= 10
    job = table.read_ahead([ids])
    assert job.wait(10)
    out = np.full((len(before), table.row_bytes), 0xA5, dtype=np.uint8)
    table.gather(before, out=out)
    kept = table.host_cache.rows_read == 0 and np.array_equal(out, source_rows[before])
    try:
        table.gather(ids[pages == page])
        demand = None
    except OSError as exc:
        demand = str(exc)
    return str(job.error), isinstance(job.error, OSError), kept, demand


def test_read_ahead_with_verify_reads_admits_no_block_whose_page_sum_differs(summed_faultfs, source_rows):
    """The compiled read-ahead checks each block it reads against the page sums as it lands (here
    read by its worker: FUSE completes O_DIRECT reads inside io_submit): the zeros a disk returns
    for one page fail the read-ahead with EIO naming the file and that page, its block is not
    admitted, and the blocks read before it are."""
    from ple_prep.runtime import readahead
    if readahead._native is None:
        pytest.skip("needs the compiled helper")
    faults = summed_faultfs
    path = faults.path("t.bin")

    def case():
        with open_table(path, read_path="direct", verify_reads=True, host_cache_bytes=8 << 20) as table:
            page = table.header.num_pages // 2
            offset = table.header.data_offset + page * table.page_size
            evict(path)
            faults.fail("t.bin", offset + 100, offset + 116, "zeros")
            try:
                return offset, read_ahead_around_a_changed_page(table, source_rows, page)
            finally:
                faults.clear()

    offset, (message, is_os_error, kept, demand) = in_child(case, timeout=60)
    assert is_os_error and "t.bin" in message and f"byte {offset}" in message and "page sum differs" in message, \
        message
    assert kept
    assert demand is not None and "page sum differs" in demand, demand


def test_read_ahead_checks_its_native_aio_reads_against_the_page_sums(fp8_table, source_rows, tmp_path):
    """The same on the read-ahead's native AIO path (a block device's file system)."""
    from ple_prep.runtime import readahead
    if readahead._native is None:
        pytest.skip("needs the compiled helper")
    path = summed_copy(fp8_table, tmp_path)
    with open_table(path, read_path="direct", verify_reads=True, host_cache_bytes=8 << 20) as table:
        page = table.header.num_pages // 2
        offset = table.header.data_offset + page * table.page_size
        with open(path, "r+b") as file:
            file.seek(offset + 100)
            file.write(b"\x5a" * 16)
        evict(path)
        message, is_os_error, kept, demand = read_ahead_around_a_changed_page(table, source_rows, page)
    assert is_os_error and "t.bin" in message and f"byte {offset}" in message and "page sum differs" in message, \
        message
    assert kept
    assert demand is not None and "page sum differs" in demand, demand


def test_verify_reads_refuses_at_open_a_row_order_map_that_changed_after_conversion(converted_table, fp8_checkpoint,
                                                                                  source_rows, tmp_path):
    # Two map entries swapped: still a valid map, which would serve each row's bytes for the other's.
    (tmp_path / "placed").mkdir()
    placed = converted_table(fp8_checkpoint, tmp_path / "placed" / "t.bin", placed=np.arange(999, 0, -3)).path
    path = summed_copy(placed, tmp_path)
    with open_table(path, verify_reads=True) as table:
        first, second = table.slot_of(np.array([999, 996]))
        assert np.array_equal(table.gather(np.array([999, 996])), source_rows[[999, 996]])
        offset = table.header.order_offset
    with open(path, "r+b") as file:
        entries = np.frombuffer(os.pread(file.fileno(), 8, offset + 4 * first), np.uint32)
        assert list(entries) == [999, 996] and second == first + 1
        os.pwrite(file.fileno(), entries[::-1].tobytes(), offset + 4 * first)
    with pytest.raises(BadInput, match=r"t\.bin: its header and row-order map read back other bytes.*header_crc32"):
        open_table(path, verify_reads=True)
    with open_table(path) as table:  # unverified, the map is only checked to be one
        assert np.array_equal(table.gather(np.array([999, 996])), source_rows[[996, 999]])


def test_verify_reads_needs_the_page_sums_and_a_disk_tier_read_path(fp8_table, tmp_path):
    with pytest.raises(BadInput, match=r"t\.bin\.pagesums is missing.*ple-prep pagesums"):
        open_table(fp8_table, verify_reads=True)
    with pytest.raises(ValueError, match="read_path='direct' or 'pread'"):
        open_table(fp8_table, read_path="mapped", verify_reads=True)


# The device source's case, in a fresh interpreter: torch's thread pools do not survive a fork.
DEVICE_SOURCE_CASE = """
import sys, numpy as np, torch
from ple_prep.runtime import open_table
from ple_prep.runtime.device import EmbeddingSource
path, read_path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open_table(path, read_path=read_path, host_cache_bytes=0) as table:
    source = EmbeddingSource(table, device="cpu", resident_bytes=0, max_ids=count)
    ids = np.random.default_rng(1).integers(0, table.num_rows, count)
    try:
        source.start(ids)
        source.finish()
        print("served", flush=True)
    except OSError as exc:
        print("refused", exc, flush=True)
    sys.stdin.readline()  # the disk recovers
    source.start(ids)
    values = source.finish()
    print("recovered", bool(torch.equal(values, torch.from_numpy(table.values(ids)).to(torch.bfloat16))), flush=True)
"""


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_the_device_source_raises_a_failing_read_at_finish_and_serves_the_next_request(faults, read_path):
    """EmbeddingSource.finish, on the CPU device: the call SERVING.md names for I/O errors."""
    pytest.importorskip("torch")
    path = faults.path("t.bin")
    with open_table(path) as table:
        ids = cold_request(table)
        start, end = data_range(table, table.slot_of(ids[1500:1600]))
    evict(path)
    faults.fail("t.bin", start, end, "eio")
    child = subprocess.Popen([sys.executable, "-c", DEVICE_SOURCE_CASE, str(path), read_path, str(len(ids))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parent.parent)
    try:
        first = child.stdout.readline()
        faults.clear()
        evict(path)
        second, errors = child.communicate("\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, errors
    assert first.startswith("refused") and str(path) in first, first + errors
    assert second.strip() == "recovered True", second + errors
