"""The gather targets (BENCHMARKS.md, "runtime gather") on a table of at least 6 GiB, side by side in one run.

    flock /tmp/ple-bench.lock python bench/gather_bench.py /work/bigdata/issue4/ple-6g.bin

1. fio 4 KiB random reads at queue depth 64 on the file (direct I/O): the disk's ceiling, run
   `--repeats` times before and after the cold gathers. The disk is shared with other work, so
   every cold variant also runs `--repeats` times and ratios compare best with best.
2. Cold gather of 18,000 distinct rows (real text through the table's hash; new text for every run)
   through the mapping for several advice windows, with O_DIRECT ("direct"), and a plain numpy
   fancy index over the MADV_RANDOM mapping, each after evicting the file.
3. Warm gather of the same rows against np.take on an in-memory copy holding those rows.
4. Decode-sized warm gathers (16, 32 and 64 rows): p50 and p99.
Prints one JSON object; BENCHMARKS.md records it.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction, evict, fio_random_read, major_faults, time_requests  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

DISTINCT_ROWS = 18_000


def distinct_request(row_ids: np.ndarray, count: int, start_token: int) -> np.ndarray:
    """The distinct rows of consecutive real-text tokens from `start_token`, until `count`."""
    seen: dict[int, None] = {}
    for row in row_ids[start_token:].reshape(-1).tolist():
        seen.setdefault(row, None)
        if len(seen) == count:
            return np.fromiter(seen, dtype=np.int64, count=count)
    raise ValueError("not enough real text")


# Real-text tokens a cold run's request is drawn from (its 18,000 distinct rows come from about 1,800).
REQUEST_TOKENS = 4000
# fio's reads where the disk's own cache holds them: the file's first GiB, read in order first.
FIO_REGION = 1 << 30


def read_in_order(path: Path, length: int) -> None:
    """Read the file's first `length` bytes with O_DIRECT, 1 MiB at a time: into the disk's own
    cache (a virtual disk's host may keep blocks read lately), not the page cache."""
    buffer = mmap.mmap(-1, 1 << 20)
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for offset in range(0, length, len(buffer)):
            if os.preadv(descriptor, [buffer], offset) < len(buffer):
                break
    finally:
        os.close(descriptor)
        buffer.close()


def prime(path: Path, primer, ids: np.ndarray) -> None:
    """Give the disk's own cache the pages of `ids` (read by `primer`, a direct-path table without a
    host cache), then evict the file: the pages are cold to the page cache, warm to the disk. The
    file is evicted first too, or the primer would read cached pages through its mapping, which
    keeps them."""
    evict(path)
    primer.gather(ids)
    evict(path)


def cold(path: Path, run, **options) -> dict:
    evict(path)
    left = cached_fraction(path)
    with open_table(path, **options) as table:
        faults = major_faults()
        started = time.perf_counter()
        result = run(table)
        seconds = time.perf_counter() - started
        faults = major_faults() - faults
        del result
    return {"seconds": round(seconds, 4), "rows_per_s": round(DISTINCT_ROWS / seconds),
            "major_faults": faults, "cached_before": left}


def plain_rows(table) -> np.ndarray:
    """The baseline: the table's file mapped as open_table maps it (MAP_PRIVATE, MADV_RANDOM), its
    rows as a (page, position in page, byte) view for numpy fancy indexing, with no advice."""
    with open(table.path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    mapping.madvise(mmap.MADV_RANDOM)
    header = table.header
    data = np.frombuffer(mapping, dtype=np.uint8, offset=header.data_offset)
    return np.lib.stride_tricks.as_strided(
        data, shape=(header.num_pages, header.rows_per_page, header.row_bytes),
        strides=(header.page_size, header.row_bytes, 1), writeable=False)


def in_memory_copy(table, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An anonymous (num_rows, row_bytes) array holding the requested rows at their slots.

    Only the pages of requested rows are written (so memory stays small), each row at its slot's
    place in a table-sized array. np.take then walks the same spread of virtual pages a full copy
    would, but on a virtual machine those few pages lie closer together in the guest's memory and
    read 14-22% faster here (BENCHMARKS.md, "Host lookups"), so this baseline flatters np.take;
    bench/host_lookup_bench.py compares with a copy whose every page is written. Huge pages are
    refused so the copy has the file mapping's 4 KiB pages.
    """
    slots = table.slot_of(ids)
    buffer = mmap.mmap(-1, table.num_rows * table.row_bytes)
    buffer.madvise(mmap.MADV_NOHUGEPAGE)
    copy = np.frombuffer(buffer, dtype=np.uint8).reshape(table.num_rows, table.row_bytes)
    copy[slots] = table.gather(ids)
    return copy, slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--windows", default="0,8,16,32,64,128,256")
    parser.add_argument("--fio-seconds", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="Cold runs per variant and fio runs per side; the best of each counts.")
    args = parser.parse_args()
    path = args.table
    report: dict = {"table": str(path), "file_bytes": path.stat().st_size}
    with open_table(path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        report["rows"] = table.num_rows
    windows = [int(w) for w in args.windows.split(",")]
    # Every cold run reads rows of its own: a virtual disk keeps blocks read lately, and fio reads
    # new offsets each run too (tools.benchmark.fio_random_read). 4,000 tokens a request, as many
    # as the cold runs (fancy index, each window, direct), after the warm runs' request.
    cold_runs = args.repeats * (len(windows) + 2)
    row_ids = real_text_row_ids(spec, REQUEST_TOKENS * (cold_runs + 1))
    ids = distinct_request(row_ids, DISTINCT_ROWS, 0)
    later_requests = (distinct_request(row_ids, DISTINCT_ROWS, REQUEST_TOKENS * run) for run in range(1, cold_runs + 1))
    evict(path)
    # fio before and after the cold gathers: a shared disk's rate drifts, so both are kept and the
    # ratio uses their mean.
    fio_before = [fio_random_read(path, args.fio_seconds) for _ in range(args.repeats)]

    def best(runs: list[dict]) -> dict:
        return max(runs, key=lambda run: run["rows_per_s"]) | {
            "all_rows_per_s": [run["rows_per_s"] for run in runs]}

    def fancy_index(request: np.ndarray):
        return lambda t: plain_rows(t)[np.divmod(t.slot_of(request), t.rows_per_page)]

    def gather(request: np.ndarray):
        return lambda t: t.gather(request)

    report["cold_fancy_index"] = best([cold(path, fancy_index(next(later_requests)))
                                       for _ in range(args.repeats)])
    report["cold_gather"] = {}
    for window in windows:
        report["cold_gather"][window] = best([
            cold(path, gather(next(later_requests)), window_pages=window, read_path="mapped")
            for _ in range(args.repeats)])
    report["cold_gather"]["direct"] = best([
        cold(path, gather(next(later_requests)), read_path="direct") for _ in range(args.repeats)])
    fio_after = [fio_random_read(path, args.fio_seconds) for _ in range(args.repeats)]
    if fio_before[0] is not None:
        report["fio"] = {"command": fio_before[0]["command"],
                         "iops_before": [run["iops"] for run in fio_before],
                         "iops_after": [run["iops"] for run in fio_after]}
        iops = max(report["fio"]["iops_before"] + report["fio"]["iops_after"])
        report["fio"]["best_iops"] = iops
    else:
        report["fio"], iops = None, None
    if iops:
        report["cold_vs_fio"] = {w: round(r["rows_per_s"] / iops, 3)
                                 for w, r in report["cold_gather"].items()}
        report["fancy_index_vs_fio"] = round(report["cold_fancy_index"]["rows_per_s"] / iops, 3)

    # Warm: the rows in the page cache, put there by a gather through the mapping (the direct
    # read path leaves nothing cached; both copy cached requests from the mapping).
    with open_table(path, read_path="mapped") as table:
        table.gather(ids)
        rows_copy, slots = in_memory_copy(table, ids)
        assert np.array_equal(np.take(rows_copy, slots, axis=0), table.gather(ids))
        # Warm: gather, np.take and the plain fancy index alternate, so drift on a shared host
        # hits all three alike; ratios are given on wall time and on the thread's CPU time.
        rows = plain_rows(table)
        warm = {"warm_gather": table.gather,
                "warm_np_take": lambda _: np.take(rows_copy, slots, axis=0),
                "warm_fancy_index": lambda _: rows[np.divmod(slots, table.rows_per_page)]}
        runs: dict[str, list[dict]] = {name: [] for name in warm}
        for _ in range(60):
            for name, gather in warm.items():
                runs[name].append(time_requests(gather, [ids]))
        for name, samples in runs.items():
            report[name] = {key: round(float(np.median([sample[key] for sample in samples])), 1)
                            for key in ("p50_us", "cpu_p50_us")}
        report["warm_vs_np_take"] = round(report["warm_gather"]["p50_us"]
                                          / report["warm_np_take"]["p50_us"], 3)
        report["warm_vs_np_take_cpu"] = round(report["warm_gather"]["cpu_p50_us"]
                                              / report["warm_np_take"]["cpu_p50_us"], 3)
        table.threads = 2
        report["warm_gather_threads2"] = time_requests(table.gather, [ids] * 30)
        table.threads = 1
        rows_copy = None  # frees the in-memory copy before the next measurements
        for tokens in (1, 2, 4):
            requests = [row_ids[i:i + tokens].reshape(-1) for i in range(0, 3000 * tokens, tokens)]
            for request in requests:
                table.gather(request)
            report[f"warm_decode_{16 * tokens}"] = time_requests(table.gather, requests)
    evict(path)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
