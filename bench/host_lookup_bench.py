"""Host lookups from the page cache against np.take over memory, side by side in one run.

    python bench/synthetic.py /work/bigdata/cpu/ple-6g.bin --base 2500000
    python bench/synthetic.py /work/bigdata/cpu/ple-6g-placed.bin --base 2500000 \\
        --profile-tokens 1000000 --placed 21000000
    flock /tmp/ple-bench.lock python bench/host_lookup_bench.py /work/bigdata/cpu/ple-6g.bin \\
        /work/bigdata/cpu/ple-6g-placed.bin

For each table (a source-order one, and one whose order map has the real table's default size),
with its pages in the page cache and the mapped read path:
1. Warm 18,000 distinct real-text rows: `gather(ids)`, `gather(ids, out=buffer)` (a reused buffer,
   as a pinned staging area is), each with the compiled helper and with the numpy fallback, against
   `np.take(memory, ids, axis=0)` over an anonymous in-memory table of the same shape holding those
   rows at their ids, every page of it written (what a server holding the whole table in RAM has;
   4 KiB pages, no huge pages, as the page cache's). All variants alternate call by call, so load
   from other work on the host hits them alike; p50 of wall and thread-CPU time, and each
   variant's ratio to np.take. Beside them, np.take over a table of which only the requested rows'
   pages were ever written: on a virtual machine those few pages lie close together in the guest's
   memory, which makes their reads cheaper than any table of this size gets (BENCHMARKS.md).
2. Decode-sized requests: 16 rows (one token's real-text ids), 3,000 requests, compiled and numpy
   alternating request by request; p50/p99 wall and thread-CPU.
3. `slot_of` alone on the order map (16 and 18,000 ids), and the int64 binary search that numpy
   used to run on the uint32 map (the whole map converted on every call).
4. `threads` 1 and 2 on the 18,000-row request (this host has 2 cores shared with other work).
Every gather is checked equal to np.take's rows. Prints one JSON object; BENCHMARKS.md records it.

Beside other code (a built checkout, e.g. `git worktree add /tmp/other COMMIT` and `python3 setup.py
build_ext --inplace` there): `--other-tree /tmp/other --pairs 3` runs the bench of each tree as a
child process in turn (the order swapped every pair, as the shared disk and host drift), and adds
each side's figures that both trees report, their medians and this tree's over the other's.
"""
from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_bench import DISTINCT_ROWS, distinct_request  # noqa: E402

from ple_prep.format import order as order_module  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import gather as gather_module  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

COMPILED = (gather_module._native, gather_module._core_native, order_module._native) \
    if gather_module._native is not None else None


def use_compiled(on: bool) -> None:
    """Switch the host lookup between the compiled helper and the numpy fallback."""
    gather_module._native, gather_module._core_native, order_module._native = COMPILED if on else (None, None, None)


def in_memory_table(table, ids: np.ndarray, *, every_page: bool = True) -> np.ndarray:
    """An anonymous (num_rows, row_bytes) array holding the requested rows at their ids; with
    `every_page`, each of its pages written first, as a table loaded into RAM has them."""
    buffer = mmap.mmap(-1, table.num_rows * table.row_bytes)
    buffer.madvise(mmap.MADV_NOHUGEPAGE)
    memory = np.frombuffer(buffer, dtype=np.uint8).reshape(table.num_rows, table.row_bytes)
    if every_page:
        memory.fill(0xFF)
    memory[ids] = table.gather(ids)
    return memory


def timed(call) -> tuple[int, int]:
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    call()
    return time.perf_counter_ns() - wall, time.thread_time_ns() - cpu


def summary(samples: list[tuple[int, int]]) -> dict:
    wall = np.array([s[0] for s in samples]) / 1e3
    cpu = np.array([s[1] for s in samples]) / 1e3
    return {"p50_us": round(float(np.median(wall)), 1), "p99_us": round(float(np.percentile(wall, 99)), 1),
            "cpu_p50_us": round(float(np.median(cpu)), 1), "cpu_p99_us": round(float(np.percentile(cpu, 99)), 1)}


def alternate(calls: dict, rounds: int) -> dict:
    samples: dict[str, list] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (switch, call) in calls.items():
            switch()
            samples[name].append(timed(call))
    return {name: summary(values) for name, values in samples.items()}


def warm(table, ids: np.ndarray, rounds: int) -> dict:
    memory = in_memory_table(table, ids)
    touched_only = in_memory_table(table, ids, every_page=False)
    expected = np.take(memory, ids, axis=0)
    buffer = np.empty_like(expected)
    variants = {}
    for loops in (["compiled"] if COMPILED else []) + ["numpy"]:
        use_compiled(loops == "compiled")
        assert np.array_equal(table.gather(ids), expected)
        assert np.array_equal(table.gather(ids, out=buffer), expected)
        switch = (lambda on: lambda: use_compiled(on))(loops == "compiled")
        variants[f"gather, {loops}"] = (switch, lambda: table.gather(ids))
        variants[f"gather into a buffer, {loops}"] = (switch, lambda: table.gather(ids, out=buffer))
    variants["np.take over memory"] = (lambda: None, lambda: np.take(memory, ids, axis=0))
    variants["np.take over the requested rows' pages only"] = (lambda: None,
                                                                lambda: np.take(touched_only, ids, axis=0))
    report = alternate(variants, rounds)
    base = report["np.take over memory"]
    for figures in report.values():
        figures["x_np_take"] = round(figures["p50_us"] / base["p50_us"], 3)
        figures["x_np_take_cpu"] = round(figures["cpu_p50_us"] / base["cpu_p50_us"], 3)
    use_compiled(True)
    threads = {count: (lambda c=count: setattr(table, "threads", c), lambda: table.gather(ids, out=buffer))
               for count in (1, 2)}
    report["threads (gather into a buffer, compiled)"] = alternate(threads, rounds)
    table.threads = 1
    return report


def decode(table, row_ids: np.ndarray) -> dict:
    requests = [row_ids[token].reshape(-1) for token in range(3000)]
    for request in requests:
        table.gather(request)
    samples: dict[str, list] = {}
    for loops in (["compiled"] if COMPILED else []) + ["numpy"]:
        samples[loops] = []
    for _ in range(2):
        for request in requests:
            for loops, values in samples.items():
                use_compiled(loops == "compiled")
                values.append(timed(lambda r=request: table.gather(r)))
    use_compiled(True)
    return {f"16 rows, {loops}": summary(values) for loops, values in samples.items()}


def slot_lookup(table, ids: np.ndarray, row_ids: np.ndarray) -> dict:
    order = table.order
    local = ids - table.first_row
    report = {}
    tokens = [row_ids[token].reshape(-1) - table.first_row for token in range(3000)]
    for count, requests in ((16, tokens), (DISTINCT_ROWS, [local])):
        for loops in (["compiled"] if COMPILED else []) + ["numpy"]:
            use_compiled(loops == "compiled")
            rounds = 1 if count == 16 else 30
            values = [timed(lambda r=request: order.slot_of(r)) for _ in range(rounds) for request in requests]
            report[f"{count} ids, {loops}"] = summary(values)
    use_compiled(True)
    if order.num_placed:
        # What every host lookup paid before: int64 keys on the uint32 map convert the whole map.
        values = [timed(lambda: np.searchsorted(order.sorted_rows, local[:16])) for _ in range(5)]
        report["16 ids, int64 search on the uint32 map (before)"] = summary(values)
        started = time.perf_counter()
        order.build_rank_index()
        report["rank index build seconds"] = round(time.perf_counter() - started, 3)
    return report


def leaves(report, prefix: str = "") -> dict[str, float]:
    """Each number of a report, by its path of keys ("table/slot_of/16 ids, compiled/p50_us")."""
    if isinstance(report, dict):
        return {name: value for key, part in report.items() for name, value in leaves(part, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): report} if isinstance(report, (int, float)) and not isinstance(report, bool) else {}


def beside(other: Path, tables: list[Path], rounds: int, pairs: int) -> dict:
    """This tree's bench and `other`'s, each a child run of its own tree's script, `pairs` times,
    the order swapped every pair; per figure both reported: each side's values, medians, ratio."""
    trees = {"this": Path(__file__).resolve().parent.parent, "other": other.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for pair in range(pairs):
        for side in (("this", "other") if pair % 2 == 0 else ("other", "this")):
            done = subprocess.run([sys.executable, str(trees[side] / "bench" / "host_lookup_bench.py"),
                                   *(str(table.resolve()) for table in tables), "--rounds", str(rounds)],
                                  capture_output=True, text=True, check=True, cwd=trees[side])
            runs[side].append(leaves(json.loads(done.stdout)))
    shared = sorted(set.intersection(*(set(run) for side in runs.values() for run in side)))
    figures = {}
    for name in shared:
        this, that = ([run[name] for run in runs[side]] for side in ("this", "other"))
        middle = float(np.median(this)), float(np.median(that))
        figures[name] = {"this": this, "other": that, "this_median": middle[0], "other_median": middle[1],
                         "this_over_other": round(middle[0] / middle[1], 3) if middle[1] else None}
    return {"other_tree": str(other), "pairs": pairs, "figures": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--other-tree", type=Path, help="a built checkout of other code to run beside this one")
    parser.add_argument("--pairs", type=int, default=3, help="with --other-tree: runs of each tree, alternating")
    args = parser.parse_args()
    if args.other_tree is not None:
        print(json.dumps(beside(args.other_tree, args.tables, args.rounds, args.pairs), indent=1))
        return
    report: dict = {"compiled_helper": COMPILED is not None, "tables": {}}
    for path in args.tables:
        with open_table(path, read_path="mapped") as table:
            row_ids = real_text_row_ids(NgramSpec.from_json(table.manifest["ngram"]), 40_000)
            ids = distinct_request(row_ids, DISTINCT_ROWS, 0)
            table.gather(ids)
            report["tables"][str(path)] = {
                "rows": table.num_rows, "placed": table.header.num_placed,
                "warm_18000": warm(table, ids, args.rounds),
                "decode": decode(table, row_ids),
                "slot_of": slot_lookup(table, ids, row_ids),
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
