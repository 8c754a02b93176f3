"""The default read path with its host cache: cold rows against fio, re-reads against np.take.

    python bench/synthetic.py /work/scratch/cache/ple-6g-placed.bin --base 2500000 \\
        --profile-tokens 1000000 --placed 21000000
    flock /tmp/ple-bench.lock python bench/host_cache_bench.py /work/scratch/cache/ple-6g-placed.bin

Everything runs with open_table's defaults (the direct read path, the default host cache budget).
1. Cold: each round runs fio's 4 KiB random reads at queue depth 64 with O_DIRECT on the table,
   and a cold gather of 18,000 distinct real-text rows (the host cache emptied and the file evicted
   from the page cache first; one table opened for the whole run, as a server has it), the order
   of the two swapped every round. Both read blocks the disk's own cache holds, as in
   cold_direct_bench.py: fio new offsets within the file's first GiB, read in order first; the
   gather's pages read once with O_DIRECT just before it.
2. Warm: the same 18,000 rows gathered again (from the host cache) against np.take over an
   anonymous in-RAM table of the same shape (every page written; 4 KiB pages as
   host_lookup_bench.py, and numpy's own allocation, which takes transparent huge pages), calls
   alternating; p50 of wall time over the rounds.
3. One token's 16 rows re-read (real-text tokens whose rows the cold gather brought), against
   np.take of the same 16 rows, alternating; p50 and p99.
Every gather is checked against the synthetic table's bytes. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_bench import DISTINCT_ROWS, FIO_REGION, distinct_request, prime, read_in_order  # noqa: E402
from synthetic import expected_rows  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import hostcache, open_table  # noqa: E402
from ple_prep.tools.benchmark import evict, fio_random_read  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402


def in_memory(num_rows: int, row_bytes: int, ids: np.ndarray, rows: np.ndarray, huge: bool) -> np.ndarray:
    """An in-RAM table with `rows` at `ids`, every page written."""
    if huge:
        memory = np.empty((num_rows, row_bytes), dtype=np.uint8)
    else:
        buffer = mmap.mmap(-1, num_rows * row_bytes)
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
        memory = np.frombuffer(buffer, dtype=np.uint8).reshape(num_rows, row_bytes)
    memory.fill(0xFF)
    memory[ids] = rows
    return memory


def timed_us(call, *args) -> float:
    started = time.perf_counter_ns()
    call(*args)
    return (time.perf_counter_ns() - started) / 1e3


def stats(samples: list[float]) -> dict:
    return {"p50_us": round(float(np.median(samples)), 1), "p99_us": round(float(np.percentile(samples, 99)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fio-seconds", type=float, default=4)
    parser.add_argument("--warm-rounds", type=int, default=300)
    parser.add_argument("--token-requests", type=int, default=3000)
    parser.add_argument("--token-rounds", type=int, default=3)
    args = parser.parse_args()
    path = args.table
    with open_table(path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        num_rows, row_bytes = table.num_rows, table.row_bytes
    row_ids = real_text_row_ids(spec, 40_000)
    ids = distinct_request(row_ids, DISTINCT_ROWS, 0)
    expected = expected_rows(ids)
    fio, cold, command = [], [], None
    # One table for the whole run, as a server has it (its host cache's memory faulted in once, at
    # open, in the background); the cache is emptied and the file evicted before each cold gather.
    table = open_table(path)
    primer = open_table(path, read_path="direct", host_cache_bytes=0)
    read_in_order(path, FIO_REGION)
    time.sleep(5)
    for round_index in range(args.rounds):
        def run_fio() -> None:
            nonlocal command
            evict(path)
            result = fio_random_read(path, args.fio_seconds, region_bytes=FIO_REGION)
            if result is None:
                raise SystemExit("fio is not installed")
            fio.append(result["iops"])
            command = result["command"]

        def run_cold() -> None:
            prime(path, primer, ids)
            table.host_cache.cache.clear()
            started = time.perf_counter()
            rows = table.gather(ids)
            cold.append(len(ids) / (time.perf_counter() - started))
            if not np.array_equal(rows, expected):
                raise SystemExit("cold rows differ from the table's bytes")

        for step in (run_fio, run_cold) if round_index % 2 == 0 else (run_cold, run_fio):
            step()
    primer.close()
    tier = table.host_cache
    report = {"table": str(path), "rows": num_rows, "read_path": table.read_path,
              "host_cache_bytes": tier.cache.budget_bytes, "host_cache_entries": tier.cache.entries,
              "compiled": hostcache._native is not None, "fio_command": command, "fio_iops": fio,
              "cold_rows_per_s": [round(rate) for rate in cold],
              "cold_x_fio": [round(rate / iops, 3) for rate, iops in zip(cold, fio)]}
    report["cold_x_fio_median"] = round(float(np.median(report["cold_x_fio"])), 3)
    # Warm: re-reads from the host cache against np.take over RAM, one in-RAM table at a time
    # (two would not fit beside the others' work on this host).
    read_before = tier.rows_read
    report["warm_18000"] = {}
    memory = None
    for huge in (False, True):
        name = "np_take_huge_pages" if huge else "np_take_4k_pages"
        memory = None  # the last table's memory freed first
        memory = in_memory(num_rows, row_bytes, ids, expected, huge)
        assert np.array_equal(np.take(memory, ids, axis=0), table.gather(ids))
        ours, theirs = [], []
        for _ in range(args.warm_rounds):
            ours.append(timed_us(table.gather, ids))
            theirs.append(timed_us(np.take, memory, ids, 0))
        report["warm_18000"][f"host_cache_beside_{name}"] = stats(ours)
        report["warm_18000"][name] = stats(theirs)
        report[f"warm_x_{name}"] = round(float(np.median(ours)) / float(np.median(theirs)), 3)
    assert tier.rows_read == read_before  # every re-read came from the host cache
    # One token's 16 rows re-read: tokens among the first ones, whose rows the cold gather read.
    tokens = [row_ids[i] for i in range(args.token_requests) if np.isin(row_ids[i], ids).all()]
    wanted = expected_rows(np.concatenate(tokens))  # checked after the timed calls, which allocate nothing large
    ours, theirs = [], []
    for _ in range(args.token_rounds):
        for token in tokens:
            ours.append(timed_us(table.gather, token))
            theirs.append(timed_us(np.take, memory, token, 0))
    got = np.concatenate([table.gather(token) for token in tokens])
    assert np.array_equal(got, wanted)
    report["token_16_rows"] = {"requests": len(tokens), "host_cache": stats(ours),
                               "np_take_huge_pages": stats(theirs)}
    del memory
    report["cache"] = {"hits": tier.cache.hits, "misses": tier.cache.misses, "rows_read": tier.rows_read,
                       "pages_read": tier.pages_read}
    table.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
