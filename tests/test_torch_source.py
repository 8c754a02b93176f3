"""EmbeddingSource: bf16 values equal to `Table.values`, from host ids, through both tiers and the
split call (start/finish), with every buffer it reuses poisoned between calls."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.bf16_bits import bits, expected_bits  # noqa: E402
from support.table_copies import cold_copy, hot_text_first  # noqa: E402

from ple_prep.ngram import row_ids  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.device import EmbeddingSource, staging  # noqa: E402
from ple_prep.runtime.device import buffers as buffers_module  # noqa: E402
from ple_prep.runtime.device import source as source_module  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def table(request, tmp_path_factory, converted_table):
    checkpoint = request.getfixturevalue(request.param)
    made = converted_table(checkpoint, tmp_path_factory.mktemp("source") / "t.bin", placed=hot_text_first)
    with open_table(made.path) as opened:
        opened.spec = made.spec
        yield opened


@pytest.fixture(params=["cached", "cold"])
def page_cache(request, table, tmp_path):
    """`table` with its pages in the page cache, or a copy of it whose pages are not (so the real
    mincore probe picks the copy from the page cache, or the table's read path)."""
    if request.param == "cached":
        table.path.read_bytes()
        yield table
        return
    copy = cold_copy(table.path, tmp_path)
    with open_table(copy) as opened:
        opened.spec = table.spec
        yield opened


@pytest.fixture(params=["fused", "torch"])
def kernels(request, monkeypatch):
    """FP8 on a GPU with Triton: the one-kernel row index and decode, or torch's index and decoder."""
    if request.param == "fused" and not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
        pytest.skip("the one-kernel path needs CUDA and Triton")
    if request.param == "torch":
        monkeypatch.setattr(buffers_module, "fp8_gather_for", lambda *args: None)
    return request.param


def token_ids(table, tokens: int, seed: int) -> np.ndarray:
    """(tokens, 16) row ids of token text through the real hash, with repeated tokens."""
    rng = np.random.default_rng(seed)
    return row_ids(rng.integers(0, 5000, tokens), table.spec)


def poison(source: EmbeddingSource) -> None:
    """Fill every buffer a call rewrites: 0xFF rows decode to NaN in every encoding tested here."""
    buffers = source.buffers
    buffers.output.fill_(float("nan"))
    buffers.rows.fill_(0xFF)
    buffers.host_rows.fill(0xFF)
    buffers.tiers[source.num_resident:].fill_(0xFF)


def disk_rows(table, source, ids: np.ndarray, *, distinct: bool) -> int:
    slots = table.slot_of(ids.reshape(-1))
    on_disk = slots[slots >= source.num_resident]
    return len(np.unique(on_disk)) if distinct else len(on_disk)


@pytest.mark.parametrize("device", DEVICES)
def test_host_ids_give_values_per_position_across_poisoned_buffers(page_cache, device, loops, kernels):
    table = page_cache
    source = EmbeddingSource(table, device=device, resident_bytes=3000 * table.row_bytes, max_ids=300 * 16)
    # Cached: every disk position is copied from the mapping; cold: the table's read path reads
    # each distinct row (O_DIRECT: the pages stay out of the page cache, so every call is cold).
    # Without the compiled copy, a table with a disk reader reads every disk row with it.
    cached = table.read_path == "mapped" or (cached_fraction(table.path) or 0) > 0.5 and loops == "compiled"
    # The one-kernel path serves exactly FP8 on a GPU (with Triton), never silently the torch one.
    assert (source.kernel == "fused") == (kernels == "fused" and device == "cuda" and table.encoding == "fp8_e4m3")
    # Both sides of INLINE_IDS (worker thread and inline), shrinking and growing between calls.
    for tokens, seed in ((300, 1), (120, 2), (300, 3), (1, 4), (64, 5)):
        ids = token_ids(table, tokens, seed)
        poison(source)
        source.start(ids)
        values = source.finish()
        assert values.shape == (tokens * 16, table.values_per_row) and values.dtype == torch.bfloat16
        assert values.device == source.device and values.data_ptr() == source.output.data_ptr()
        assert np.array_equal(bits(values), expected_bits(table, ids))
        # Cold: each distinct disk row read once (past DEDUP_MIN_ROWS disk positions); cached: each
        # disk position copied.
        if tokens > 4 and (cached or table.read_path == "direct"):
            assert source.last_disk_rows == disk_rows(table, source, ids, distinct=not cached) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_ids_as_cpu_tensor_device_tensor_and_any_integer_dtype(table, device):
    source = EmbeddingSource(table, device=device, resident_bytes=500 * table.row_bytes, max_ids=64 * 16)
    ids = token_ids(table, 64, 5)
    for given in (torch.from_numpy(ids), torch.from_numpy(ids.astype(np.int32)).to(device),
                  ids.astype(np.uint32)):
        poison(source)
        values = source(given)
        assert values.shape == (64, 16 * table.values_per_row)
        assert np.array_equal(bits(values), expected_bits(table, ids))
    flat = source(ids.reshape(-1)[:40])
    assert flat.shape == (40, table.values_per_row)
    assert np.array_equal(bits(flat), expected_bits(table, ids.reshape(-1)[:40]))


@pytest.mark.needs_cuda
def test_device_ids_give_values_from_a_helper_thread_or_at_finish_across_poisoned_buffers(page_cache, loops):
    """Ids on the GPU: a large request's lookup waits on a helper thread for them to land (with the
    compiled helper), a small one's runs at finish; the caller's tensor may go at once."""
    table = page_cache
    source = EmbeddingSource(table, device="cuda", resident_bytes=3000 * table.row_bytes, max_ids=300 * 16)
    for tokens, seed, dtype in ((300, 1, torch.int64), (1, 4, torch.int64), (120, 2, torch.int32),
                                (300, 3, torch.int64)):
        ids = token_ids(table, tokens, seed)
        poison(source)
        torch.cuda.synchronize()
        on_device = torch.from_numpy(ids).to("cuda", dtype)
        before = source.stats()
        source.start(on_device)
        on_helper = (source.stats() - before).helper_lookups
        assert on_helper == (loops == "compiled" and ids.size > source_module.INLINE_IDS)
        del on_device
        torch.cuda.empty_cache()
        values = source.finish()
        assert np.array_equal(bits(values), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_a_large_device_request_has_its_cached_rows_copied_by_the_helper_thread(page_cache, loops, request):
    """Staged rows of a large request from device ids go to the device by the helper thread's own
    copy, launched the moment they are staged; rows not in the page cache are read at join and
    copied from Python as before. Bit-exact both ways, across poisoned buffers."""
    if loops != "compiled":
        pytest.skip("only the compiled helper's thread stages device ids")
    table = page_cache
    source = EmbeddingSource(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=300 * 16)
    before = source.stats()
    for tokens, seed in ((300, 21), (250, 22), (300, 23)):
        ids = token_ids(table, tokens, seed)
        poison(source)
        source.start(torch.from_numpy(ids).to("cuda"))
        values = source.finish()
        assert np.array_equal(bits(values), expected_bits(table, ids))
    served = source.stats() - before
    cached = request.node.callspec.params["page_cache"] == "cached"
    assert (served.helper_lookups, served.helper_copies, served.host_copies) == ((3, 3, 0) if cached else (3, 0, 3))
    assert served.rows_page_cache + served.rows_disk + served.rows_resident == served.ids


@pytest.mark.needs_cuda
def test_small_device_requests_are_finished_in_one_call_of_the_helper_once_their_graph_exists(page_cache, loops,
                                                                                             request):
    """From the second decode-sized start from device ids of a graph size on, finish waits for the
    ids, stages them and launches the graph in one call of the compiled helper: no replay through
    torch. Rows not in the page cache take the general path. The ids here are written behind a
    long kernel, so a finish that did not wait for them would read stale ones. Bit-exact across
    poisoned buffers."""
    if loops != "compiled":
        pytest.skip("only the compiled helper finishes in one call")
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        pytest.skip("this torch does not hand out its graphs' execs")
    table = page_cache
    source = EmbeddingSource(table, device="cuda", resident_bytes=500 * table.row_bytes, max_ids=64 * 16)
    written = torch.empty((4, 16), dtype=torch.int64, device="cuda")
    steps = ((1, 31), (1, 32), (3, 33), (1, 34), (4, 35), (2, 36))  # graphs of 16, 16, 64, 16, 64, 32 positions
    for tokens, seed in steps:
        ids = token_ids(table, tokens, seed)
        poison(source)
        on_device = torch.from_numpy(ids).to("cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # the kernel that computes the ids, running long
        written[:tokens].copy_(on_device)
        source.start(written[:tokens])
        values = source.finish()
        assert np.array_equal(bits(values), expected_bits(table, ids))
        assert source.last_disk_rows == int((table.slot_of(ids.reshape(-1)) >= source.num_resident).sum())
    cached = request.node.callspec.params["page_cache"] == "cached"
    served = source.stats()
    # With the rows cached, each size's first replays through torch and the rest are one call each.
    assert (served.graph_replays, served.one_call_finishes) == ((3, 3) if cached else (len(steps), 0))
    assert served.lookups == len(steps)  # each start looked up once, in the helper's call or not
    assert source.captured_graphs() == [(16, True), (32, True), (64, True)]
    # An id outside the table is raised by that call, and the next start is served as before.
    outside = token_ids(table, 1, 37)
    outside[0, 3] = table.num_rows
    source.start(torch.from_numpy(outside).to("cuda"))
    with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
        source.finish()
    ids = token_ids(table, 1, 38)
    source.start(torch.from_numpy(ids).to("cuda"))
    assert np.array_equal(bits(source.finish()), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_device_ids_wait_on_the_side_stream_for_a_copy_that_may_still_run(page_cache, loops):
    """When the last copy out of the pinned rows may still be running, a large request's ids and
    flags go on the side stream behind it: the helper thread waits for both flags. That copy is
    kept waiting here behind a long kernel on the caller's stream (the finish before it reads the
    device span after that kernel, and the copy waits for that read)."""
    table = page_cache
    if loops != "compiled":
        pytest.skip("only the compiled helper's thread waits on flags")
    source = EmbeddingSource(table, device="cuda", resident_bytes=3000 * table.row_bytes, max_ids=300 * 16)
    for tokens, seed in ((300, 11), (200, 12)):
        first, second, ids = (token_ids(table, tokens, seed + k) for k in (0, 20, 40))
        on_device = torch.from_numpy(ids).to("cuda")  # before the long kernel: this copy waits for none
        torch.cuda.synchronize()
        source.start(first)
        torch.cuda._sleep(200_000_000)  # the model's other work, still running at the next starts
        source.finish()
        source.start(second)  # its copy waits for the read of the first's rows, behind that work
        source.finish()
        before = source.stats()
        source.start(on_device)
        assert (source.stats() - before).behind_copy == 1
        values = source.finish()
        assert np.array_equal(bits(values), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_a_large_device_start_after_its_last_copy_ran_waits_for_the_ids_flag_alone(table, loops):
    """With the pinned rows' last copy done, the ids and one flag go on the caller's stream: the
    flag of that copy's end is neither written nor waited for."""
    if loops != "compiled":
        pytest.skip("only the compiled helper's thread waits on flags")
    source = EmbeddingSource(table, device="cuda", resident_bytes=500 * table.row_bytes, max_ids=200 * 16)
    for tokens, seed in ((200, 13), (150, 14)):
        ids = token_ids(table, tokens, seed)
        torch.cuda.synchronize()
        before = source.stats()
        source.start(torch.from_numpy(ids).to("cuda"))
        served = source.stats() - before
        assert (served.helper_lookups, served.behind_copy) == (1, 0)
        values = source.finish()
        assert np.array_equal(bits(values), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_an_eager_finish_of_a_large_request_replays_a_graph(table):
    """Past INLINE_IDS too, the index and decode are one graph replay per power-of-two size."""
    source = EmbeddingSource(table, device="cuda", resident_bytes=500 * table.row_bytes, max_ids=200 * 16)
    ids = token_ids(table, 100, 15)  # 1,600 ids: the graph of 2,048 positions
    poison(source)
    source.start(ids)
    values = source.finish()
    assert (2048, False) in source.captured_graphs()
    assert np.array_equal(bits(values), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_device_ids_are_refused_at_start_when_not_integers_or_too_many(table):
    source = EmbeddingSource(table, device="cuda", resident_bytes=0, max_ids=64)
    with pytest.raises(ValueError, match="65 row ids exceed this source's max_ids = 64"):
        source.start(torch.zeros(65, dtype=torch.int64, device="cuda"))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match="row ids must be integers"):
            source.start(torch.zeros(4, dtype=dtype, device="cuda"))
    ids = token_ids(table, 4, 8)
    source.start(torch.from_numpy(ids).cuda())
    assert np.array_equal(bits(source.finish()), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_a_small_device_start_finished_for_a_larger_count_copies_its_rows(table):
    """A small request's copy waits for finish's graph; a finish padded past INLINE_IDS, which runs
    no such graph, must still launch it."""
    source = EmbeddingSource(table, device="cuda", resident_bytes=0, max_ids=4096)
    ids = token_ids(table, 4, 9)
    poison(source)
    source.start(torch.from_numpy(ids).cuda())
    values = source.finish(count=source_module.INLINE_IDS + 16)
    assert np.array_equal(bits(values[:ids.size]), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_device_ids_errors_surface_at_finish_and_an_abandoned_start_is_dropped(table):
    source = EmbeddingSource(table, device="cuda", resident_bytes=0, max_ids=300 * 16)
    ids = token_ids(table, 300, 7)
    bad = ids.copy()
    bad[-1, -1] = table.num_rows
    source.start(torch.from_numpy(bad).cuda())
    with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
        source.finish()
    source.start(torch.from_numpy(bad).cuda())
    source.drop()
    source.start(torch.from_numpy(ids).cuda())
    assert np.array_equal(bits(source.finish()), expected_bits(table, ids))


@pytest.mark.parametrize("device", DEVICES)
def test_stats_count_each_position_once_by_the_tier_that_served_it(page_cache, device, loops):
    """stats(): every position of every start counted once, by the tier that served it; the rows
    read through the read path (or held by the host cache) are the disk positions' distinct rows
    (past DEDUP_MIN_ROWS)."""
    table = page_cache
    source = EmbeddingSource(table, device=device, resident_bytes=500 * table.row_bytes, max_ids=300 * 16)
    first = source.stats()
    for tokens, seed, split in ((3, 51, True), (300, 52, True), (40, 53, False)):
        ids = token_ids(table, tokens, seed)
        before = source.stats()
        if split:
            source.start(ids)
            source.finish()
        else:
            source(ids)
        served = source.stats() - before
        slots = table.slot_of(ids.reshape(-1))
        disk = slots[slots >= source.num_resident]
        assert (served.starts, served.ids, served.lookups) == (1, ids.size, 1)
        assert served.rows_resident == ids.size - len(disk)
        assert served.rows_page_cache + served.rows_disk == len(disk)
        if served.rows_disk:  # read through the read path, not copied from the page cache
            distinct = len(np.unique(disk)) if len(disk) > staging.DEDUP_MIN_ROWS else len(disk)
            # Each distinct row read, or found in the table's host cache (earlier starts read some).
            assert (served.rows_page_cache, served.rows_read + served.rows_host_cache) == (0, distinct)
        else:
            assert served.rows_read == served.rows_host_cache == 0
    served = source.stats() - first
    assert served.starts_from_device == served.helper_lookups == served.one_call_finishes == 0
    assert (served.graph_captures > 0) == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident_rows", [0, "all"])
def test_all_from_disk_and_all_resident(table, device, resident_rows):
    resident = table.num_rows if resident_rows == "all" else 0
    source = EmbeddingSource(table, device=device, resident_bytes=resident * table.row_bytes, max_ids=800)
    ids = token_ids(table, 50, 6)
    poison(source)
    assert np.array_equal(bits(source(ids)), expected_bits(table, ids))
    assert source.last_disk_rows == (0 if resident else ids.size)


@pytest.mark.parametrize("device", DEVICES)
def test_split_call_overlaps_other_work_and_pads_to_a_fixed_count(table, device):
    source = EmbeddingSource(table, device=device, resident_bytes=1000 * table.row_bytes, max_ids=200 * 16)
    ids = token_ids(table, 150, 7)  # past INLINE_IDS: the worker thread gathers
    poison(source)
    source.start(ids)
    # Other work of the model while the host gathers and copies.
    other = torch.randn(256, 256, device=device)
    for _ in range(20):
        other = torch.tanh(other @ other)
    values = source.finish(count=200 * 16)
    assert values.shape == (200 * 16, table.values_per_row)
    assert np.array_equal(bits(values[:150 * 16]), expected_bits(table, ids))
    assert not torch.isnan(other).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [3, 100])  # inline and on the worker thread
def test_errors_surface_at_finish_and_the_source_goes_on(table, device, tokens):
    source = EmbeddingSource(table, device=device, resident_bytes=1000 * table.row_bytes, max_ids=100 * 16)
    bad = token_ids(table, tokens, 8).reshape(-1)
    bad[-1] = table.num_rows
    source.start(bad)
    with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
        source.finish()
    with pytest.raises(RuntimeError, match="without a start"):
        source.finish()
    ids = token_ids(table, tokens, 9)
    poison(source)
    source.start(ids)
    assert np.array_equal(bits(source.finish()), expected_bits(table, ids))


@pytest.mark.parametrize("device", DEVICES)
def test_second_start_before_finish_is_refused(table, device):
    source = EmbeddingSource(table, device=device, resident_bytes=1000 * table.row_bytes, max_ids=64)
    first, second = token_ids(table, 4, 10), token_ids(table, 4, 11)
    source.start(first)
    with pytest.raises(RuntimeError, match="start\\(\\) called again before finish\\(\\)"):
        source.start(second)
    assert np.array_equal(bits(source.finish()), expected_bits(table, first))
    source.start(second)
    assert np.array_equal(bits(source.finish()), expected_bits(table, second))


def test_bad_arguments_are_refused_at_start(table):
    source = EmbeddingSource(table, device="cpu", resident_bytes=1000 * table.row_bytes, max_ids=64)
    with pytest.raises(ValueError, match="65 row ids exceed this source's max_ids = 64"):
        source.start(np.zeros(65, dtype=np.int64))
    with pytest.raises(TypeError, match="row ids must be integers"):
        source.start(np.zeros(4, dtype=np.float32))
    source.start(np.zeros(0, dtype=np.int64))
    assert source.finish().shape == (0, table.values_per_row)
    source.start(np.arange(4))
    with pytest.raises(ValueError, match="count 2 is smaller than the 4 ids"):
        source.finish(count=2)


def test_the_start_copies_the_callers_ids(table, monkeypatch):
    """The worker reads its own copy: the caller may refill its array right after start()."""
    monkeypatch.setattr(source_module, "INLINE_IDS", 0)
    source = EmbeddingSource(table, device="cpu", resident_bytes=1000 * table.row_bytes, max_ids=1600)
    ids = token_ids(table, 100, 12)
    given = ids.copy()
    source.start(given)
    given[...] = table.num_rows  # out of range: an error if the worker saw it
    assert np.array_equal(bits(source.finish()), expected_bits(table, ids))


def test_a_large_request_split_over_threads_equals_the_tables(page_cache, loops, monkeypatch):
    # Parts of 100 ids: 8 of them, the last ones with few or no disk positions.
    table = page_cache
    monkeypatch.setattr(staging, "LOOKUP_THREADS", 8)  # whatever this host's cores
    monkeypatch.setattr(staging, "LOOKUP_PART_IDS", 100)
    source = EmbeddingSource(table, device="cpu", resident_bytes=500 * table.row_bytes, max_ids=1600)
    ids = token_ids(table, 100, 21)
    ids[60:] = ids[0]  # the first row again: resident or not, every part past the fourth repeats it
    poison(source)
    assert np.array_equal(bits(source(ids)), expected_bits(table, ids))
    bad = ids.reshape(-1).copy()
    bad[777] = table.num_rows
    source.start(bad)
    with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
        source.finish()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 4,
                    reason="needs an affinity mask of at least 4 cores to narrow")
def test_lookup_threads_count_the_cores_the_process_may_run_on():
    """Three allowed cores leave one lookup thread (two are kept for the model's launches), however
    many cores the machine has."""
    code = ("import os; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:3]); "
            "from ple_prep.runtime.device import staging; print(staging.LOOKUP_THREADS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "1"


def test_close_and_reopen_serve_a_new_opening_of_the_file(table):
    source = EmbeddingSource(table, device="cpu", resident_bytes=100 * table.row_bytes, max_ids=640)
    ids = token_ids(table, 40, 20)
    source.close()
    with open_table(table.path) as again:
        source.reopen(again)
        poison(source)
        assert np.array_equal(bits(source(ids)), expected_bits(table, ids))
        source.close()
    source.reopen(table)


@pytest.mark.needs_cuda
def test_finish_replays_in_a_captured_cuda_graph_for_varying_counts(table, kernels):
    capacity = 96 * 16
    source = EmbeddingSource(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=capacity)
    warm = token_ids(table, 96, 13)
    source.start(warm)
    source.finish()
    source.start(warm)
    source.join()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    seen = torch.empty((capacity, table.values_per_row), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            # The PLE layer's share of a captured forward pass: finish, then a consumer.
            seen.copy_(source.finish(count=capacity))
    torch.cuda.current_stream().wait_stream(stream)
    for tokens, seed in ((96, 14), (1, 15), (40, 16), (96, 17)):
        ids = token_ids(table, tokens, seed)
        poison(source)
        seen.fill_(float("nan"))
        source.start(ids)
        source.join()
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(bits(seen[:tokens * 16]), expected_bits(table, ids))


@pytest.mark.needs_cuda
def test_capturing_finish_with_an_unjoined_start_is_refused(table):
    source = EmbeddingSource(table, device="cuda", resident_bytes=2000 * table.row_bytes, max_ids=64)
    source.start(token_ids(table, 4, 18))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="join\\(\\) the pending start"):
        with torch.cuda.graph(graph):
            source.finish(count=64)
