"""The host cache's memory inside a memory cgroup: serving with the cache stays within budget + overhead.

    python bench/host_cache_memory_bench.py /work/scratch/cache/ple-6g-placed.bin

A child process serves real-text traffic from the table with open_table's defaults: cold gathers of
4,096-token chunks (their 16 rows a token), each chunk gathered twice, a whole-request read-ahead
of 16 chunks followed by their gathers, and 3,000 one-token gathers; then it fills the cache past
its budget with more chunks. It runs three times, each in a fresh cgroup v1 memory group:
1. with the host cache off (`host_cache_bytes=0`), no limit: the process's own baseline;
2. with the default cache, no limit: its peak usage beside the baseline;
3. with the same budget (given: under a limit the default shrinks to an eighth of it), limited to
   the baseline's peak + the budget + OVERHEAD_BYTES: the run must finish (no OOM kill) with the
   same rows (a digest of every gather).
Reports each run's peak cgroup usage (memory.max_usage_in_bytes), peak RSS, failcnt and seconds.
Needs root and /sys/fs/cgroup/memory. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
# What serving with the cache may use beyond the budget: a request's temporaries (its missed rows
# and their slots, twice a 65,536-row request's rows at most) and the read-ahead's batch buffer.
OVERHEAD_BYTES = 64 << 20


def child(path: Path, host_cache_bytes: int | None) -> dict:
    from ple_prep.ngram import NgramSpec
    from ple_prep.runtime import open_table
    from ple_prep.tools.realtext import real_text_row_ids

    options = {} if host_cache_bytes is None else {"host_cache_bytes": host_cache_bytes}
    started = time.perf_counter()
    digest = hashlib.blake2b(digest_size=16)
    with open_table(path, **options) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        ids = real_text_row_ids(spec, 4096 * 48, part=0, parts=2)
        chunks = [ids[k * 4096:(k + 1) * 4096] for k in range(48)]
        for chunk in chunks[:8]:
            for _ in range(2):
                digest.update(table.gather(chunk).tobytes())
        job = table.read_ahead(chunks[8:24])
        for chunk in chunks[8:24]:
            digest.update(table.gather(chunk).tobytes())
        if job is not None:
            job.wait(120)
        for token in ids[:3000]:
            digest.update(table.gather(token).tobytes())
        for chunk in chunks[24:]:
            digest.update(table.gather(chunk).tobytes())
        tier = table.host_cache
        cache = None if tier is None else {"budget_bytes": tier.cache.budget_bytes, "bytes": tier.cache.bytes,
                                           "hits": tier.cache.hits, "misses": tier.cache.misses,
                                           "rows_read": tier.rows_read, "read_ahead_rows": job.rows_read}
    return {"digest": digest.hexdigest(), "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cache": cache}


def capped(path: Path, host_cache_bytes: int | None, limit: int | None, name: str) -> dict:
    group = CGROUP_ROOT / f"ple-prep-cache-bench-{os.getpid()}-{name}"
    group.mkdir()
    try:
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit))

        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        arguments = [sys.executable, __file__, str(path), "--child"]
        if host_cache_bytes is not None:
            arguments += ["--host-cache-bytes", str(host_cache_bytes)]
        done = subprocess.run(arguments, capture_output=True, text=True, preexec_fn=enter)
        oom = next(int(line.split()[1]) for line in (group / "memory.oom_control").read_text().splitlines()
                   if line.startswith("oom_kill "))
        result = json.loads(done.stdout) if done.returncode == 0 else {"returncode": done.returncode,
                                                                          "stderr": done.stderr[-500:]}
        result |= {"limit_bytes": limit, "oom_kills": oom,
                   "max_usage_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
                   "failcnt": int((group / "memory.failcnt").read_text())}
        return result
    finally:
        group.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host-cache-bytes", type=int, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.table, args.host_cache_bytes)))
        return
    baseline = capped(args.table, 0, None, "off")
    cached = capped(args.table, None, None, "on")
    budget = cached["cache"]["budget_bytes"]
    limit = baseline["max_usage_bytes"] + budget + OVERHEAD_BYTES
    # The budget given: the default would shrink under the lower limit (an eighth of it).
    limited = capped(args.table, budget, limit, "limited")
    report = {"table": str(args.table), "budget_bytes": budget, "overhead_bytes": OVERHEAD_BYTES,
              "without_cache": baseline, "with_cache": cached, "with_cache_limited": limited,
              "cache_usage_beyond_baseline_bytes": cached["max_usage_bytes"] - baseline["max_usage_bytes"],
              "within_budget_and_overhead": cached["max_usage_bytes"] <= limit and limited.get("oom_kills") == 0
              and limited.get("digest") == baseline["digest"] == cached["digest"]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
