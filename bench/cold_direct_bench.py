"""Cold 18,000-row gathers through the mapping and with O_DIRECT, against fio, alternating in one run.

    flock /tmp/ple-bench.lock python bench/cold_direct_bench.py /work/bigdata/disk/ple-6g.bin

Each round runs fio's 4 KiB random reads at queue depth 64 with direct I/O on the table (the disk's
ceiling), then a cold gather of the same 18,000 distinct real-text rows with each read path, the
order of the paths swapped every round (the file evicted from the page cache before each gather).
The direct path's tables stay open for the whole run, as a server has them, their host caches
emptied before each gather; the mapped path's is opened for each, as its mapping would keep the
pages it read. Rows are checked against the synthetic table's known bytes. After a direct gather
the share of the file in the page cache is measured with mincore (it should stay 0). Medians over
the rounds and each gather's rows/s against the fio run of its own round are printed as one JSON
object; BENCHMARKS.md records it.

Both sides read blocks the disk's own cache holds: a virtual disk's host may keep blocks read or
written lately and serve them many times faster than the others (the 2-core VM's does), so a
side that read its blocks before would be measuring that cache. fio reads new offsets within the
file's first GiB, read in order first; each gather's pages are read once with O_DIRECT (not into
the page cache) just before it.

With --verify, each direct variant also runs with `verify_reads=True` (the table's page sums are
written first if missing), alternating with it in the same round, and `verify_cost` gives each
round's verified time over the unverified one. --no-mapped leaves the mapped path out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_bench import DISTINCT_ROWS, FIO_REGION, distinct_request, prime, read_in_order  # noqa: E402
from synthetic import expected_rows  # noqa: E402

from ple_prep.format.pagesums import page_sums, pagesums_path  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.offline.pagesums import write_page_sums  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.table import DEFAULT_READ_PATH  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction, evict, fio_random_read, major_faults  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402


def opened(path: Path, table, options: dict):
    """The run's open `table` with its host cache emptied, or, where there is none (the mapped
    path), one opened for this gather."""
    if table is None:
        return open_table(path, **options)
    if table.host_cache is not None:
        table.host_cache.cache.clear()
    return contextlib.nullcontext(table)


def cold_gather(path: Path, ids: np.ndarray, expected: np.ndarray, primer, table, **options) -> dict:
    prime(path, primer, ids)
    with opened(path, table, options) as table:
        faults = major_faults()
        started = time.perf_counter()
        rows = table.gather(ids)
        seconds = time.perf_counter() - started
        faults = major_faults() - faults
        if not np.array_equal(rows, expected):
            raise SystemExit(f"rows differ from the table's bytes with {options}")
    return {"rows_per_s": round(len(ids) / seconds), "major_faults": faults,
            "cached_after": round(cached_fraction(path), 6)}


def cold_decode(path: Path, requests: list[np.ndarray], primer, table, **options) -> list[float]:
    """Seconds of each decode-sized request, one after another, from a file evicted once."""
    prime(path, primer, np.concatenate(requests))
    seconds = []
    with opened(path, table, options) as table:
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
    read_in_order(path, FIO_REGION)
    primer = open_table(path, read_path="direct", host_cache_bytes=0)
    # Each host cache's memory is faulted in after open on a thread of its own, which would share
    # this host's two cores with a gather.
    tables = {name: open_table(path, **options) for name, options in variants.items() if name != "mapped"}
    if args.decode_requests:
        tables["direct"] = open_table(path, read_path="direct")
    time.sleep(5)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    fio: list[int] = []
    command = None
    for round_index in range(args.rounds):
        evict(path)
        result = fio_random_read(path, args.fio_seconds, region_bytes=FIO_REGION)
        if result is None:
            raise SystemExit("fio is not installed")
        fio.append(result["iops"])
        command = result["command"]
        names = list(variants)
        for name in names if round_index % 2 == 0 else names[::-1]:
            runs[name].append(cold_gather(path, ids, expected, primer, tables.get(name), **variants[name]))
    decode: dict[str, list[float]] = {}
    if args.decode_requests:
        # Tokens after the ones the 18,000-row request used, so their rows are not cached.
        tokens = row_ids[20_000:20_000 + args.decode_requests * args.rounds]
        for round_index in range(args.rounds):
            requests = [tokens[round_index * args.decode_requests + i].reshape(-1)
                        for i in range(args.decode_requests)]
            names = ["mapped", "direct"]
            for name in names if round_index % 2 == 0 else names[::-1]:
                decode.setdefault(name, []).extend(cold_decode(path, requests, primer, tables.get(name),
                                                               read_path=name))
    for table in [primer, *tables.values()]:
        table.close()
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
