"""StepLookup: a step's lookup the device starts and waits for itself (runtime/device/steps.py), equal to
`Table.values` bit for bit across poisoned buffers, cached and cold; failed steps never deliver rows and
raise their cause; on a GPU, one CUDA graph replayed with new ids."""
from __future__ import annotations

import gc
import mmap
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.bf16_bits import bits, expected_bits  # noqa: E402
from support.file_systems import skip_unless_on_a_block_file_system  # noqa: E402
from support.step_calls import captured_step, poison, serve, token_ids  # noqa: E402
from support.table_copies import cold_copy, copy_table, hot_text_first  # noqa: E402

from ple_prep.offline.writer import WriteOptions  # noqa: E402
from ple_prep.runtime import RECORD_BYTES, FailureRecord, failure_record, open_table  # noqa: E402
from ple_prep.runtime.device import buffers, driver, steps  # noqa: E402
from ple_prep.runtime.device.dequant import decoder_for  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402

pytestmark = pytest.mark.skipif(steps._native is None, reason="needs the compiled helper")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["step-kernels", "side-stream"])
def device_half(request, monkeypatch):
    """How a CUDA step's device half runs: the step kernels (up to KERNEL_MAX_IDS ids, where the
    driver loads them; raised here so that every step of a test goes through them) or the side
    stream and the copy engine (larger steps, and where it cannot)."""
    monkeypatch.setattr(steps, "KERNEL_MAX_IDS", 1 << 20 if request.param == "step-kernels" else 0)
    return request.param


def wait_for_queued_work(failure: str, seconds: float = 60) -> None:
    """Polled, not synchronized: a hang fails the test with `failure` instead of holding it."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


@pytest.fixture(scope="module", params=["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def table(request, tmp_path_factory, converted_table):
    checkpoint = request.getfixturevalue(request.param)
    made = converted_table(checkpoint, tmp_path_factory.mktemp("steps") / "t.bin", placed=hot_text_first)
    with open_table(made.path) as opened:
        opened.spec = made.spec
        yield opened


@pytest.fixture(params=["cached", "cold"])
def page_cache(request, table, tmp_path):
    if request.param == "cached":
        table.path.read_bytes()
        with open_table(table.path, read_path="mapped") as opened:
            opened.spec = table.spec
            yield opened
        return
    copy = cold_copy(table.path, tmp_path)
    with open_table(copy, read_path="direct") as opened:
        opened.spec = table.spec
        yield opened





@pytest.mark.parametrize("device", DEVICES)
def test_steps_give_the_tables_values_across_poisoned_buffers(page_cache, device):
    table = page_cache
    lookup = steps.StepLookup(table, device=device, resident_bytes=3000 * table.row_bytes, max_ids=300 * 16)
    try:
        # 4 tokens: KERNEL_MAX_IDS ids, the largest step the step kernels serve on a GPU.
        for tokens, seed in ((300, 1), (1, 2), (4, 3), (300, 4), (1, 5)):
            ids = token_ids(table, tokens, seed)
            poison(lookup)
            values = serve(lookup, ids)
            assert values.shape == (tokens * 16, table.values_per_row) and values.dtype == torch.bfloat16
            assert np.array_equal(bits(values), expected_bits(table, ids))
            lookup.check()
        stats = lookup.stats()
        assert stats["starts"] == 5 and stats["ids"] == 606 * 16 and stats["failed"] == 0
        tiers = ("rows_resident", "rows_page_cache", "rows_host_cache", "rows_disk")
        assert sum(stats[tier] for tier in tiers) == stats["ids"]
        assert 0 < stats["rows_resident"] < stats["ids"]
        cold = table.read_path == "direct"
        assert (stats["rows_disk"] > 0) == cold and (stats["rows_page_cache"] > 0) == (not cold)
        # Each block read once a step: fewer pages than rows (a page holds 25 FP8 rows).
        assert 0 < stats["pages_read"] < stats["rows_disk"] if cold else stats["pages_read"] == 0
    finally:
        lookup.close()


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_steps_some_rows_cached_some_read_are_exact(table, device, tmp_path):
    """A copy whose pages are partly in the page cache: steps whose rows are all cached (copied
    through the mapping), steps with half of them cached (the probe of a few rows picks either
    path: the mapping, which reads what is missing, or the service thread's O_DIRECT reads), buffers
    poisoned."""
    copy = cold_copy(table.path, tmp_path)
    with open_table(copy, read_path="mapped") as opened:
        requests = [token_ids(table, tokens, seed) for seed, tokens in enumerate((40, 1, 200, 7, 120))]
        for ids in requests[::2]:
            opened.gather(ids.reshape(-1)[::2].copy())  # half of these steps' rows cached
        for ids in requests[1::2]:
            opened.gather(ids.reshape(-1))  # all of these
        lookup = steps.StepLookup(opened, device=device, resident_bytes=500 * table.row_bytes, max_ids=300 * 16)
        try:
            for ids in requests:
                poison(lookup)
                assert np.array_equal(bits(serve(lookup, ids)), expected_bits(table, ids))
            lookup.check()
            stats = lookup.stats()
            assert stats["rows_disk"] > 0 and stats["rows_page_cache"] > 0
        finally:
            lookup.close()


def test_the_poison_row_decodes_to_nan_everywhere(table):
    row = torch.from_numpy(buffers.poison_row(table)).reshape(1, -1)
    values = decoder_for(table.encoding, table.values_per_row, table.scale, "cpu")(row)
    assert torch.isnan(values.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_an_id_outside_the_table_fails_its_step_naming_the_id_and_the_next_step_is_served(table, device):
    lookup = steps.StepLookup(table, device=device, resident_bytes=1000 * table.row_bytes, max_ids=64 * 16)
    try:
        ids = token_ids(table, 4, 1).reshape(-1).copy()
        ids[5] = table.num_rows + 7
        lookup.start(torch.from_numpy(ids).to(lookup.device))
        if device == "cpu":
            with pytest.raises(IndexError, match=f"row id {table.num_rows + 7} is outside"):
                lookup.finish()
        else:
            values = lookup.finish()
            torch.cuda.synchronize()
            assert torch.isnan(values.float()).all()  # no row of the failed step is delivered
            assert isinstance(lookup.pending_error(), IndexError)  # told, not taken
            with pytest.raises(IndexError, match=f"row id {table.num_rows + 7} is outside"):
                lookup.check()
        assert lookup.pending_error() is None
        good = token_ids(table, 6, 2)
        assert np.array_equal(bits(serve(lookup, good)), expected_bits(table, good))
        assert lookup.stats()["failed"] == 1
    finally:
        lookup.close()


@needs_cuda
def test_the_start_after_a_failed_step_raises_its_cause_and_the_next_start_is_served(table):
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=1000 * table.row_bytes, max_ids=64 * 16)
    try:
        ids = token_ids(table, 2, 3).reshape(-1).copy()
        ids[0] = table.num_rows + 3
        lookup.start(torch.from_numpy(ids).cuda())
        lookup.finish()
        torch.cuda.synchronize()
        good = token_ids(table, 3, 4)
        with pytest.raises(IndexError, match=f"row id {table.num_rows + 3} is outside"):
            lookup.start(torch.from_numpy(good.reshape(-1)).cuda())
        assert np.array_equal(bits(serve(lookup, good)), expected_bits(table, good))
    finally:
        lookup.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_step_is_in_the_shared_record_before_the_step_is_released_and_stays_the_first(table, device):
    """The record (mapped shared memory, as another process maps it) holds the first failure ever, with
    the cause `check` raises, once the failed step's rows are delivered; a later failure leaves it."""
    shared = mmap.mmap(-1, RECORD_BYTES)
    record = FailureRecord(shared)
    record.describe(name=table.path.name, holder="rank 1", capacity=64 * 16, read_timeout=30.0)
    lookup = steps.StepLookup(table, device=device, resident_bytes=1000 * table.row_bytes, max_ids=64 * 16,
                              failure_record=record)
    try:
        assert record.error() is None
        good = token_ids(table, 3, 4)
        assert np.array_equal(bits(serve(lookup, good)), expected_bits(table, good))
        assert record.error() is None
        for bad in (table.num_rows + 7, table.num_rows + 9):
            ids = token_ids(table, 4, 1).reshape(-1).copy()
            ids[5] = bad
            lookup.start(torch.from_numpy(ids).to(lookup.device))
            if device == "cpu":
                with pytest.raises(IndexError):
                    lookup.finish()
            else:
                lookup.finish()
                torch.cuda.synchronize()  # the step's rows delivered: the record shows its failure
            error = FailureRecord(shared).error()  # a reader of its own, as another process's
            assert isinstance(error, IndexError)
            assert str(error) == f"row id {table.num_rows + 7} is outside the table"
            if device != "cpu":
                with pytest.raises(IndexError, match=f"row id {bad} is outside"):
                    lookup.check()
        assert FailureRecord(shared).holder == "rank 1"
    finally:
        lookup.close()


def test_a_shared_record_keeps_whichever_failure_claimed_it_first(table):
    """Writers of one record in two processes (two views of the same memory, locks of their own) and a
    step service's thread: the first to claim the record writes it whole, the others leave it."""
    shared = mmap.mmap(-1, RECORD_BYTES)
    mine, theirs = FailureRecord(shared), FailureRecord(shared)
    mine.publish(ValueError("the first failure"))
    theirs.publish(OSError(5, "a later failure"))
    lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=16, failure_record=theirs)
    try:
        ids = token_ids(table, 1, 1).reshape(-1).copy()
        ids[0] = table.num_rows + 3
        lookup.start(torch.from_numpy(ids))
        with pytest.raises(IndexError):  # the step failed; the record already held a failure
            lookup.finish()
    finally:
        lookup.close()
    for record in (mine, theirs, FailureRecord(shared)):
        error = record.error()
        assert type(error) is RuntimeError and str(error) == "ValueError: the first failure"
    with pytest.raises(ValueError, match="512 bytes"):
        steps._native.record_state(bytearray(RECORD_BYTES - 8))


@pytest.mark.parametrize("helper", ["compiled", "missing"])
def test_a_record_is_written_whole_once_and_read_back_with_or_without_the_helper(helper, monkeypatch):
    """Without the compiled helper (no service thread to race with) a record's writers and readers
    keep the same rules: the first failure stays, a reader waits out a writer's claim and then says
    the record is stuck rather than read it half written."""
    if helper == "missing":
        monkeypatch.setattr(failure_record, "_native", None)
    shared = mmap.mmap(-1, RECORD_BYTES)
    first, second = FailureRecord(shared), FailureRecord(shared)
    assert first.error() is None
    first.publish(OSError(28, "no space left"))
    second.publish(ValueError("later"))
    assert str(second.error()) == "OSError: [Errno 28] no space left"
    stuck = FailureRecord(mmap.mmap(-1, RECORD_BYTES))
    assert stuck._claim() and not stuck._claim()
    began = time.monotonic()
    assert str(stuck.error()) == "a PLE lookup failed a step (its record is in state 1)"
    assert time.monotonic() - began >= failure_record._WRITING_SECONDS


@pytest.mark.parametrize("device", DEVICES)
def test_an_io_error_fails_its_step_and_the_next_step_is_served(table, device, tmp_path):
    """A truncated copy: the direct read of a row past its end fails; rows before it still serve."""
    copy = copy_table(table.path, tmp_path)
    with open_table(copy, read_path="direct") as opened:
        lookup = steps.StepLookup(opened, device=device, resident_bytes=0, max_ids=64 * 16)
        try:
            slots = opened.slot_of(np.arange(opened.num_rows))
            late = np.flatnonzero(slots >= opened.num_rows - 50)[:16]
            early = np.flatnonzero(slots < 100)[:16]
            with open(copy, "r+b") as file:
                file.truncate(opened.header.data_offset + (opened.num_rows // 2) // opened.header.rows_per_page
                              * opened.header.page_size)
            lookup.start(torch.from_numpy(late.astype(np.int64)).to(lookup.device))
            if device == "cpu":
                with pytest.raises(OSError):
                    lookup.finish()
            else:
                values = lookup.finish()
                torch.cuda.synchronize()
                assert torch.isnan(values.float()).all()
                with pytest.raises(OSError):
                    lookup.check()
            values = serve(lookup, early.astype(np.int64))
            assert np.array_equal(bits(values), expected_bits(table, early))
        finally:
            lookup.close()


def test_a_table_of_large_pages_keeps_its_cold_reads_in_a_bounded_buffer(fp8_checkpoint, converted_table, tmp_path):
    """Blocks of large pages are large: the reads in flight shrink to keep the buffer within the disk
    tier's cap (runtime/direct.py), as the table's own reader does."""
    made = converted_table(fp8_checkpoint, tmp_path / "t.bin", options=WriteOptions(page_size=1 << 20))
    with open_table(made.path, read_path="direct") as opened:
        before = virtual_bytes()
        lookup = steps.StepLookup(opened, device="cpu", resident_bytes=0, max_ids=64)
        try:
            assert lookup.read_depth == 8  # 8 MiB of 1 MiB blocks
            assert virtual_bytes() - before < 256 << 20  # 512 reads of 1 MiB would map 512 MiB
            ids = np.arange(0, opened.num_rows, 997, dtype=np.int64)[:64]
            assert np.array_equal(bits(serve(lookup, ids)), expected_bits(opened, ids))
        finally:
            lookup.close()


def virtual_bytes() -> int:
    """This process's mapped memory (VmSize)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmSize in /proc/self/status")


@pytest.mark.parametrize("max_ids", [0, steps.MAX_IDS + 1])
def test_a_lookup_of_more_ids_than_its_reads_can_rank_is_refused_by_name(table, max_ids):
    with pytest.raises(ValueError, match=f"max_ids must be from 1 to {steps.MAX_IDS}"):
        steps.StepLookup(table, device="cpu", max_ids=max_ids)


def test_bad_calls_are_refused(table):
    lookup = steps.StepLookup(table, device="cpu", max_ids=32)
    try:
        with pytest.raises(RuntimeError, match="finish.. without a start"):
            lookup.finish()
        with pytest.raises(ValueError, match="33 row ids: this lookup takes 1 to max_ids = 32"):
            lookup.start(torch.zeros(33, dtype=torch.int64))
        with pytest.raises(TypeError, match="int64"):
            lookup.start(torch.zeros(3, dtype=torch.int32))
    finally:
        lookup.close()


def test_the_helpers_step_queue_refuses_a_bad_layout_count_or_call_before_any_driver_call():
    native = pytest.importorskip("ple_prep.runtime._native")
    memory = np.zeros(64, dtype=np.uint8)  # host addresses the queue only holds: nothing is queued
    address = memory.ctypes.data
    with pytest.raises(ValueError, match="inconsistent"):  # the index would overlap the staging rows
        native.step_queue(1, 2, address, address, address + 4, address + 8, 0, address, 8, 160, 8 * 160 - 4, 0, 0,
                          0, 0)
    with pytest.raises(ValueError, match="kernel_max_ids without the kernels"):
        native.step_queue(1, 2, address, address, address + 4, address + 8, 0, address, 8, 160, 8 * 160, 0, 0, 0, 4)
    queue = native.step_queue(1, 2, address, address, address + 4, address + 8, 0, address, 8, 160, 8 * 160, 0, 0, 0,
                              0)
    for count in (0, 8):  # one staging row holds the poison row: 7 ids at most
        with pytest.raises(ValueError, match=f"{count} ids, this lookup takes 1 to 7"):
            native.queue_step_start(queue, 3, 4, False, count)
        with pytest.raises(ValueError, match=f"{count} ids, this lookup takes 1 to 7"):
            native.queue_step_fetch(queue, 3, 0, True, count)
    with pytest.raises(TypeError, match="takes 5 arguments .4 given."):
        native.queue_step_start(queue, 3, 4, 1)
    with pytest.raises(TypeError, match="takes 5 arguments .4 given."):
        native.queue_step_fetch(queue, 3, 0, 1)
    with pytest.raises(ValueError):  # not a step queue
        native.queue_step_fetch(object(), 3, 0, True, 1)


def each_replay_serves_its_step(table, lookup, ids_buffer, consumer, replay, seeds) -> None:
    """Per seed: new ids in `ids_buffer`, every buffer poisoned, `replay()`; `consumer` then holds
    the table's values of those ids."""
    for seed in seeds:
        ids = token_ids(table, 8, seed).reshape(-1)
        ids_buffer.copy_(torch.from_numpy(ids))
        poison(lookup)
        replay()
        torch.cuda.synchronize()
        assert np.array_equal(bits(consumer), expected_bits(table, ids)), seed
    lookup.check()


@needs_cuda
@pytest.mark.parametrize("same_graph", [False, True], ids=["start-on-the-stream", "start-beside-it"])
def test_one_cuda_graph_replayed_with_new_ids_serves_each_steps_rows(table, same_graph, device_half):
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    ids_buffer = torch.zeros(8 * 16, dtype=torch.int64, device="cuda")
    consumer = torch.empty(8 * 16, table.values_per_row, dtype=torch.bfloat16, device="cuda")
    try:
        first = token_ids(table, 8, 0).reshape(-1)
        ids_buffer.copy_(torch.from_numpy(first))
        serve(lookup, first)  # warm-up outside the capture
        graph = captured_step(lookup, ids_buffer, consumer, finish_in_same_graph=same_graph)
        torch.cuda.synchronize()
        each_replay_serves_its_step(table, lookup, ids_buffer, consumer, graph.replay, range(1, 30))
    finally:
        lookup.close()


@needs_cuda
def test_eager_steps_between_replays_of_a_full_graph_serve_each_its_rows(table, device_half):
    """A lookup captured in a FULL graph still serves eager steps (as vLLM's eager prefill chunks
    between FULL-graph decode steps): eager steps queued between replays of the graph, none waited
    for, each serve their rows."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    ids_buffer = torch.zeros(8 * 16, dtype=torch.int64, device="cuda")
    consumer = torch.empty(8 * 16, table.values_per_row, dtype=torch.bfloat16, device="cuda")
    try:
        serve(lookup, token_ids(table, 8, 0))  # warm-up outside the capture
        graph = captured_step(lookup, ids_buffer, consumer)
        poison(lookup)
        replayed, eager, kept = [], [], []
        for seed in range(1, 9):
            ids = token_ids(table, 8, seed).reshape(-1)
            ids_buffer.copy_(torch.from_numpy(ids))
            graph.replay()
            replayed.append((ids, consumer.clone()))
            ids = token_ids(table, 8, 100 + seed).reshape(-1)
            lookup.start(torch.from_numpy(ids).cuda())  # beside the replay still queued before it
            eager.append(ids)
            kept.append(lookup.finish().clone())
        torch.cuda.synchronize()
        lookup.check()
        for ids, values in replayed:
            assert np.array_equal(bits(values), expected_bits(table, ids))
        for ids, values in zip(eager, kept):
            assert np.array_equal(bits(values), expected_bits(table, ids))
    finally:
        lookup.close()


@needs_cuda
def test_start_and_finish_in_two_graphs_as_piecewise_graphs_hold_them_serve_each_step(table, device_half):
    """A piecewise graph ends between start and finish: start's copy stays on the capturing stream
    (a capture may not end with a side stream unjoined) and each pair of replays serves its step."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    ids_buffer = torch.zeros(8 * 16, dtype=torch.int64, device="cuda")
    consumer = torch.empty(8 * 16, table.values_per_row, dtype=torch.bfloat16, device="cuda")
    try:
        serve(lookup, token_ids(table, 8, 0).reshape(-1))  # warm-up outside the capture
        starting, finishing = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(starting):
                lookup.start(ids_buffer)
            with torch.cuda.graph(finishing):
                consumer.copy_(lookup.finish())
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        def replay() -> None:
            starting.replay()
            torch.cuda._sleep(1_000_000)  # the layers between them
            finishing.replay()

        each_replay_serves_its_step(table, lookup, ids_buffer, consumer, replay, range(1, 12))
    finally:
        lookup.close()


@needs_cuda
def test_a_start_left_unfinished_in_one_piecewise_graph_is_dropped_inside_the_next(table, device_half):
    """A forward pass that failed before the PLE layer leaves its start unfinished; the next step
    drops it inside its own capture, which may hold no event recorded outside it, and serves its rows."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    ids_buffer = torch.zeros(8 * 16, dtype=torch.int64, device="cuda")
    consumer = torch.empty(8 * 16, table.values_per_row, dtype=torch.bfloat16, device="cuda")
    try:
        serve(lookup, token_ids(table, 8, 0).reshape(-1))  # warm-up outside the capture
        abandoned, served = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(abandoned):
                lookup.start(ids_buffer)
            with torch.cuda.graph(served):
                lookup.drop()
                lookup.start(ids_buffer)
                consumer.copy_(lookup.finish())
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

        def replay() -> None:
            abandoned.replay()
            served.replay()

        each_replay_serves_its_step(table, lookup, ids_buffer, consumer, replay, range(1, 12))
    finally:
        lookup.close()


@needs_cuda
@pytest.mark.parametrize("same_graph", [False, True], ids=["start-on-the-stream", "start-beside-it"])
def test_graph_replays_queued_back_to_back_with_the_host_ahead_serve_every_step(table, same_graph, device_half):
    """Replays queued without a host wait between them, each step's ids picked on the device, with
    device work between start and finish so the service thread has staged the rows before the device
    waits (the flags of consecutive steps follow each other with no synchronize to separate them)."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    requests = [token_ids(table, 2, seed).reshape(-1) for seed in range(40)]
    pool = torch.from_numpy(np.stack(requests)).cuda()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    ids = torch.empty(pool.shape[1], dtype=torch.int64, device="cuda")
    history = torch.empty(len(requests), pool.shape[1], table.values_per_row, dtype=torch.bfloat16, device="cuda")

    def step():
        torch.index_select(pool, 0, counter, out=ids.unsqueeze(0))
        lookup.start(ids, finish_in_same_graph=same_graph)
        torch.cuda._sleep(2_000_000)  # about a millisecond: the host is done before the device waits
        history.index_copy_(0, counter, lookup.finish().unsqueeze(0))
        counter.add_(1)

    try:
        step()  # outside the capture once: the kernels compiled, the eager finish's graph captured
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        counter.zero_()
        poison(lookup)
        for _ in requests:
            graph.replay()
        wait_for_queued_work("queued replays did not finish: a step's flags were lost")
        for k, request in enumerate(requests):
            assert np.array_equal(bits(history[k]), expected_bits(table, request)), k
        lookup.check()
        assert lookup.stats()["late"] < len(requests)
    finally:
        lookup.close()


@needs_cuda
def test_eager_cold_steps_beside_busy_streams_never_wait_on_other_device_work(table, tmp_path, device_half):
    """Back-to-back eager steps whose rows the thread reads from the drive while 32 other streams (more
    than the device's hardware queues) hold queued work: only the thread's host store releases a step's
    wait, so no step can sit behind a copy queued after it on a shared queue (docs/RUNTIME.md)."""
    copy = copy_table(table.path, tmp_path)
    busy = [torch.cuda.Stream() for _ in range(32)]
    with open_table(copy, read_path="direct", host_cache_bytes=0) as cold:
        lookup = steps.StepLookup(cold, device="cuda", resident_bytes=0, max_ids=64 * 16)
        try:
            requests = [token_ids(table, 1 + seed % 4, seed).reshape(-1) for seed in range(60)]
            outputs = []
            evict(copy)
            for k, request in enumerate(requests):
                with torch.cuda.stream(busy[k % len(busy)]):
                    torch.cuda._sleep(200_000)
                lookup.start(torch.from_numpy(request).cuda())
                outputs.append(lookup.finish().clone())
            wait_for_queued_work("eager steps did not finish: a wait was never released")
            for request, values in zip(requests, outputs):
                assert np.array_equal(bits(values), expected_bits(table, request))
            lookup.check()
        finally:
            lookup.close()


def step_in_mode(lookup, ids: torch.Tensor, consumer: torch.Tensor, mode: str, device_work: bool):
    """One step's calls as `mode` runs them ("eager", "full-graph": start and finish in one captured
    graph, "piecewise-graphs": each in a graph of its own), with about a millisecond of device work
    between start and finish or none: a function that queues the step."""
    def work() -> None:
        if device_work:
            torch.cuda._sleep(2_000_000)

    def eager() -> None:
        lookup.start(ids)
        work()
        consumer.copy_(lookup.finish())

    if mode == "eager":
        return eager
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    with torch.cuda.stream(stream):
        if mode == "full-graph":
            with torch.cuda.graph(graphs[0]):
                lookup.start(ids, finish_in_same_graph=True)
                work()
                consumer.copy_(lookup.finish())
        else:
            with torch.cuda.graph(graphs[0]):
                lookup.start(ids)
            with torch.cuda.graph(graphs[1]):
                consumer.copy_(lookup.finish())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if mode == "full-graph":
        return graphs[0].replay

    def piecewise() -> None:
        graphs[0].replay()
        work()
        graphs[1].replay()

    return piecewise


@needs_cuda
@pytest.mark.parametrize("mode", ["eager", "full-graph", "piecewise-graphs"])
def test_a_step_is_counted_late_when_the_device_waited_for_its_rows_and_only_then(table, mode, device_half):
    """The device marks its arrival at finish before it waits, in every mode, and clears it after, so
    the thread counts a step late when the device got there first: a step whose finish follows its
    start at once after 150 ms idle (the thread then polls 1 ms apart) is late, one with a millisecond
    of device work between start and finish is not, nor is the step after it."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    ids = torch.from_numpy(token_ids(table, 2, 3).reshape(-1)).cuda()
    consumer = torch.empty(ids.numel(), table.values_per_row, dtype=torch.bfloat16, device="cuda")
    try:
        serve(lookup, ids.cpu().numpy())  # warm-up outside any capture
        at_once, after_work = (step_in_mode(lookup, ids, consumer, mode, work) for work in (False, True))
        before = lookup.stats()["late"]
        for _ in range(5):
            time.sleep(0.15)
            at_once()
            torch.cuda.synchronize()
        idle_late = lookup.stats()["late"] - before
        before = lookup.stats()["late"]
        for _ in range(10):
            after_work()
            torch.cuda.synchronize()
        busy_late = lookup.stats()["late"] - before
        assert np.array_equal(bits(consumer), expected_bits(table, ids.cpu().numpy()))
        lookup.check()
        assert idle_late >= 4 and busy_late <= 1, (idle_late, busy_late)
    finally:
        lookup.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_dropped_step_is_not_counted_late(table, device, device_half):
    """A dropped step's forward pass never reached the PLE layer, so its fetch marks no arrival, even
    when the thread serves it long after (after 150 ms idle the thread polls 1 ms apart; on the CPU
    the drop waits for cold reads)."""
    with open_table(table.path, read_path="direct", host_cache_bytes=0) as cold:
        cold.spec = table.spec
        lookup = steps.StepLookup(cold, device=device, resident_bytes=0, max_ids=64 * 16)
        try:
            ids = torch.from_numpy(token_ids(cold, 8, 5).reshape(-1)).to(lookup.device)
            serve(lookup, ids.cpu().numpy())  # warm-up: the eager finish's graph captured
            late = lookup.stats()["late"]
            for _ in range(3):
                evict(cold.path)
                time.sleep(0.15)
                lookup.start(ids)
                lookup.drop()
                if device == "cuda":
                    torch.cuda.synchronize()
            assert lookup.stats()["late"] == late
            assert np.array_equal(bits(serve(lookup, ids.cpu().numpy())), expected_bits(cold, ids.cpu().numpy()))
        finally:
            lookup.close()


def test_a_step_whose_wait_timed_out_on_the_cpu_is_waited_for_before_the_next_one(table, monkeypatch, tmp_path):
    """On the CPU the caller waits for the thread itself: a wait that gives up (TimeoutError) leaves
    that step's READY to come, which must not release the next step's wait with the old rows. (A copy
    of the table, whose pages no mapping holds, is evicted: the thread reads the step from the drive,
    after 150 ms idle, when it polls 1 ms apart.)"""
    copy = copy_table(table.path, tmp_path)
    with open_table(copy, read_path="direct", host_cache_bytes=0) as cold:
        cold.spec = table.spec
        lookup = steps.StepLookup(cold, device="cpu", resident_bytes=0, max_ids=64 * 16)
        try:
            first, second = (token_ids(cold, 64, seed).reshape(-1) for seed in (6, 7))
            evict(copy)
            time.sleep(0.15)
            monkeypatch.setattr(steps, "HOST_WAIT_SECONDS", 0.0)
            lookup.start(torch.from_numpy(first))
            with pytest.raises(TimeoutError, match="did not serve a step"):
                lookup.finish()
            monkeypatch.setattr(steps, "HOST_WAIT_SECONDS", 120.0)
            time.sleep(0.2)  # the thread serves the first step meanwhile
            assert np.array_equal(bits(serve(lookup, second)), expected_bits(cold, second))
            assert np.array_equal(bits(serve(lookup, first)), expected_bits(cold, first))
            lookup.check()
        finally:
            lookup.close()


@needs_cuda
def test_a_collection_due_during_an_eager_finish_s_capture_waits_until_after_it(table, monkeypatch):
    """The first eager finish of a size captures its device half; a CUDA graph left in a reference
    cycle and collected during that capture would end it with an error (a graph may not be destroyed
    while its thread captures)."""
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    thresholds = gc.get_threshold()
    graphs = lookup._graphs
    device_half = graphs._device_half

    def device_half_due_a_collection(size: int) -> torch.Tensor:
        gc.set_threshold(1)  # the next allocations start a collection wherever collection is on
        _ = [[] for _ in range(100)]
        return device_half(size)

    try:
        garbage = torch.cuda.CUDAGraph()
        scratch = torch.zeros(1, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(garbage):
            scratch.add_(1)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        ids = token_ids(table, 8, 1)
        gc.disable()  # nothing collected before the capture
        cycle = [garbage]
        cycle.append(cycle)
        del garbage, cycle  # freed only by a collection
        monkeypatch.setattr(graphs, "_device_half", device_half_due_a_collection)
        gc.enable()
        assert np.array_equal(bits(serve(lookup, ids)), expected_bits(table, ids))
        lookup.check()
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
        lookup.close()


@needs_cuda
def test_start_and_finish_return_while_the_device_has_queued_work(table, device_half):
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=0, max_ids=64 * 16)
    try:
        ids = torch.from_numpy(token_ids(table, 4, 3).reshape(-1).copy()).cuda()
        torch.cuda._sleep(100_000_000)  # tens of ms of queued device work
        began = time.perf_counter()
        lookup.start(ids)
        started = time.perf_counter()
        lookup.finish()
        finished = time.perf_counter()
        assert torch.cuda.current_stream().query() is False
        assert started - began < 0.01 and finished - started < 0.01
        torch.cuda.synchronize()
    finally:
        lookup.close()


def test_the_step_kernels_ship_with_the_package_as_ptx_older_drivers_load():
    ptx = driver.STEP_KERNELS_PTX.read_text()
    assert ".version 7.0\n" in ptx and ".target sm_75\n" in ptx
    assert ".entry step_request(" in ptx and ".entry step_fetch(" in ptx


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs CUDA's nvcc")
def test_the_step_kernels_ptx_is_what_its_source_compiles_to(tmp_path):
    subprocess.run(["bash", str(REPOSITORY / "scripts/build-step-kernels.sh"), str(tmp_path / "built.ptx")], check=True)
    assert (tmp_path / "built.ptx").read_bytes() == driver.STEP_KERNELS_PTX.read_bytes()


@needs_cuda
def test_the_step_kernels_load_on_this_gpu_and_serve_steps_up_to_their_limit(table):
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    try:
        assert lookup.kernel_max_ids == min(steps.KERNEL_MAX_IDS, lookup.capacity) > 0
    finally:
        lookup.close()


@needs_cuda
def test_kernels_the_driver_cannot_load_leave_every_step_to_the_side_stream(table, tmp_path, monkeypatch, caplog):
    (tmp_path / "bad.ptx").write_text(".version 7.0\n.target sm_75\nnot ptx\n")
    monkeypatch.setattr(driver, "STEP_KERNELS_PTX", tmp_path / "bad.ptx")
    lookup = steps.StepLookup(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64 * 16)
    try:
        assert lookup.kernel_max_ids == 0
        assert "step kernels are not used" in caplog.text and "CUDA error" in caplog.text
        for seed in range(3):
            ids = token_ids(table, 8, seed)
            poison(lookup)
            assert np.array_equal(bits(serve(lookup, ids)), expected_bits(table, ids))
        lookup.check()
    finally:
        lookup.close()


def test_the_service_reads_with_aio_on_a_block_file_system_however_fast_the_disk(fp8_table):
    """A disk fast enough to complete the probe's reads the moment io_submit returns (a virtual disk
    answering from its host's cache) does not send the service to one pread at a time on ext4, xfs,
    btrfs or f2fs, whose native AIO is asynchronous."""
    skip_unless_on_a_block_file_system(fp8_table)
    with open_table(fp8_table, read_path="direct") as opened:
        for _ in range(20):
            lookup = steps.StepLookup(opened, device="cpu", resident_bytes=0, max_ids=16)
            try:
                assert lookup.reads_async
            finally:
                lookup.close()

