"""The table's mapped footprint over a run of real-text requests, with and without a budget.

    flock /tmp/ple-bench.lock python bench/footprint_bench.py /work/bigdata/disk/ple-6g.bin

A fresh child process per variant, each in its own cgroup v1 memory group (no limit: only its usage
is read; root needed), gathers `--requests` consecutive prefill chunks of `--tokens` real-text tokens
from a cold start, one after another, as a server does. After each request: the child's RssFile and
page tables (VmPTE, /proc/self/status) and the cgroup's usage (page cache it charged included).
Variants: the mapped read path without a budget, with `--budget-mib` and MADV_DONTNEED, with it and
MADV_PAGEOUT, and the direct read path (the default). Prints one JSON object; BENCHMARKS.md records it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memcap import cgroups_unavailable, measure_footprint  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget-mib", type=int, default=64)
    args = parser.parse_args()
    reason = cgroups_unavailable()
    if reason:
        raise SystemExit(reason)
    with open_table(args.table) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
    row_ids = real_text_row_ids(spec, args.requests * args.tokens)
    requests = [row_ids[i * args.tokens:(i + 1) * args.tokens].reshape(-1) for i in range(args.requests)]
    budget = args.budget_mib << 20
    variants = {
        "mapped, no budget": {"read_path": "mapped"},
        f"mapped, budget {args.budget_mib} MiB, dontneed": {"read_path": "mapped", "mapped_budget_bytes": budget},
        f"mapped, budget {args.budget_mib} MiB, pageout": {"read_path": "mapped", "mapped_budget_bytes": budget,
                                                          "budget_advice": "pageout"},
        "direct (default read path)": {},
    }
    report = {"table": str(args.table), "requests": args.requests, "tokens_per_request": args.tokens,
              "ids_per_request": len(requests[0]), "variants": {}}
    for name, options in variants.items():
        result = measure_footprint(args.table, requests, options=options)
        steps = result["steps"]
        report["variants"][name] = {
            "options": options, "read_path": result["read_path"],
            "p50_ms": round(float(np.median([s["seconds"] for s in steps])) * 1e3, 1),
            "total_s": round(sum(s["seconds"] for s in steps), 2),
            "rss_file_mib_max": round(max(s["rss_file_kib"] for s in steps) / 1024, 1),
            "rss_file_mib_last": round(steps[-1]["rss_file_kib"] / 1024, 1),
            "vm_pte_kib_max": max(s["vm_pte_kib"] for s in steps),
            "cgroup_usage_mib_max": round(max(s["usage_bytes"] for s in steps) / 2**20, 1),
            "cgroup_usage_mib_last": round(steps[-1]["usage_bytes"] / 2**20, 1),
            "releases": result["releases"],
            "release_ms_p50": round(float(np.median(result["release_seconds"])) * 1e3, 3)
            if result["release_seconds"] else None,
            "rss_file_mib_each": [round(s["rss_file_kib"] / 1024, 1) for s in steps]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
