"""`ple-prep bench`: how fast this host's disk serves a prepared table, measured with real text.

Cold requests run against a page cache emptied of the table (`posix_fadvise(DONTNEED)` after the
mapping is closed), read by the table's default read path; warm ones repeat the same requests with
the rows cached (through the mapped read path, the one that caches what it reads). Requests are real-sized
(a prefill chunk of 4,096 tokens, decode steps of 1 and 4 tokens: 16 and 64 rows), their ids from
real text through the table's own hash. When `fio` is installed, its 4 KiB random-read rate at
queue depth 64 on the same file is the ceiling the cold gathers are compared with.
"""
from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..core.errors import BadInput
from ..ngram import NgramSpec
from ..runtime import compiled_helper_missing, open_table
from ..runtime.gather import _MINCORE

PREFILL_TOKENS = 4096
DECODE_TOKENS = (1, 4)
# Rows of the model's own table (docs/MODEL.md). A table of fewer (the example checkpoint's, a
# reduced geometry) has few pages, close together, which the drive and the page cache serve as
# they never serve the real one: its figures, and its ratio to fio, say nothing of serving.
MODEL_TABLE_ROWS = 320_001_536


def table_notes(manifest: dict[str, Any], file_bytes: int) -> list[str]:
    """What a reader of this table's figures must know before trusting them."""
    notes = [] if compiled_helper_missing() is None else [compiled_helper_missing()]
    if manifest["total_rows"] >= MODEL_TABLE_ROWS:
        return notes
    return notes + [f"this table holds {manifest['total_rows']:,} rows, the model's {MODEL_TABLE_ROWS:,}: its "
            f"{file_bytes / (1 << 20):,.1f} MiB are few pages close together, which the drive and the page "
            f"cache serve as they never serve the real table, so these figures (and the ratio to fio) say "
            f"nothing of serving; bench the converted model's table on the drive you will serve from"]


def evict(path: str | Path) -> None:
    """Drop a file's pages from the page cache (pages mapped by a live process stay).

    Dirty pages are flushed first: DONTNEED skips them, so a just-written file would stay warm.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def cached_fraction(path: str | Path) -> float | None:
    """Share of a file's pages in the page cache (mincore over a fresh mapping); None if unknown."""
    size = os.path.getsize(path)
    if _MINCORE is None or size == 0:
        return None
    descriptor = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(descriptor)
    try:
        vector = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
        view = np.frombuffer(mapping, dtype=np.uint8, count=1)
        result = _MINCORE(view.ctypes.data, size, vector.ctypes.data)
        del view
        return None if result else float(np.mean(vector & 1))
    finally:
        mapping.close()


def fio_random_read(path: str | Path, seconds: float = 8, queue_depth: int = 64,
                    block_size: int = 4096, region_bytes: int | None = None) -> dict[str, Any] | None:
    """fio's direct random-read rate on `path` (read-only); None when fio is not installed.

    New random offsets each run: fio's default reads the same sequence every run (whatever its
    seed), which a disk with a cache of its own (a virtual disk's host) serves from that cache from
    the second run on. `region_bytes` keeps the reads within the file's first bytes. The run's
    time goes to fio in milliseconds: fio rounds seconds to whole ones, and refuses 0.
    """
    fio = shutil.which("fio")
    if fio is None or seconds <= 0:
        return None
    command = [fio, "--name=ple-prep-bench", f"--filename={path}", "--readonly", "--rw=randread",
               f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1",
               "--randrepeat=0", *([f"--size={region_bytes}"] if region_bytes else []),
               f"--runtime={max(1, round(seconds * 1000))}ms", "--time_based", "--output-format=json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BadInput(f"fio failed on {path}: {done.stderr.strip().splitlines()[-1:]}")
    read = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]["read"]
    return {"iops": round(read["iops"]), "queue_depth": queue_depth, "block_size": block_size,
            "mean_latency_us": round(read["clat_ns"]["mean"] / 1e3, 1),
            "command": " ".join(command)}


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def time_requests(gather: Callable[[np.ndarray], Any], requests: list[np.ndarray],
                  before_each: Callable[[], None] | None = None) -> dict[str, Any]:
    """Time `gather` on each request: p50/p99 seconds, rows/s, distinct rows, major faults.

    `cpu_p50_us` is the calling thread's CPU time (user and system): on a shared host it leaves
    out the time other processes held the cores, which wall time cannot.
    """
    seconds, cpu_seconds, faults = [], [], 0
    for ids in requests:
        if before_each is not None:
            before_each()
        faults_before = major_faults()
        started, cpu_started = time.perf_counter(), time.thread_time()
        gather(ids)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.thread_time() - cpu_started)
        faults += major_faults() - faults_before
    total_rows = sum(len(ids) for ids in requests)
    distinct = sum(len(np.unique(ids)) for ids in requests)
    return {"requests": len(requests), "rows_per_request": round(total_rows / len(requests), 1),
            "distinct_rows_per_request": round(distinct / len(requests), 1),
            "p50_us": round(float(np.percentile(seconds, 50)) * 1e6, 1),
            "p99_us": round(float(np.percentile(seconds, 99)) * 1e6, 1),
            "cpu_p50_us": round(float(np.percentile(cpu_seconds, 50)) * 1e6, 1),
            "rows_per_s": round(total_rows / sum(seconds)),
            "distinct_rows_per_s": round(distinct / sum(seconds)),
            "major_faults": faults}


def _requests(row_ids: np.ndarray, tokens: int, count: int, first_row: int,
              stop_row: int) -> list[np.ndarray]:
    """`count` requests of `tokens` consecutive tokens each, keeping the rows this file holds."""
    requests = []
    for index in range(count):
        ids = row_ids[index * tokens:(index + 1) * tokens].reshape(-1)
        requests.append(ids[(ids >= first_row) & (ids < stop_row)])
    return requests


def run_bench(path: str | Path, *, prefill_requests: int = 4, decode_requests: int = 500,
              fio_seconds: float = 8, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Cold and warm gathers of real-text requests on the table at `path`, with fio beside them."""
    path = Path(path)
    say = progress or (lambda message: None)
    with open_table(path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        first_row, stop_row = table.row_range
        # The advice window applies to the mapped read path only (the cold gathers' when O_DIRECT is
        # refused, and the warm ones'); the direct path takes none.
        window = {"window_pages": table.window_pages, "window_bytes": table.window_bytes}
        notes = table_notes(table.manifest, path.stat().st_size)
    from .realtext import real_text_row_ids

    say("tokenising real text")
    longest = max(prefill_requests * PREFILL_TOKENS, decode_requests * max(DECODE_TOKENS))
    row_ids = real_text_row_ids(spec, longest)
    prefill = _requests(row_ids, PREFILL_TOKENS, prefill_requests, first_row, stop_row)
    decodes = {tokens: _requests(row_ids, tokens, decode_requests, first_row, stop_row)
               for tokens in DECODE_TOKENS}
    results: dict[str, Any] = {"table": str(path), "file_bytes": path.stat().st_size, **window}

    say("cold prefill chunks")
    table = None

    def reopen_cold() -> None:
        nonlocal table
        if table is not None:
            table.close()
        evict(path)
        table = open_table(path)

    reopen_cold()
    # One untimed gather first pages in the code a gather runs (the helper's, numpy's): a library
    # page the kernel dropped would cost the first cold request a disk read that is not the table's.
    table.gather(prefill[0])
    reopen_cold()
    results["read_path"] = table.read_path
    results["read_path_note"] = table.read_path_note
    results["notes"] = notes
    results["cached_after_evict"] = cached_fraction(path)
    results["cold_prefill"] = time_requests(lambda ids: table.gather(ids), prefill, reopen_cold)
    reopen_cold()
    results["cold_decode_16"] = time_requests(lambda ids: table.gather(ids), decodes[1][:100])
    say("warm requests")
    # Warm means the rows in the page cache, which only the mapped read path fills.
    table.close()
    table = open_table(path, read_path="mapped")
    for ids in prefill + decodes[1] + decodes[4]:
        table.gather(ids)
    results["warm_prefill"] = time_requests(lambda ids: table.gather(ids), prefill)
    for tokens in DECODE_TOKENS:
        results[f"warm_decode_{tokens * 16}"] = time_requests(lambda ids: table.gather(ids),
                                                              decodes[tokens])
    table.close()
    evict(path)
    say("fio random reads")
    results["fio"] = fio_random_read(path, fio_seconds)
    if results["fio"] is not None:
        results["cold_vs_fio"] = round(results["cold_prefill"]["distinct_rows_per_s"]
                                       / results["fio"]["iops"], 3)
    return results
