"""The first gather after `open_table` against a later one of the same size (target: within 2x).

Run: python bench/first_gather.py TABLE [--rounds 5]

Ids: two disjoint sets of 18,000 distinct real-text rows (ple_prep.tools.realtext, the table's own
hash), their pages in disjoint 64 KiB windows of the file (`disjoint_windows`, the figure that
shows the lookup's first-request cost), and split as the text reads them (`shared_windows`: a
later gather finds part of its pages mapped by the first, `distinct_sets` says why). For each
split, a warm-up child gathers both sets, so their pages are in the page cache. Then each round is
a fresh child process: `open_table` (timed: it builds the order map's lookup index), a gather of one
set (the first request) and of the other (a later one), alternating which set goes first. The
table is opened with the mapped read path, which serves cached pages from the page cache (the
direct path would read every row from the drive, timing the drive): what the ratio shows is what
a first request pays in the lookup beyond a later one.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

ROWS = 18_000
# Linux's fault_around_bytes default: a read fault maps the cached pages of its aligned window.
FAULT_AROUND_BYTES = 64 << 10


def child(table: Path, ids_path: Path, swap: bool) -> dict:
    sets = np.load(ids_path, allow_pickle=False)
    first, later = (sets[1], sets[0]) if swap else (sets[0], sets[1])
    started = time.perf_counter()
    opened = open_table(table, read_path="mapped")
    open_s = time.perf_counter() - started
    timings, faults = [], []
    for ids in (first, later):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        opened.gather(ids)
        timings.append(time.perf_counter() - started)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    opened.close()
    # Minor faults: mapping the file's cached pages into this process (a later set sharing the
    # first's windows finds part of them mapped: distinct_sets).
    return {"open_ms": round(1000 * open_s, 1), "first_ms": round(1000 * timings[0], 3),
            "later_ms": round(1000 * timings[1], 3), "first_minor_faults": faults[0],
            "later_minor_faults": faults[1]}


def distinct_sets(table: Path) -> tuple[np.ndarray, np.ndarray]:
    """Two sets of distinct real-text rows in the order the text first reads them, split two ways:
    into disjoint 64 KiB windows of the file, and as they come (their pages share windows). The
    kernel maps a cached page's neighbours within its window at each fault (fault-around), so a
    later set sharing windows with the first finds part of its mapping done: the page cache's
    doing, not the lookup's, which the first split leaves out."""
    with open_table(table) as opened:
        spec = NgramSpec.from_json(opened.manifest["ngram"])
        low, high = opened.row_range
        rows = real_text_row_ids(spec, 60_000, part=1, parts=2).reshape(-1)
        rows = rows[(rows >= low) & (rows < high)]
        _, first_seen = np.unique(rows, return_index=True)
        distinct = rows[np.sort(first_seen)]
        header = opened.header
        pages = opened.slot_of(distinct) // opened.rows_per_page
        windows = (header.data_offset + pages * header.page_size) // FAULT_AROUND_BYTES
    count = min(ROWS, len(distinct) // 3)  # a table smaller than the model's has fewer
    sets: list[list[int]] = [[], []]
    owner: dict[int, int] = {}
    for row, window in zip(distinct.tolist(), windows.tolist()):
        side = owner.setdefault(window, 0 if len(sets[0]) <= len(sets[1]) else 1)
        if len(sets[side]) < count:
            sets[side].append(row)
        if len(sets[0]) == len(sets[1]) == count:
            break
    count = min(map(len, sets))
    disjoint = np.array([sets[0][:count], sets[1][:count]], dtype=np.int64)
    return disjoint, np.stack([distinct[:count], distinct[count:2 * count]])


def run(table: Path, ids_path: Path, swap: bool) -> dict:
    """One round in a fresh child process (`child`)."""
    command = [sys.executable, __file__, str(table), "--child", str(ids_path), *(["--swap"] * swap)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--swap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.table, args.child, args.swap)))
        return
    with tempfile.TemporaryDirectory() as folder:
        report: dict = {}
        for name, sets in zip(("disjoint_windows", "shared_windows"), distinct_sets(args.table)):
            ids_path = Path(folder) / f"{name}.npy"
            np.save(ids_path, sets)

            run(args.table, ids_path, False)  # warm-up: both sets' pages into the page cache
            rounds = [run(args.table, ids_path, index % 2 == 1) for index in range(args.rounds)]
            ratios = [r["first_ms"] / r["later_ms"] for r in rounds]
            report[name] = {"rows": sets.shape[1], "rounds": rounds,
                            "first_over_later_median": round(statistics.median(ratios), 3),
                            "first_over_later_max": round(max(ratios), 3),
                            "open_ms_median": statistics.median(r["open_ms"] for r in rounds)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
