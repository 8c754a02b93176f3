"""Cold 18,000-row gathers inside a memory cgroup that leaves less room than an unbounded window wants.

    flock /tmp/ple-bench.lock python bench/memory_pressure_bench.py /work/bigdata/disk/ple-6g.bin

Each gather runs in a fresh child process in a fresh cgroup v1 memory group (root needed) whose limit
(`--limit-mib`) is filled by a ballast of touched anonymous memory but for `--headroom-mib`: less
than the 70 MiB of pages an unbounded window advises for this request. Variants, alternating order
each round: the direct read path (the default), the mapped path with its default window, with an
unbounded window, and with window 0 (no advice). Prints one JSON object with each variant's rounds
and medians: major faults per distinct page read, rows/s, the cgroup's peak usage and failcnt, and
the child's RssFile after the gather; BENCHMARKS.md records it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_bench import DISTINCT_ROWS, distinct_request  # noqa: E402
from memcap import cgroups_unavailable, measure  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

VARIANTS = {
    "direct (default read path)": {},
    "mapped, default window": {"read_path": "mapped"},
    "mapped, unbounded window": {"read_path": "mapped", "window_pages": 1 << 40, "window_bytes": 1 << 50},
    "mapped, window 0": {"read_path": "mapped", "window_pages": 0},
}
KEYS = ("major_faults", "faults_per_page", "rows_per_s", "max_usage_bytes", "cgroup_failcnt", "rss_file_kib")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--limit-mib", type=int, default=512)
    parser.add_argument("--headroom-mib", type=int, default=32)
    args = parser.parse_args()
    reason = cgroups_unavailable()
    if reason:
        raise SystemExit(reason)
    with open_table(args.table) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
    ids = distinct_request(real_text_row_ids(spec, 40_000), DISTINCT_ROWS, 0)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            runs[name].append(measure(args.table, ids, limit_bytes=args.limit_mib << 20,
                                      headroom_bytes=args.headroom_mib << 20, options=VARIANTS[name]))
    first = next(s for samples in runs.values() for s in samples if not s["oom_killed"])
    report = {"table": str(args.table), "rows": DISTINCT_ROWS, "distinct_pages": first["distinct_pages"],
              "limit_bytes": first["limit_bytes"], "headroom_bytes": args.headroom_mib << 20,
              "ballast_bytes": first["ballast_bytes"], "rounds": args.rounds, "variants": {}}
    for name, samples in runs.items():
        lived = [sample for sample in samples if not sample["oom_killed"]]
        report["variants"][name] = {
            "options": VARIANTS[name], "oom_killed": len(samples) - len(lived),
            "median": {key: float(np.median([s[key] for s in lived])) for key in KEYS} if lived else None,
            "rounds": {key: [s.get(key) for s in samples] for key in KEYS}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
