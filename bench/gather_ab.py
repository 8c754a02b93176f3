"""Warm gather of this checkout against an earlier one, alternating in one process.

Separate runs of gather_bench.py drift by 10% or more on a shared host, more than a small change
to the warm path saves; alternating both versions' `gather` (and np.take) call by call in one
process puts the drift on all of them alike. The earlier version is a copy of its `ple_prep`
package renamed `ple_prep_before` (its imports are relative, so the copy imports itself):

    git -C /work/main archive 56a6a0c ple_prep | tar -x -C /tmp/before
    mv /tmp/before/ple_prep /tmp/before/ple_prep_before
    flock /tmp/ple-bench.lock python bench/gather_ab.py TABLE --before /tmp/before

Prints one JSON object: thread-CPU p50 of the 18,000-row warm request (as in gather_bench.py) and
of 16-row decode requests, for both versions, and their ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_bench import DISTINCT_ROWS, distinct_request, in_memory_copy  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402


def cpu_p50_us(samples: list[int]) -> float:
    return round(float(np.median(samples)) / 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--before", type=Path, required=True,
                        help="Folder holding the earlier version as package ple_prep_before.")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    sys.path.insert(0, str(args.before))
    from ple_prep_before.runtime import open_table as open_table_before

    with open_table(args.table, read_path="mapped") as after, open_table_before(args.table) as before:
        row_ids = real_text_row_ids(NgramSpec.from_json(after.manifest["ngram"]), 40_000)
        ids = distinct_request(row_ids, DISTINCT_ROWS, 0)
        rows_copy, slots = in_memory_copy(after, ids)
        assert np.array_equal(before.gather(ids), after.gather(ids))
        versions = {"before": before.gather, "after": after.gather}
        calls = versions | {"np_take": lambda _: np.take(rows_copy, slots, axis=0)}
        warm: dict[str, list[int]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, gather in calls.items():
                started = time.thread_time_ns()
                gather(ids)
                warm[name].append(time.thread_time_ns() - started)
        decode: dict[str, list[int]] = {name: [] for name in versions}
        requests = [row_ids[token].reshape(-1) for token in range(3000)]
        for _ in range(3):
            for name, gather in versions.items():
                for request in requests:
                    started = time.thread_time_ns()
                    gather(request)
                    decode[name].append(time.thread_time_ns() - started)
        rows_copy = None  # frees the in-memory copy before the next measurements
    p50 = {name: cpu_p50_us(samples) for name, samples in warm.items()}
    print(json.dumps({
        "warm_cpu_p50_us": p50,
        "warm_vs_np_take": {name: round(p50[name] / p50["np_take"], 3) for name in versions},
        "after_vs_before": round(p50["after"] / p50["before"], 3),
        "decode_16_cpu_p50_us": {name: cpu_p50_us(samples) for name, samples in decode.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
