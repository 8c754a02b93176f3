"""Where a step's device half should stop going through the step kernels: FULL-graph steps of 16 to
16,384 ids (1 to 1,024 tokens), warm, the step kernels against the side stream and the copy engine.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000
    python bench/step_kernel_crossover.py /tmp/ple.bin         # on a GPU, the compiled helper built

For each size two StepLookups over the same warm table (`read_path="mapped"`, every page cached),
one taking every step of that size through the step kernels (runtime/native/step_kernels.cu), one
through the side stream (steps.KERNEL_MAX_IDS set at construction), each in the proxy step of
bench/vllm_full_graph.py (new real-text ids each replay, `--layer-ms` of other work), the two graphs
alternating in blocks. Reports each side's p50 and p90 step time, their ratios (kernels over side
stream), and whether every step's values equal `Table.values`, poisoned buffers included.
Prints JSON (also written to --out).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vllm_full_graph as full_graph  # noqa: E402  (bench/, beside this file)
from gpu_bench import OtherWork  # noqa: E402  (bench/, beside this file)

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.device import StepLookup, steps  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

SIZES = (16, 64, 256, 512, 1024, 2048, 4096, 16384)


def lookup_with(table, resident: int, kernel_max_ids: int) -> StepLookup:
    """A StepLookup whose steps of up to `kernel_max_ids` ids go through the step kernels."""
    default, steps.KERNEL_MAX_IDS = steps.KERNEL_MAX_IDS, kernel_max_ids
    try:
        return StepLookup(table, device="cuda", resident_bytes=resident, max_ids=max(SIZES))
    finally:
        steps.KERNEL_MAX_IDS = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=1000, help="replays of each side at each size")
    parser.add_argument("--layer-ms", type=float, default=1.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    subprocess.run(["cat", str(args.table)], stdout=subprocess.DEVNULL, check=True)  # every page cached
    table = open_table(args.table, read_path="mapped", host_cache_bytes=0)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    row_ids = real_text_row_ids(spec, 200 * max(SIZES) // 16, part=0, parts=2)
    resident = int(args.resident_fraction * table.num_rows * table.row_bytes)
    kernels = lookup_with(table, resident, max(SIZES))
    side = lookup_with(table, resident, 0)
    if kernels.kernel_max_ids < max(SIZES) or side.kernel_max_ids:
        sys.exit(f"error: the step kernels are not loaded here (kernel_max_ids {kernels.kernel_max_ids})")
    other = OtherWork(args.layer_ms)
    report = {"table": str(args.table), "rows": table.num_rows, "device": torch.cuda.get_device_name(),
              "compiled_helper": table.compiled, "other_work_ms": round(other.ms, 3),
              "default_kernel_max_ids": steps.KERNEL_MAX_IDS, "sizes": {}}
    for ids_count in SIZES:
        tokens = ids_count // 16
        starts = np.linspace(0, len(row_ids) - tokens, 200).astype(np.int64)
        requests = [row_ids[k:k + tokens] for k in starts]
        through_kernels = full_graph.lookup_graph(kernels, full_graph.pool_of(requests), other)
        through_side = full_graph.lookup_graph(side, full_graph.pool_of(requests), other)
        mine, theirs, _ = full_graph.alternate(through_kernels, through_side, args.steps, 100)
        kernels.check()
        side.check()
        report["sizes"][ids_count] = {
            **full_graph.side_by_side(mine, theirs, ("kernels", "side_stream")),
            "bit_exact": full_graph.exact_history(table, through_kernels, requests, min(len(requests), args.steps))
            and full_graph.exact_history(table, through_side, requests, min(len(requests), args.steps)),
            "exact_poisoned": full_graph.exact_replays(table, kernels, through_kernels, requests[:20])
            and full_graph.exact_replays(table, side, through_side, requests[:20])}
        print(ids_count, json.dumps(report["sizes"][ids_count]), flush=True, file=sys.stderr)
    kernels.close()
    side.close()
    table.close()
    full_graph.print_report(report, args.out)


if __name__ == "__main__":
    main()
