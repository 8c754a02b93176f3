"""Cold 18,000-row gathers through the mapping and with O_DIRECT, against fio, alternating in one run.

    flock /tmp/ple-bench.lock python bench/cold_direct_bench.py /work/bigdata/disk/ple-6g.bin

Each round runs fio's 4 KiB random reads at queue depth 64 with direct I/O on the table (the disk's
ceiling), then a cold gather of the same 18,000 distinct real-text rows with each read path, the
order of the two paths swapped every round (the file evicted before each gather). Rows are checked
against the synthetic table's known bytes. After a direct gather the share of the file in the page
cache is measured with mincore (it should stay 0). Medians over the rounds and each gather's
rows/s against the fio run of its own round are printed as one JSON object; BENCHMARKS.md records it.

With --verify, each direct variant also runs with `verify_reads=True` (the table's page sums are
written first if missing), alternating with it in the same round, and `verify_cost` gives each
round's verified time over the unverified one. --no-mapped leaves the mapped path out.
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

from gather_bench import DISTINCT_ROWS, distinct_request  # noqa: E402
from synthetic import expected_rows  # noqa: E402

from ple_prep.format.pagesums import page_sums, pagesums_path  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.offline.pagesums import write_page_sums  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.table import DEFAULT_READ_PATH  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction, evict, fio_random_read, major_faults  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402


def cold_gather(path: Path, ids: np.ndarray, expected: np.ndarray, **options) -> dict:
    evict(path)
    with open_table(path, **options) as table:
        faults = major_faults()
        started = time.perf_counter()
        rows = table.gather(ids)
        seconds = time.perf_counter() - started
        faults = major_faults() - faults
        if not np.array_equal(rows, expected):
            raise SystemExit(f"rows differ from the table's bytes with {options}")
    return {"rows_per_s": round(len(ids) / seconds), "major_faults": faults,
            "cached_after": round(cached_fraction(path), 6)}


def cold_decode(path: Path, requests: list[np.ndarray], **options) -> list[float]:
    """Seconds of each decode-sized request, one after another, from a file evicted once."""
    evict(path)
    seconds = []
    with open_table(path, **options) as table:
        for ids in requests:
            started = time.perf_counter()
            table.gather(ids)
            seconds.append(time.perf_counter() - started)
    return seconds


def summary(runs: list[dict], fio: list[int]) -> dict:
    rates = [run["rows_per_s"] for run in runs]
    ratios = [run["rows_per_s"] / iops for run, iops in zip(runs, fio)]
    return {"median_rows_per_s": round(float(np.median(rates))),
            "median_x_fio": round(float(np.median(ratios)), 3),
            "min_x_fio": round(min(ratios), 3), "max_x_fio": round(max(ratios), 3),
            "rows_per_s": rates, "x_fio": [round(ratio, 3) for ratio in ratios],
            "major_faults": [run["major_faults"] for run in runs],
            "cached_after": [run["cached_after"] for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fio-seconds", type=float, default=4)
    parser.add_argument("--decode-requests", type=int, default=0,
                        help="Also time this many cold one-token requests (16 rows) per path and round.")
    parser.add_argument("--queue-depths", default="64",
                        help="Comma-separated queue depths of the direct path, each its own variant.")
    parser.add_argument("--verify", action="store_true", help="Also each direct variant with verify_reads.")
    parser.add_argument("--no-mapped", action="store_true", help="Leave the mapped path out.")
    args = parser.parse_args()
    path = args.table
    with open_table(path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        rows = table.num_rows
    row_ids = real_text_row_ids(spec, 40_000)
    ids = distinct_request(row_ids, DISTINCT_ROWS, 0)
    expected = expected_rows(ids)
    variants = {} if args.no_mapped else {"mapped": {"read_path": "mapped"}}
    for depth in [int(d) for d in args.queue_depths.split(",")]:
        variants[f"direct_qd{depth}"] = {"read_path": "direct", "queue_depth": depth}
        if args.verify:
            variants[f"direct_qd{depth}_verified"] = {"read_path": "direct", "queue_depth": depth,
                                                      "verify_reads": True}
    if args.verify and not pagesums_path(path).exists():
        write_page_sums(path)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    fio: list[int] = []
    command = None
    for round_index in range(args.rounds):
        evict(path)
        result = fio_random_read(path, args.fio_seconds)
        if result is None:
            raise SystemExit("fio is not installed")
        fio.append(result["iops"])
        command = result["command"]
        names = list(variants)
        for name in names if round_index % 2 == 0 else names[::-1]:
            runs[name].append(cold_gather(path, ids, expected, **variants[name]))
    decode: dict[str, list[float]] = {}
    if args.decode_requests:
        # Tokens after the ones the 18,000-row request used, so their rows are not cached.
        tokens = row_ids[20_000:20_000 + args.decode_requests * args.rounds]
        for round_index in range(args.rounds):
            requests = [tokens[round_index * args.decode_requests + i].reshape(-1)
                        for i in range(args.decode_requests)]
            names = ["mapped", "direct"]
            for name in names if round_index % 2 == 0 else names[::-1]:
                decode.setdefault(name, []).extend(cold_decode(path, requests, read_path=name))
    evict(path)
    report = {"table": str(path), "file_bytes": path.stat().st_size, "rows": rows,
              "distinct_rows": DISTINCT_ROWS, "default_read_path": DEFAULT_READ_PATH,
              "fio_command": command, "fio_iops": fio, "fio_median_iops": round(float(np.median(fio))),
              "rounds": args.rounds}
    report |= {name: summary(samples, fio) for name, samples in runs.items()}
    for name in [name for name in runs if name.endswith("_verified")]:
        plain = runs[name[:-len("_verified")]]
        costs = [base["rows_per_s"] / run["rows_per_s"] for run, base in zip(runs[name], plain)]
        report[f"{name}_cost"] = {"median_time_ratio": round(float(np.median(costs)), 4),
                                  "time_ratios": [round(cost, 4) for cost in costs]}
    if args.verify:
        # The verification's own work, apart from the disk's noise: the sums of as many pages as the
        # gather read, against the median unverified gather's time.
        with open_table(path) as table:
            pages = np.random.default_rng(0).integers(0, 256, (len(np.unique(table.page_of(ids))), table.page_size),
                                                       dtype=np.uint8)
        timings = []
        for _ in range(7):
            started = time.perf_counter()
            page_sums(pages)
            timings.append(time.perf_counter() - started)
        gather_seconds = DISTINCT_ROWS / float(np.median([run["rows_per_s"] for run in runs["direct_qd512"]]))
        report["page_sums"] = {"pages": len(pages), "median_ms": round(float(np.median(timings)) * 1e3, 3),
                               "share_of_a_cold_gather": round(float(np.median(timings)) / gather_seconds, 4)}
    for name, seconds in decode.items():
        report[f"cold_decode_16_{name}"] = {
            "requests": len(seconds), "p50_us": round(float(np.percentile(seconds, 50)) * 1e6, 1),
            "p99_us": round(float(np.percentile(seconds, 99)) * 1e6, 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
