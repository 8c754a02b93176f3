"""Cold 4,096-token chunks: StepLookup's own reads (CPU device) at 64 and 512 in flight against the
eager EmbeddingSource (the runtime's DirectReader), the file evicted before each, sides alternating.

    python bench/synthetic.py /tmp/t.bin --base 500000 --profile-tokens 300000
    python bench/step_read_depth.py /tmp/t.bin
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import EmbeddingSource, open_table  # noqa: E402
from ple_prep.runtime.device import steps  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

path = sys.argv[1]
table = open_table(path, read_path="direct", host_cache_bytes=0)
spec = NgramSpec.from_json(table.manifest["ngram"])
ids = real_text_row_ids(spec, 4096 * 8, part=0, parts=2)
chunks = [ids[i * 4096:(i + 1) * 4096].reshape(-1).copy() for i in range(8)]
resident = int(0.05 * table.num_rows * table.row_bytes)
sides = {}
for depth in (64, 512):
    steps.READ_DEPTH = depth
    sides[f"step_lookup_{depth}"] = steps.StepLookup(table, device="cpu", resident_bytes=resident, max_ids=4096 * 16)
sides["eager"] = EmbeddingSource(table, device="cpu", resident_bytes=resident, max_ids=4096 * 16)
times = {name: [] for name in sides}
for round_ in range(2):
    for k, chunk in enumerate(chunks):
        order = list(sides) if (k + round_) % 2 == 0 else list(sides)[::-1]
        for name in order:
            evict(path)
            began = time.perf_counter()
            sides[name].start(torch.from_numpy(chunk))
            sides[name].finish()
            times[name].append(time.perf_counter() - began)
print(json.dumps({name: {"p50_ms": round(float(np.median(t)) * 1e3, 1), "n": len(t)} for name, t in times.items()}))
for name in sides:
    if name.startswith("step"):
        print(name, sides[name].stats())
