"""A proxy decode step held by ONE CUDA graph, the PLE lookup inside it (StepLookup), against the same graph
gathering from a fully GPU-resident table; cold steps against today's eager path; no host wait; faults.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000
    python bench/synthetic.py /tmp/small.bin --base 100000
    python bench/vllm_full_graph.py /tmp/ple.bin --faults-table /tmp/small.bin      # on a GPU

Each step's graph holds what vLLM's decode graph holds around the PLE layer: the ids "kernel" (the
next step's real-text row ids picked on the device from a pool by a device counter, so every replay
has new ids and no host work), `StepLookup.start`, at least `--layer-ms` of bf16 matrix products
standing for decoder layer 0, `StepLookup.finish`, and a consumer (a product of the values and a
copy of them into a history row, checked bit for bit against `Table.values` after the loop). The
reference graph is the same with the lookup replaced by the same decode kernel over a table held
whole on the GPU (its index: each id's file slot). Steps are timed by CUDA events around each
replay, the two graphs alternating in blocks; p50 and p90 of each and their ratios, and the ratio
of each pair of blocks run next to each other (`block_ratios`). With `--interleave` the warm
section's two graphs alternate step by step instead (`interleave`): the GPU's clocks drift by
several percent over a block of steps, so there the pooled percentiles compare steps that ran under
the same clocks, and `pair_ratios` gives each pair's ratio.

- warm: every page of the file in the page cache (`read_path="mapped"`): decode steps (1 token, 16
  rows, tokens spread over the text) and 4,096-token chunks (65,536 rows) with at least
  `--chunk-layer-ms` of other work;
- cold: `read_path="direct"` without the host cache (O_DIRECT: every disk-tier row read from the
  drive, every time; StepLookup's thread reads them itself, runtime/native/disk_reads.c), one
  step at a time (the host clock around a replay and a synchronize), alternating with today's eager
  path (`EmbeddingSource`: start with the device ids, the same other work, finish) on the same ids;
  then the same with each side's table keeping open_table's default host cache (cold_host_cache);
- host alone (`--sections host`): the warm section's host protocols (below) and nothing else;
- batched (`--sections batched`): warm decode steps of `--batch-tokens` tokens each, against the
  resident table's graph as in warm;
- exact: warm, cold and mixed (half the pages cached) steps with every buffer poisoned before each;
- host: how long `start` and `finish` hold the host while the GPU has >= 50 ms of queued work, and
  a replay's launch: each call alone after a wait, calls back to back in blocks, and calls with
  the GPU never drained and the host never waiting, as vLLM's host thread runs ahead of the device
  (host_section);
- faults (`--faults-table`, a small table): an id outside the table, and an I/O error (a truncated
  copy read with O_DIRECT), each during FULL replay: the step's time, its values, the raised cause,
  and the next step.
The driver's launch queues are sized as the vLLM plugin sizes them when it serves a table
(`scale_launch_queues`: four times the default unless CUDA_SCALE_LAUNCH_QUEUES is set), or with
`--driver-queues` as the environment has them; the report says which (`launch_queues`).
Prints JSON (also written to --out).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_bench import CHUNK_TOKENS, OtherWork, bf16_bits  # noqa: E402  (bench/, beside this file)
from python_busy import PythonBusy  # noqa: E402

from ple_prep.format.manifest import manifest_path  # noqa: E402
from ple_prep.integrations.vllm.backend import PrefetchedRows  # noqa: E402
from ple_prep.integrations.vllm.environment import LAUNCH_QUEUES_VARIABLE, TABLE_VARIABLE, scale_launch_queues  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.device import EmbeddingSource, StepLookup  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

# torch.cuda._sleep's cycles for about 50-60 ms of queued GPU work on an H200 (measured each run).
SLEEP_CYCLES = 100_000_000
# The cold section's two sides, as its report names them.
COLD_SIDES = ("full_graph", "eager")


def print_report(report: dict, out: Path | None) -> None:
    """The report as JSON on stdout, and into `out` where given."""
    text = json.dumps(report, indent=1)
    if out is not None:
        out.write_text(text)
    print(text)


def percentiles(ms: list[float]) -> dict:
    values = np.array(ms)
    return {"n": len(values), "p50_ms": round(float(np.percentile(values, 50)), 4),
            "p90_ms": round(float(np.percentile(values, 90)), 4), "p99_ms": round(float(np.percentile(values, 99)), 4),
            "max_ms": round(float(values.max()), 4)}


def side_by_side(mine: list[float], theirs: list[float], names=("full_graph_lookup", "resident_table")) -> dict:
    """Two sides' step times (ms) as percentiles under `names`, with the p50 and p90 ratios of the first
    over the second."""
    return {names[0]: percentiles(mine), names[1]: percentiles(theirs),
            "p50_ratio": round(float(np.percentile(mine, 50) / np.percentile(theirs, 50)), 4),
            "p90_ratio": round(float(np.percentile(mine, 90) / np.percentile(theirs, 90)), 4)}


def block_ratios(mine: list[float], theirs: list[float], block: int) -> dict:
    """The ratio of the two sides' medians over each pair of blocks `alternate` ran next to each other:
    unlike the pooled percentiles, a drift of the GPU's speed over the run (its clocks) moves both
    sides of a pair alike."""
    ratios = [float(np.median(mine[i:i + block]) / np.median(theirs[i:i + block])) for i in range(0, len(mine), block)]
    return {"blocks": len(ratios), "median": round(float(np.median(ratios)), 4),
            "p90": round(float(np.percentile(ratios, 90)), 4), "max": round(max(ratios), 4)}


def save_step_times(path: Path, step_ms: dict[str, tuple[list[float], list[float]]]) -> None:
    """Each section's two sides' step times (ms) into `path` (.npz): `<section>_full_graph_lookup` and
    `<section>_resident_table`."""
    np.savez(path, **{f"{name}_{side}": np.array(times[k]) for name, times in step_ms.items()
                      for k, side in enumerate(("full_graph_lookup", "resident_table"))})


class ProxyStep:
    """One step as one CUDA graph: ids from a device pool, `lookup`, other work, a consumer."""

    def __init__(self, pool: torch.Tensor, other: OtherWork, lookup_start, lookup_finish, values_shape):
        self.pool = pool
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.ids = torch.empty(pool.shape[1:], dtype=pool.dtype, device="cuda")
        self.weight = torch.full(values_shape, 0.5, dtype=torch.bfloat16, device="cuda")
        self.product = torch.empty(values_shape, dtype=torch.bfloat16, device="cuda")
        self.history = torch.empty((len(pool), values_shape[0] * values_shape[1]), dtype=torch.bfloat16,
                                   device="cuda")
        self.other, self.lookup_start, self.lookup_finish = other, lookup_start, lookup_finish
        self.body()  # eager once: compiles the kernels, serves a first step
        torch.cuda.synchronize()
        self.counter.zero_()
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(self.graph):
            self.body()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def body(self) -> None:
        torch.index_select(self.pool, 0, self.counter, out=self.ids.unsqueeze(0))
        self.lookup_start(self.ids)
        self.other()
        values = self.lookup_finish()
        torch.mul(values, self.weight, out=self.product)
        self.history.index_copy_(0, self.counter, values.reshape(1, -1))
        self.counter.add_(1)
        self.counter.remainder_(len(self.pool))

    def replay_timed(self, count: int) -> list[float]:
        """`count` replays queued back to back, each between two events: GPU ms per step."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        marks[0].record()
        for k in range(count):
            self.graph.replay()
            marks[k + 1].record()
        torch.cuda.synchronize()
        return [marks[k].elapsed_time(marks[k + 1]) for k in range(count)]


def exact_history(table, proxy: ProxyStep, host_ids: list[np.ndarray], upto: int) -> bool:
    got = proxy.history[:upto].cpu().view(torch.int16).numpy().view(np.uint16)
    want = np.stack([bf16_bits(table, ids).reshape(-1) for ids in host_ids[:upto]])
    return bool(np.array_equal(got, want))


def lookup_graph(lookup: StepLookup, pool: torch.Tensor, other: OtherWork) -> ProxyStep:
    size = pool.shape[1]
    return ProxyStep(pool, other, lambda ids: lookup.start(ids, finish_in_same_graph=True), lambda: lookup.finish(size),
                     (size, lookup.table.values_per_row))


def resident_graph(full: EmbeddingSource, slot_pool: torch.Tensor, other: OtherWork) -> ProxyStep:
    size = slot_pool.shape[1]
    out = torch.empty((size, full.table.values_per_row), dtype=torch.bfloat16, device="cuda")
    index = torch.empty(size, dtype=torch.int32, device="cuda")

    def start(slots):
        index.copy_(slots)

    def finish():
        full._index_and_decode.fused(full.buffers.tiers, index, out)
        return out

    return ProxyStep(slot_pool, other, start, finish, (size, full.table.values_per_row))


def alternate(first: ProxyStep, second: ProxyStep, steps: int, block: int,
              late: StepLookup | None = None) -> tuple[list[float], list[float], dict[str, int] | None]:
    """Each side's GPU ms per step, `steps` replays a side in blocks of `block`, the order swapped
    every turn, and with `late` (the first side's lookup; else None) that side's late steps by what
    ran before their block (nothing, its own block, or the other side's, during which the service
    thread idled)."""
    times: tuple[list[float], list[float]] = ([], [])
    late_after = {"nothing": 0, "itself": 0, "the_other": 0}
    done, turn, previous = 0, 0, "nothing"
    while done < steps:
        count = min(block, steps - done)
        order = (0, 1) if turn % 2 == 0 else (1, 0)
        for side in order:
            before = late.stats()["late"] if late is not None and side == 0 else 0
            times[side].extend((first, second)[side].replay_timed(count))
            if late is not None and side == 0:  # replay_timed ends with a synchronize: every step counted
                late_after[previous] += late.stats()["late"] - before
            previous = "itself" if side == 0 else "the_other"
        done += count
        turn += 1
    return (*times, late_after if late is not None else None)


def interleave(first: ProxyStep, second: ProxyStep, steps: int, group: int = 250, *, event=None,
               synchronize=None) -> tuple[list[float], list[float]]:
    """Each side's GPU ms per step, the two graphs replayed step by step (first then second, then
    second then first, and so on), queued back to back with an event between replays and a
    synchronize every `group` pairs (whose first pair's order alternates too). `event` and
    `synchronize` default to CUDA's."""
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    synchronize = synchronize or torch.cuda.synchronize
    sides, times = (first, second), ([], [])
    for begin in range(0, steps, group):
        count = min(group, steps - begin)
        orders = [(0, 1) if (begin // group + k) % 2 == 0 else (1, 0) for k in range(count)]
        marks = [event() for _ in range(2 * count + 1)]
        marks[0].record()
        for k, order in enumerate(orders):
            for j, side in enumerate(order):
                sides[side].graph.replay()
                marks[2 * k + j + 1].record()
        synchronize()
        for k, order in enumerate(orders):
            for j, side in enumerate(order):
                times[side].append(marks[2 * k + j].elapsed_time(marks[2 * k + j + 1]))
    return times


def pair_ratios(mine: list[float], theirs: list[float]) -> dict:
    """The ratios of the steps `interleave` ran next to each other (block_ratios of one-step blocks):
    their median and p90."""
    ratios = block_ratios(mine, theirs, 1)
    return {"pairs": ratios["blocks"], "median": ratios["median"], "p90": ratios["p90"]}


def poison(lookup: StepLookup) -> None:
    buffers = lookup.buffers
    lookup.output.fill_(float("nan"))
    buffers.tiers[lookup.num_resident + 1:].fill_(0xFF)
    buffers.host_rows[1:].fill(0xFF)
    lookup.host_ids.fill(-1)


def exact_replays(table, lookup: StepLookup, proxy: ProxyStep, host_ids: list[np.ndarray]) -> bool:
    """Replays one at a time with every buffer poisoned before each; each step's values checked."""
    proxy.counter.zero_()
    ok = True
    for ids in host_ids:
        poison(lookup)
        proxy.graph.replay()
        torch.cuda.synchronize()
        got = lookup.output[:ids.size].cpu().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        ok &= bool(np.array_equal(got, bf16_bits(table, ids).reshape(-1)))
    lookup.check()
    return ok


def pool_of(host_ids: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack([ids.reshape(-1) for ids in host_ids])).cuda()


def slot_pool_of(table, host_ids: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack([table.slot_of(ids.reshape(-1)) for ids in host_ids]).astype(np.int32)).cuda()


def cold_section(path: Path, resident: int, decode: list[np.ndarray], chunks: list[np.ndarray], other: OtherWork,
                 steps: int, chunk_steps: int, host_cache_bytes: int | None) -> dict:
    """Cold (O_DIRECT) FULL-graph steps against today's eager path on the same ids, one at a time.
    Each side opens the table itself: with a host cache (None: open_table's default budget) each
    has its own, which keeps what that side read before and never what the other read.
    `p50_ms_by_predecessor`: each side's steps by the side that ran just before."""
    options = {"read_path": "direct"} | ({} if host_cache_bytes is None else {"host_cache_bytes": host_cache_bytes})
    table, eager_table = open_table(path, **options), open_table(path, **options)
    evict(path)
    lookup = StepLookup(table, device="cuda", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
    eager = EmbeddingSource(eager_table, device="cuda", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
    report = {}
    for name, requests in (("decode", decode[:steps]), ("chunk", chunks[:chunk_steps])):
        before = lookup.stats()
        proxy = lookup_graph(lookup, pool_of(requests), other)
        ids_device = [torch.from_numpy(ids.reshape(-1).copy()).cuda() for ids in requests]
        graph_s, eager_s, after = [], [], {}
        previous = None
        for k, ids in enumerate(ids_device):
            for side in ((0, 1) if k % 2 == 0 else (1, 0)):  # the graph first in even pairs
                torch.cuda.synchronize()
                began = time.perf_counter()
                if side == 0:
                    proxy.graph.replay()
                else:
                    eager.start(ids)
                    other()
                    eager.finish()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - began) * 1e3
                (graph_s if side == 0 else eager_s).append(ms)
                if previous is not None:
                    after.setdefault(f"{COLD_SIDES[side]}_after_{COLD_SIDES[previous]}", []).append(ms)
                previous = side
        lookup.check()
        stats = {key: value - before[key] for key, value in lookup.stats().items()}
        report[name] = {"full_graph": percentiles(graph_s), "eager": percentiles(eager_s),
                        "p50_ratio": round(float(np.median(graph_s) / np.median(eager_s)), 4),
                        # Each id set read by both sides back to back: the disk's drift cancels in a pair.
                        # Which side reads a set second moves its time, either way from run to run (the
                        # drive's own cache), so each side's times have two modes and its p50 falls between.
                        "pair_ratio_median": round(float(np.median(np.divide(graph_s, eager_s))), 4),
                        # Half the pairs read the graph first, half the eager path: in the geometric
                        # mean of their ratios the order's effect cancels, as in the same-place ratios.
                        "pair_ratio_geomean": round(float(np.exp(np.mean(np.log(np.divide(graph_s, eager_s))))), 4),
                        "ratio_read_first_second": [
                            round(float(np.median(graph_s[k::2]) / np.median(eager_s[1 - k::2])), 4) for k in (0, 1)],
                        "total_ratio": round(float(np.sum(graph_s) / np.sum(eager_s)), 4),
                        "p50_ms_first_second": {
                            "full_graph": [round(float(np.median(graph_s[k::2])), 3) for k in (0, 1)],
                            "eager": [round(float(np.median(eager_s[k::2])), 3) for k in (1, 0)]},
                        "p50_ms_by_predecessor": {key: round(float(np.median(ms)), 3)
                                                  for key, ms in sorted(after.items())},
                        "bit_exact": exact_history(table, proxy, requests, len(requests)),
                        "pages_read": stats["pages_read"],
                        "disk_positions_fraction": round(stats["rows_disk"] / stats["ids"], 3)}
    report["exact_poisoned"] = exact_replays(table, lookup, lookup_graph(lookup, pool_of(decode[:100]), other),
                                             decode[:100])
    # Cold steps queued back to back while a Python thread holds the GIL: the service thread reads
    # without it, so the device never waits for a thread that waits for the GIL.
    requests = decode[steps:2 * steps]
    proxy = lookup_graph(lookup, pool_of(requests), other)
    before = lookup.stats()
    with PythonBusy():
        began = time.perf_counter()
        queued = proxy.replay_timed(len(requests))
        seconds = time.perf_counter() - began
    report["decode_queued_busy_gil"] = {"steps": percentiles(queued), "seconds": round(seconds, 2),
                                        "late_steps": lookup.stats()["late"] - before["late"],
                                        "bit_exact": exact_history(table, proxy, requests, len(requests))}
    lookup.close()
    eager.close()
    table.close()
    eager_table.close()
    return report


def warm_section(path: Path, resident: int, decode: list[np.ndarray], chunks: list[np.ndarray],
                 other: OtherWork, chunk_other: OtherWork, args) -> dict:
    """The warm steps side by side; with `args.step_times`, each side's step times (ms, in the order
    they ran; block k of one side ran next to block k of the other, or step k with `args.interleave`)
    saved there as .npz, to look at the bands behind a ratio."""
    table = warm_mapped_table(path)
    step_ms = {}
    lookup = StepLookup(table, device="cuda", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
    began = time.perf_counter()
    full = EmbeddingSource(table, device="cuda", resident_bytes=table.num_rows * table.row_bytes, max_ids=16)
    report = {"resident_table_load_s": round(time.perf_counter() - began, 1),
              "fused_kernel": full.kernel == "fused"}
    for name, requests, work, steps, block in (
            ("decode", decode, other, args.decode_steps, 100),
            ("chunk", chunks, chunk_other, args.chunk_steps, 16)):
        ours = lookup_graph(lookup, pool_of(requests), work)
        reference = resident_graph(full, slot_pool_of(table, requests), work)
        before = lookup.stats()
        if args.interleave:
            mine, theirs = interleave(ours, reference, steps)
            late_after, pairs = None, {"pair_ratios": pair_ratios(mine, theirs)}
        else:
            mine, theirs, late_after = alternate(ours, reference, steps, block, late=lookup)
            pairs = {"block_ratios": block_ratios(mine, theirs, block)}
        step_ms[name] = (mine, theirs)
        lookup.check()
        after = lookup.stats()
        checked = min(len(requests), steps, 8 if name == "chunk" else steps)
        report[name] = {
            "steps": steps, "distinct_id_sets": len(requests), "other_work_ms": round(work.ms, 3),
            **side_by_side(mine, theirs), **pairs,
            "bit_exact": exact_history(table, ours, requests, checked)
            and exact_history(table, reference, requests, checked),
            "late_steps": after["late"] - before["late"], "late_steps_after": late_after,
            # The thread's own time on its late steps: far below the other work, the thread saw
            # their requests late (a wake), not slow at serving them.
            "late_host_us": round((after["late_host_ns"] - before["late_host_ns"]) / 1e3, 1),
            "disk_positions_fraction": round((after["rows_page_cache"] - before["rows_page_cache"])
                                             / max(1, after["ids"] - before["ids"]), 3),
            "failed_steps": after["failed"] - before["failed"],
            "host_us_per_step": round((after["host_ns"] - before["host_ns"]) / 1e3 / max(1, after["starts"]
                                                                                       - before["starts"]), 1)}
    if args.step_times is not None:
        save_step_times(args.step_times, step_ms)
    if args.steps_only:
        lookup.close()
        del full
        table.close()
        return report
    ours = lookup_graph(lookup, pool_of(decode[:300]), other)
    reference = resident_graph(full, slot_pool_of(table, decode[:300]), other)
    before = lookup.stats()
    with PythonBusy():
        mine, theirs, _ = alternate(ours, reference, 300, 100)
    report["decode_busy_gil"] = {**side_by_side(mine, theirs), "late_steps": lookup.stats()["late"] - before["late"]}
    report["exact_poisoned_warm"] = exact_replays(table, lookup, lookup_graph(lookup, pool_of(decode[:200]), other),
                                                  decode[:200])
    chunk_proxy = lookup_graph(lookup, pool_of(chunks[:4]), chunk_other)
    report["exact_poisoned_warm_chunk"] = exact_replays(table, lookup, chunk_proxy, chunks[:4])
    report["host"] = host_of_both(lookup, table, resident, decode, chunks, chunk_proxy)
    lookup.close()
    del full
    table.close()
    # Mixed: half the steps' pages cached (their rows read once through the mapping), half not.
    evict(path)
    table = open_table(path, read_path="mapped", host_cache_bytes=0)
    lookup = StepLookup(table, device="cuda", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
    mixed = decode[200:400]
    for ids in mixed[::2]:
        table.gather(ids.reshape(-1))
    report["exact_poisoned_mixed"] = exact_replays(table, lookup, lookup_graph(lookup, pool_of(mixed), other), mixed)
    report["mixed_stats"] = lookup.stats()
    lookup.close()
    table.close()
    return report


def warm_mapped_table(path: Path):
    """The table read once through (every page cached), opened on the mapped path without a host cache."""
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    return open_table(path, read_path="mapped", host_cache_bytes=0)


def host_of_both(lookup: StepLookup, table, resident: int, decode: list[np.ndarray], chunks: list[np.ndarray],
                 chunk_proxy: ProxyStep, plugin: dict | None = None) -> dict:
    """host_section for `lookup` (StepLookup), then for the plugin's PrefetchedRows on the same table
    (`plugin`: its report where it ran before)."""
    with frozen_heap():
        report = host_section(lookup, table, decode, chunks, chunk_proxy)
        report["plugin"] = plugin or plugin_host_section(table, resident, decode, chunks)
    return report


def plugin_host_section(table, resident: int, decode: list[np.ndarray], chunks: list[np.ndarray]) -> dict:
    """host_section for the plugin's PrefetchedRows, closed after."""
    rows = PrefetchedRows(table, device="cuda", resident_bytes=resident, max_tokens=CHUNK_TOKENS, heads=16)
    report = host_section(rows, table, decode, chunks, None, reshape=True)
    rows.close()
    return report


def host_only_section(path: Path, resident: int, decode: list[np.ndarray], chunks: list[np.ndarray],
                      chunk_other: OtherWork, plugin_first: bool) -> dict:
    """The warm section's host protocols alone (`--sections host`), on the same warm table: short
    enough to run several times in one call, alternating a setting of the driver's. `plugin_first`:
    the plugin's protocols run first, before the StepLookup and its graph exist, where they
    otherwise run after StepLookup's (as in the warm section), so that an effect of the order shows."""
    table = warm_mapped_table(path)
    plugin = None
    if plugin_first:
        with frozen_heap():
            plugin = plugin_host_section(table, resident, decode, chunks)
    lookup = StepLookup(table, device="cuda", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
    report = host_of_both(lookup, table, resident, decode, chunks,
                          lookup_graph(lookup, pool_of(chunks[:4]), chunk_other), plugin)
    lookup.close()
    table.close()
    if plugin_first:
        report["plugin_first"] = True
    return report


def batched_section(path: Path, resident: int, row_ids: np.ndarray, other: OtherWork, token_counts: list[int],
                    steps: int) -> dict:
    """Warm steps of the sizes of a decode batch, `tokens` tokens each (tokens x 16 ids), the
    FULL-graph lookup against the resident table's graph as in the warm section. A step's tokens are
    consecutive in the text, each step at a place of its own, the places spread over the whole text.
    Up to 4 tokens a step goes through the step kernels, more through the side stream and the copy
    engine."""
    table = warm_mapped_table(path)
    lookup = StepLookup(table, device="cuda", resident_bytes=resident, max_ids=max(token_counts) * 16)
    full = EmbeddingSource(table, device="cuda", resident_bytes=table.num_rows * table.row_bytes, max_ids=16)
    report = {"other_work_ms": round(other.ms, 3)}
    for tokens in token_counts:
        # Each step a run of `tokens` consecutive tokens, the runs spread over the text.
        places = np.linspace(0, len(row_ids) - 1, steps * tokens).astype(np.int64).reshape(steps, tokens)
        requests = [row_ids[picks] for picks in places]
        ours = lookup_graph(lookup, pool_of(requests), other)
        reference = resident_graph(full, slot_pool_of(table, requests), other)
        before = lookup.stats()
        mine, theirs, _ = alternate(ours, reference, steps, 100)
        lookup.check()
        after = lookup.stats()
        checked = min(steps, 200)
        report[f"{tokens}_tokens"] = {
            "ids": tokens * 16, "through_kernels": tokens * 16 <= lookup.kernel_max_ids,
            **side_by_side(mine, theirs), "block_ratios": block_ratios(mine, theirs, 100),
            "bit_exact": exact_history(table, ours, requests, checked) and exact_history(table, reference, requests,
                                                                                         checked),
            "late_steps": after["late"] - before["late"]}
    lookup.close()
    del full
    table.close()
    return report


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap frozen inside, as vLLM's engine core freezes it once it has started (the oldest
    generation's collections then skip it), and unfrozen after, so that what is freed later is
    collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def queued_sleep_ms() -> float:
    """GPU ms of `torch.cuda._sleep(SLEEP_CYCLES)`, by events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end)


def poll_stream() -> None:
    """Wait for the current stream's work by polling it from Python (the thread never leaves the CPU)."""
    stream = torch.cuda.current_stream()
    while not stream.query():
        pass


def after_sync_reference(calls: int, sleep_ms: float) -> dict:
    """Host ms of the cheapest torch calls at the moment `after_sync` times start, each the first call
    after one sleep kernel's launch (the floor any call pays there): `torch.cuda.current_stream()` (no
    driver call) and one small kernel's launch; after three ways of waiting as long: the device's
    synchronize (`after_sync`'s), a host sleep, and `poll_stream`."""
    scratch = torch.zeros(16, device="cuda")
    waits = {"synchronize": torch.cuda.synchronize, "host_sleep": lambda: time.sleep(sleep_ms / 1e3),
             "python_poll": poll_stream}
    report = {}
    for wait_name, wait in waits.items():
        for name, call in (("torch_current_stream", torch.cuda.current_stream),
                           ("kernel_launch", lambda: scratch.add_(1))):
            times = []
            for _ in range(calls):
                torch.cuda._sleep(SLEEP_CYCLES)
                wait()
                torch.cuda._sleep(SLEEP_CYCLES)
                began = time.perf_counter()
                call()
                times.append((time.perf_counter() - began) * 1e3)
            torch.cuda.synchronize()
            report[f"{name}_after_{wait_name}"] = percentiles(times)
    return report


def quiet_launch_reference(calls: int, sleep_ms: float) -> dict:
    """Host ms of one small kernel's launch (torch's own) after `quiet` ms in which the host queued
    nothing, the GPU busy all the while and the host spinning on the clock: what any first call
    after a quiet spell pays on the machine, whatever it launches."""
    scratch = torch.zeros(16, device="cuda")
    report = {}
    for quiet_ms in (0.1, 1.0, 5.0, 20.0, 50.0):
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            for _ in range(int(quiet_ms // sleep_ms) + 2):
                torch.cuda._sleep(SLEEP_CYCLES)
            busy_watching(quiet_ms)
            began = time.perf_counter()
            scratch.add_(1)
            times.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        report[f"after_{quiet_ms:g}_ms_quiet"] = percentiles(times)
    return report


def busy_watching(ms: float) -> int:
    """Python work for `ms` (a loop on the clock), as vLLM's host has its own between two steps,
    counting the host's own stalls: the times its clock jumped by more than 0.1 ms between two reads
    (the thread preempted, an interrupt, the hypervisor), with no call between."""
    stalls, last = 0, time.perf_counter()
    until = last + ms / 1e3
    while last < until:
        now = time.perf_counter()
        stalls += now - last > 1e-4
        last = now
    return stalls


def busy_launching(ms: float, scratch: torch.Tensor) -> tuple[float, int]:
    """`busy_watching` with a small kernel launched every 0.1 ms, standing for the kernels a step of
    an eager or PIECEWISE vLLM launches between two PLE calls (the other layers, the sampler, the
    next step's inputs and the n-gram hash, launched far more often than this): the host ms of the
    last launch, which comes right before the caller's next call, and the stalls seen."""
    until, stalls = time.perf_counter() + ms / 1e3, 0
    while True:
        began = time.perf_counter()
        scratch.add_(1)
        if began + 1e-4 >= until:
            return (time.perf_counter() - began) * 1e3, stalls
        stalls += busy_watching(0.1)


def run_pending_collection() -> None:
    """Nothing: its entry is where the interpreter runs a garbage collection already due (CallWatch.counters)."""


class CallWatch:
    """What else happened while a timed call ran: the thread's context switches (getrusage:
    involuntary, the thread preempted; voluntary, it blocked), its page faults (minor and major:
    memory the kernel had to map in), Python's garbage collections, and the thread's CPU time (a
    call over 0.1 ms with none of those either ran that long or was kept off its CPU without a
    context switch: the hypervisor or interrupts)."""

    def __init__(self):
        self.collection_starts: list[float] = []

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collection_starts.append(time.perf_counter())

    def __enter__(self):
        gc.callbacks.append(self._collected)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._collected)

    @staticmethod
    def counters() -> tuple[int, int, int, int]:
        """This thread's voluntary and involuntary context switches, page faults and CPU ns so far."""
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        counted = usage.ru_nvcsw, usage.ru_nivcsw, usage.ru_minflt + usage.ru_majflt, time.thread_time_ns()
        # From Python 3.12 a collection that an allocation sets off runs at the next Python call's entry:
        # one that these counters' objects set off would run in the timed call that follows them.
        run_pending_collection()
        return counted

    def causes(self, spans: list[tuple[float, float, tuple[int, ...], tuple[int, ...]]]) -> dict:
        """Of calls timed over 0.1 ms (began, ended, counters before and after, each), how many
        blocked, were preempted, faulted, ran a collection, or none of those: then `off_cpu` where
        the thread's CPU time over the call (its counters' reads included) was under 0.1 ms, else
        `on_cpu`; and the first 20 such calls' wall and CPU ms (`overs`)."""
        counts = {"blocked": 0, "preempted": 0, "faulted": 0, "collection": 0, "off_cpu": 0, "on_cpu": 0}
        overs = []
        for began, ended, before, after in spans:
            if ended - began <= 1e-4:
                continue
            cpu_ms = (after[3] - before[3]) / 1e6
            cause = ("blocked" if after[0] > before[0] else "preempted" if after[1] > before[1]
                     else "faulted" if after[2] > before[2]
                     else "collection" if any(began <= at <= ended for at in self.collection_starts)
                     else "off_cpu" if cpu_ms < 0.1 else "on_cpu")
            counts[cause] += 1
            if len(overs) < 20:
                overs.append([round((ended - began) * 1e3, 3), round(cpu_ms, 3), cause])
        return counts | {"overs": overs}


def continuous_calls(lookup, table, requests: list[np.ndarray], as_ids: list[torch.Tensor], calls: int,
                     gap_ms: float, sleep_ms: float, step_launches: bool = False) -> dict:
    """start and finish with the GPU never drained: sleep kernels queued ahead so that at least 150
    ms of GPU work stays queued at every call, `gap_ms` of Python between two calls and no wait of
    the host at all (a wait for the device, any kind, leaves the next calls of each code path slow:
    docs/benchmark-history.md); every 50th call's values checked bit for bit at the end. With
    `step_launches`, the host launches a step's other kernels as vLLM does outside a FULL graph
    (busy_launching in the gap, one kernel for decoder layer 0 between start and finish), and the
    last of them before each start is timed too (`torch_launch_before_start`); then at least 55 ms
    stays queued, in sleeps a tenth as long, since a launch waits once about a thousand are queued
    and 150 ms of those small kernels would be more than that. `over_by_cause`: the calls over 0.1
    ms by what else happened in them (CallWatch); `host_stalls`: the host's own stalls over 0.1 ms
    in the gaps (busy_watching); `collections`: the garbage collections that ran in the loop."""
    scratch = torch.zeros(16, device="cuda")
    target_ms, cycles = (55.0, SLEEP_CYCLES // 10) if step_launches else (150.0, SLEEP_CYCLES)
    sleep_ms = sleep_ms * cycles / SLEEP_CYCLES
    starts, finishes, launches, queued_ms, least = [], [], [], 0.0, float("inf")
    spans, stalls, gap_seconds = [], 0, 0.0
    checked = list(range(0, calls, 50))
    history = torch.empty((len(checked), as_ids[0].numel() * table.values_per_row), dtype=torch.bfloat16,
                          device="cuda")
    torch.cuda.synchronize()
    clock = time.perf_counter()
    with CallWatch() as watch:
        for k in range(calls):
            now = time.perf_counter()
            queued_ms, clock = max(0.0, queued_ms - (now - clock) * 1e3), now
            while queued_ms < target_ms + 2 * gap_ms:
                torch.cuda._sleep(cycles)
                queued_ms += sleep_ms
            gap_began = time.perf_counter()
            if step_launches:
                launch_ms, seen = busy_launching(gap_ms, scratch)
                launches.append(launch_ms)
            else:
                seen = busy_watching(gap_ms)
            stalls += seen
            counted_before = watch.counters()
            began = time.perf_counter()
            gap_seconds += began - gap_began
            least = min(least, queued_ms - (began - clock) * 1e3)
            lookup.start(as_ids[k % len(as_ids)])
            started = time.perf_counter()
            counted_started = watch.counters()
            if step_launches:  # decoder layer 0's kernel, outside both timed calls
                scratch.add_(1)
                counted_middle = watch.counters()
            else:
                counted_middle = counted_started
            middle = time.perf_counter()
            values = lookup.finish()
            ended = time.perf_counter()
            counted_after = watch.counters()
            if k % 50 == 0:
                history[k // 50].copy_(values.reshape(-1))
            starts.append((started - began) * 1e3)
            finishes.append((ended - middle) * 1e3)
            spans += [(began, started, counted_before, counted_started),
                      (middle, ended, counted_middle, counted_after)]
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    lookup.check()
    exact = all(np.array_equal(history[j].cpu().view(torch.int16).numpy().view(np.uint16),
                               bf16_bits(table, requests[k % len(requests)].reshape(-1)).reshape(-1))
                for j, k in enumerate(checked))
    over = sum(ms > 0.1 for ms in starts) + sum(ms > 0.1 for ms in finishes)
    # The host's own stalls through the gaps (their launches' time included, not watched).
    host = {"gap_stalls_over_0_1_ms": stalls, "gap_seconds": round(gap_seconds, 2)}
    return {"start": percentiles(starts), "finish": percentiles(finishes), "gap_ms": gap_ms,
            "calls_over_0_1_ms": over, "over_by_cause": watch.causes(spans), "host_stalls": host,
            "collections": len(watch.collection_starts),
            "least_queued_ms": round(least, 1), "gpu_still_busy": busy,
            "bit_exact": exact} | ({"torch_launch_before_start": percentiles(launches)} if step_launches else {})


def host_section(lookup, table, decode: list[np.ndarray], chunks: list[np.ndarray], proxy: ProxyStep | None,
                 reshape: bool = False) -> dict:
    """Host ms of start, finish and a replay's launch while the GPU has >= 50 ms of queued work
    (`lookup`: a StepLookup, or the plugin's PrefetchedRows with (tokens, 16) ids), four ways.
    `after_sync`: each call on its own, after a synchronize and one sleep kernel queued (the host's
    caches as an idle wait leaves them); `after_python_poll`: the same after `poll_stream` instead.
    `continuous`: the GPU never drained and the host never waiting (continuous_calls), the case of
    a host that runs ahead; `continuous_step_launches`: the same with the step's other kernels
    launched by the host around the calls, as vLLM outside a FULL graph. `back_to_back`: blocks of
    calls one after another behind three sleep kernels, as vLLM's host thread runs ahead of the
    device under asynchronous scheduling; `least_queued_ms` is the GPU work still queued at the
    last call of any block (the sleeps' time less the host's since they were queued), and some of
    the steps' values are checked bit for bit once the device has served them."""
    sleep_ms = queued_sleep_ms()
    report = {"sleep_kernel_ms": round(sleep_ms, 2), "after_sync_reference": after_sync_reference(30, sleep_ms),
              "quiet_launch_reference": quiet_launch_reference(30, sleep_ms)}
    for name, requests, blocks in (("decode", decode[:50], 4), ("chunk", chunks[:12], 4)):
        as_ids = [torch.from_numpy(ids.copy() if reshape else ids.reshape(-1).copy()).cuda() for ids in requests]
        busy = True
        alone = {}
        for wait_name, wait in (("after_sync", torch.cuda.synchronize), ("after_python_poll", poll_stream)):
            starts, finishes = [], []
            for device_ids in as_ids[:1] + as_ids:  # the first of each size once more: its eager graph captured
                wait()
                torch.cuda._sleep(SLEEP_CYCLES)
                began = time.perf_counter()
                lookup.start(device_ids)
                middle = time.perf_counter()
                lookup.finish()
                ended = time.perf_counter()
                busy &= not torch.cuda.current_stream().query()
                starts.append((middle - began) * 1e3)
                finishes.append((ended - middle) * 1e3)
            alone[wait_name] = {"start": percentiles(starts[1:]), "finish": percentiles(finishes[1:])}
        alone["gpu_still_busy"] = busy
        starts, finishes, least = [], [], float("inf")
        # Some steps' values, checked once every block has run: a check between blocks (its decode of
        # the table's rows on the host) would leave the next block's first call a host whose caches
        # that check filled.
        checked = range(0, len(requests), 7)
        history = torch.empty((blocks, len(checked), as_ids[0].numel() * table.values_per_row),
                              dtype=torch.bfloat16, device="cuda")
        for block in range(blocks):
            torch.cuda.synchronize()
            for _ in range(3):
                torch.cuda._sleep(SLEEP_CYCLES)
            queued = time.perf_counter()
            for k, device_ids in enumerate(as_ids):
                began = time.perf_counter()
                lookup.start(device_ids)
                middle = time.perf_counter()
                values = lookup.finish()
                ended = time.perf_counter()
                if k % 7 == 0:
                    history[block, k // 7].copy_(values.reshape(-1))
                starts.append((middle - began) * 1e3)
                finishes.append((ended - middle) * 1e3)
            least = min(least, 3 * sleep_ms - (time.perf_counter() - queued) * 1e3)
            busy &= not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        lookup.check()
        expected = [bf16_bits(table, requests[k].reshape(-1)).reshape(-1) for k in checked]
        exact = all(np.array_equal(history[block, j].cpu().view(torch.int16).numpy().view(np.uint16), want)
                    for block in range(blocks) for j, want in enumerate(expected))
        # The first call of a block follows the synchronize that ended the block before.
        first = [starts[b * len(as_ids)] for b in range(blocks)]
        others = [ms for k, ms in enumerate(starts) if k % len(as_ids)]
        gap_ms, calls = (1.0, 400) if name == "decode" else (2.0, 120)
        report[name] = {**alone, "continuous": continuous_calls(lookup, table, requests, as_ids, calls, gap_ms,
                                                                sleep_ms),
                        "continuous_step_launches": continuous_calls(lookup, table, requests, as_ids, calls,
                                                                     gap_ms, sleep_ms, step_launches=True),
                        "back_to_back": {"start": percentiles(starts), "finish": percentiles(finishes),
                                         "start_first_of_block": percentiles(first),
                                         "start_after_first": percentiles(others),
                                         "least_queued_ms": round(least, 1), "gpu_still_busy": busy,
                                         "bit_exact": exact}}
    if proxy is None:
        return report
    launches = []
    for _ in range(4):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        began = time.perf_counter()
        proxy.graph.replay()
        launches.append((time.perf_counter() - began) * 1e3)
    torch.cuda.synchronize()
    report["full_graph_replay_launch"] = {"after_sync": percentiles(launches)}
    launches = []
    for _ in range(4):
        torch.cuda._sleep(SLEEP_CYCLES)
        for _ in range(5):
            began = time.perf_counter()
            proxy.graph.replay()
            launches.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
    report["full_graph_replay_launch"]["back_to_back"] = percentiles(launches)
    return report


def faults_section(path: Path, spec: NgramSpec, other: OtherWork, work: Path) -> dict:
    """An id outside the table and an I/O error during FULL replay, on a small table."""
    report = {}
    copy = work / "faulty.bin"
    shutil.copy(path, copy)
    shutil.copy(manifest_path(path), manifest_path(copy))
    evict(copy)
    table = open_table(copy, read_path="direct", host_cache_bytes=0)
    lookup = StepLookup(table, device="cuda", resident_bytes=0, max_ids=16 * 16)
    slots = table.slot_of(np.arange(table.num_rows))
    tail = np.flatnonzero(slots >= table.num_rows - 2000)
    head = np.flatnonzero(slots < table.num_rows // 4)
    rng = np.random.default_rng(5)
    good = [rng.choice(head, 16) for _ in range(6)]
    outside = good[0].copy()
    outside[3] = table.num_rows + 11
    truncated = rng.choice(tail, 16)
    requests = [good[1], outside, good[2], truncated, good[3]]
    proxy = lookup_graph(lookup, pool_of(requests), other)
    proxy.counter.zero_()
    # The good steps' values, read before the file shrinks (the table refuses reads after: it changed).
    wanted = [bf16_bits(table, ids).reshape(-1) if k in (0, 2, 4) else None for k, ids in enumerate(requests)]
    with open(copy, "r+b") as file:  # the last half of the file's pages gone from under the open table
        file.truncate(table.header.data_offset + (table.num_rows // 2) // table.header.rows_per_page
                      * table.header.page_size)
    for k, name in enumerate(("good", "outside", "good_after", "io_error", "good_after_io")):
        began = time.perf_counter()
        proxy.graph.replay()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        values = proxy.history[k].float()
        told = lookup.pending_error()
        raised = None
        try:
            lookup.check()
        except Exception as error:  # the cause, as the caller sees it
            raised = f"{type(error).__name__}: {error}"
        exact = bool(np.array_equal(proxy.history[k].cpu().view(torch.int16).numpy().view(np.uint16),
                                    wanted[k])) if name.startswith("good") else None
        report[name] = {"step_s": round(seconds, 4), "all_nan": bool(torch.isnan(values).all()),
                        "pending_error": None if told is None else type(told).__name__,
                        "raised": raised, "bit_exact": exact}
    lookup.close()
    table.close()
    return report


def token_counts(text: str) -> list[int]:
    """`--batch-tokens`: comma-separated counts of at least one token."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1: {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--faults-table", type=Path)
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--decode-steps", type=int, default=10000)
    parser.add_argument("--chunk-steps", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--cold-steps", type=int, default=200)
    parser.add_argument("--cold-chunks", type=int, default=16)
    parser.add_argument("--layer-ms", type=float, default=1.0)
    parser.add_argument("--chunk-layer-ms", type=float, default=2.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ple-full-graph"))
    parser.add_argument("--batch-tokens", type=token_counts, default=token_counts("4,8,16,32,64"),
                        help="the batched section's tokens a decode step (comma-separated)")
    parser.add_argument("--batch-steps", type=int, default=2000)
    parser.add_argument("--sections", default="cold,warm,faults",
                        help="which of cold, warm, host, batched and faults to run (comma-separated)")
    parser.add_argument("--plugin-first", action="store_true",
                        help="the host section: the plugin's protocols before StepLookup's, not after")
    parser.add_argument("--driver-queues", action="store_true",
                        help="the driver's launch queues as the environment sets them, not as the vLLM plugin "
                             "sizes them when it serves a table")
    parser.add_argument("--interleave", action="store_true",
                        help="the warm section's two graphs alternating step by step, not in blocks")
    parser.add_argument("--steps-only", action="store_true",
                        help="the warm section's decode steps and chunks alone: no GIL, poisoned, host or mixed part")
    parser.add_argument("--step-times", type=Path,
                        help="the warm section: each side's step times (ms) saved here as .npz")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.driver_queues:  # as the plugin's hook leaves the process, before its first use of CUDA
        served = {TABLE_VARIABLE: str(args.table), **os.environ}
        if scale_launch_queues(served):
            os.environ[LAUNCH_QUEUES_VARIABLE] = served[LAUNCH_QUEUES_VARIABLE]
    torch.cuda.init()
    table = open_table(args.table)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    began = time.perf_counter()
    row_ids = real_text_row_ids(spec, args.chunks * CHUNK_TOKENS, part=0, parts=2)
    chunks = [row_ids[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS] for i in range(args.chunks)]
    # Decode tokens spread over the whole text (consecutive ones would sit in one or two files,
    # some of which, such as the codec tables, are all hot rows).
    picks = np.linspace(0, len(row_ids) - 1, args.decode_steps).astype(np.int64)
    decode = [row_ids[k:k + 1] for k in picks]
    resident = int(args.resident_fraction * table.num_rows * table.row_bytes)
    report = {"table": str(args.table), "rows": table.num_rows, "encoding": table.encoding,
              "resident_bytes": resident, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "compiled_helper": table.compiled,
              "launch_queues": os.environ.get(LAUNCH_QUEUES_VARIABLE, "the driver's default"),
              "real_text_seconds": round(time.perf_counter() - began, 1)}
    table.close()
    other = OtherWork(args.layer_ms)
    chunk_other = OtherWork(args.chunk_layer_ms)
    if "cold" in sections:
        print("cold", flush=True, file=sys.stderr)
        report["cold"] = cold_section(args.table, resident, decode, chunks, other, args.cold_steps,
                                      args.cold_chunks, 0)
        print("cold, host cache", flush=True)
        report["cold_host_cache"] = cold_section(args.table, resident, decode, chunks, other, args.cold_steps,
                                                 args.cold_chunks, None)
        print(json.dumps(report["cold"]), flush=True, file=sys.stderr)
    if "warm" in sections:
        print("warm", flush=True, file=sys.stderr)
        report["warm"] = warm_section(args.table, resident, decode, chunks, other, chunk_other, args)
        print(json.dumps(report["warm"]), flush=True, file=sys.stderr)
    if "host" in sections:
        print("host", flush=True, file=sys.stderr)
        report["host"] = host_only_section(args.table, resident, decode, chunks, chunk_other, args.plugin_first)
        print(json.dumps(report["host"]), flush=True, file=sys.stderr)
    if "batched" in sections:
        print("batched", flush=True, file=sys.stderr)
        report["batched"] = batched_section(args.table, resident, row_ids, other, args.batch_tokens,
                                            args.batch_steps)
        print(json.dumps(report["batched"]), flush=True, file=sys.stderr)
    if args.faults_table is not None and "faults" in sections:
        report["faults"] = faults_section(args.faults_table, spec, other, args.work)
    print_report(report, args.out)


if __name__ == "__main__":
    main()
