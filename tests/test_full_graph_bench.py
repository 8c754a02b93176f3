"""bench/vllm_full_graph.py's account of slow host calls: what else happened while each ran."""
from __future__ import annotations

import gc
import importlib.util
import mmap
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"),
                                reason="a thread's context switches are counted on Linux only")

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))  # the bench imports gpu_bench beside it
    try:
        spec = importlib.util.spec_from_file_location("vllm_full_graph", BENCH / "vllm_full_graph.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_slow_calls_are_put_down_to_blocking_preemption_faults_collection_or_where_the_time_went():
    watch = _bench().CallWatch()
    watch.collection_starts = [10.00015]
    slow, cpu = 0.0002, 150_000  # the last counter: the thread's CPU ns
    spans = [(1.0, 1.0 + slow, (4, 7, 3, 0), (5, 7, 3, 0)),       # a voluntary switch: it blocked
             (2.0, 2.0 + slow, (4, 7, 3, 0), (4, 8, 3, 0)),       # an involuntary one: preempted
             (3.0, 3.0 + slow, (4, 7, 3, 0), (4, 7, 4, 0)),       # a page fault
             (10.0, 10.0 + slow, (4, 7, 3, 0), (4, 7, 3, 0)),     # a collection started inside it
             (20.0, 20.0 + slow, (4, 7, 3, 0), (4, 7, 3, 20_000)),  # 0.02 ms on its CPU: kept off it
             (25.0, 25.0 + slow, (4, 7, 3, 0), (4, 7, 3, cpu)),   # 0.15 ms on its CPU: it ran that long
             (30.0, 30.00005, (4, 7, 3, 0), (9, 9, 9, 0))]        # under 0.1 ms: not counted
    causes = watch.causes(spans)
    assert causes.pop("overs") == [[0.2, 0.0, "blocked"], [0.2, 0.0, "preempted"], [0.2, 0.0, "faulted"],
                                   [0.2, 0.0, "collection"], [0.2, 0.02, "off_cpu"], [0.2, 0.15, "on_cpu"]]
    assert causes == {"blocked": 1, "preempted": 1, "faulted": 1, "collection": 1, "off_cpu": 1, "on_cpu": 1}


@pytest.mark.skipif(sys.version_info < (3, 12), reason="before Python 3.12 a collection runs inside the allocation "
                                                       "that sets it off, so none can reach the timed call")
def test_a_collection_the_counters_set_off_runs_before_the_timed_call_not_in_it():
    bench = _bench()
    watch, spans, kept = bench.CallWatch(), [], []
    threshold = gc.get_threshold()
    gc.set_threshold(50, *threshold[1:])
    try:
        with watch:
            for k in range(5000):
                kept.append(bench.CallWatch.counters())  # kept: each read leaves objects to the collector
                began = time.perf_counter()
                _timed_call(k)
                spans.append((began, time.perf_counter()))
    finally:
        gc.set_threshold(*threshold)
    assert len(watch.collection_starts) > 50
    assert not [at for at in watch.collection_starts for began, ended in spans if began <= at <= ended]


def _timed_call(k: int) -> int:
    return k


def test_block_ratios_pair_the_blocks_that_ran_next_to_each_other():
    # The GPU twice as slow from the second pair of blocks on (the last block a short one): each pair
    # still says 1.01x.
    mine = [1.01, 1.01, 2.02, 2.02, 2.02]
    theirs = [1.0, 1.0, 2.0, 2.0, 2.0]
    bench = _bench()
    assert bench.block_ratios(mine, theirs, 2) == {"blocks": 3, "median": 1.01, "p90": 1.01, "max": 1.01}
    uneven = bench.block_ratios([1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 2.0, 2.0], 2)
    assert uneven == {"blocks": 2, "median": 1.25, "p90": 1.45, "max": 1.5}


def test_interleaved_sides_alternate_step_by_step_and_each_keeps_its_own_times():
    clock, ran = [0.0], []

    class Event:
        def record(self):
            self.at = clock[0]

        def elapsed_time(self, later):
            return later.at - self.at

    class Side:
        def __init__(self, name, ms):
            self.graph = self
            self.name, self.ms = name, ms

        def replay(self):
            ran.append(self.name)
            clock[0] += self.ms * (1 + len(ran) / 10)  # the GPU slowing down step by step

    synchronized = []
    mine, theirs = _bench().interleave(Side("a", 1.01), Side("b", 1.0), 5, group=2, event=Event,
                                       synchronize=lambda: synchronized.append(len(ran)))
    # Pairs ab, ba | ba, ab | ab: each group's first pair turns too; a synchronize ends each group.
    assert "".join(ran) == "abba" + "baab" + "ab"
    assert synchronized == [4, 8, 10]
    assert len(mine) == len(theirs) == 5
    assert mine[0] == pytest.approx(1.01 * 1.1) and theirs[0] == pytest.approx(1.0 * 1.2)
    assert mine[1] == pytest.approx(1.01 * 1.4) and theirs[1] == pytest.approx(1.0 * 1.3)
    pairs = _bench().pair_ratios([1.01, 2.02, 3.0], [1.0, 2.0, 2.0])
    assert pairs == {"pairs": 3, "median": 1.01, "p90": 1.402}


def test_step_times_are_saved_by_section_and_side_in_the_order_they_ran(tmp_path):
    path = tmp_path / "steps.npz"
    _bench().save_step_times(path, {"decode": ([1.5, 1.6], [1.4, 1.7]), "chunk": ([3.3], [3.2])})
    with np.load(path, allow_pickle=False) as saved:
        assert sorted(saved.files) == ["chunk_full_graph_lookup", "chunk_resident_table",
                                       "decode_full_graph_lookup", "decode_resident_table"]
        assert saved["decode_full_graph_lookup"].tolist() == [1.5, 1.6]
        assert saved["decode_resident_table"].tolist() == [1.4, 1.7]
        assert saved["chunk_resident_table"].tolist() == [3.2]


def test_a_call_that_computes_counts_its_cpu_time():
    bench = _bench()
    before, began = bench.CallWatch.counters(), time.perf_counter()
    until = time.thread_time_ns() + 2_000_000
    while time.thread_time_ns() < until:  # 2 ms of this thread's CPU
        pass
    after, ended = bench.CallWatch.counters(), time.perf_counter()
    # Its switches and faults taken as none (a busy machine may preempt or fault it): the CPU time decides.
    spun = (began, ended, before, before[:3] + after[3:])
    wall_ms, cpu_ms, cause = bench.CallWatch().causes([spun])["overs"][0]
    assert cpu_ms >= 2.0 and wall_ms >= 2.0 and cause == "on_cpu"


def test_a_call_that_sleeps_counts_as_blocked_and_a_collection_is_seen():
    bench = _bench()
    with bench.CallWatch() as watch:
        before, began = watch.counters(), time.perf_counter()
        time.sleep(0.002)
        slept = (began, time.perf_counter(), before, watch.counters())
        before, began = watch.counters(), time.perf_counter()
        gc.collect()
        collected = (began, time.perf_counter(), before, watch.counters())
    assert watch.causes([slept])["blocked"] == 1
    assert any(collected[0] <= at <= collected[1] for at in watch.collection_starts)


def test_a_call_that_touches_fresh_memory_counts_its_page_faults():
    bench = _bench()
    fresh = mmap.mmap(-1, 64 << 20)  # anonymous: no page is mapped in before it is written
    before = bench.CallWatch.counters()
    for offset in range(0, len(fresh), mmap.PAGESIZE):
        fresh[offset] = 1
    after = bench.CallWatch.counters()
    fresh.close()
    assert after[2] > before[2]  # once a page, or once a huge page where the kernel gives those


@pytest.mark.parametrize("tokens", ["4,x", "0,8", ""])
def test_batch_sizes_other_than_token_counts_are_refused(tokens, tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "vllm_full_graph.py"), str(tmp_path / "ple.bin"),
                           "--batch-tokens", tokens], capture_output=True, text=True)
    assert done.returncode == 2
    assert "error: argument --batch-tokens" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


def test_late_steps_are_put_down_to_what_ran_before_their_block():
    bench = _bench()

    class Lookup:  # the first side's lookup: one step of each of its blocks late
        late = 0

        def stats(self):
            return {"late": self.late}

    lookup = Lookup()

    class Side:
        def __init__(self, first):
            self.first = first

        def replay_timed(self, count):
            lookup.late += self.first
            return [1.0] * count

    mine, theirs, late_after = bench.alternate(Side(1), Side(0), 500, 100, late=lookup)
    # Turns (first, second), (second, first), ...: the first side's blocks come after nothing once,
    # then after the other side's block and after its own in turn.
    assert late_after == {"nothing": 1, "the_other": 2, "itself": 2}
    assert len(mine) == len(theirs) == 500
