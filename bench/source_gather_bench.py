"""The writer's gather of placed rows from a checkpoint: `TableSource.gather_rows` against the
previous one-`read_rows`-per-run loop, side by side on the same ids (page cache warm).

Run: flock /tmp/ple-bench.lock python bench/source_gather_bench.py

Checkpoint: an FP8 fixture with ngram_vocab_size_base 200,000 (3.2M rows, 512 MB, 128 shards in
3 files). Ids: the hottest rows of a profile of real text (bench/real_corpus.py), in slot order,
as the writer asks for them: chunks of 102,400 rows (one 16 MiB write chunk of 4 KiB pages).
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_corpus  # noqa: E402

from ple_prep.converters import open_source  # noqa: E402
from ple_prep.offline.planner import plan_order  # noqa: E402
from ple_prep.offline.profile import Profiler  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402

WORK = Path("/work/bigdata/issue3/gather")
CHUNK_ROWS = 4096 * 25


def run_loop_gather(source, ids: np.ndarray) -> np.ndarray:
    """The previous gather: sort, then one read_rows call per run of consecutive ids."""
    out = np.empty((len(ids), source.row_bytes), dtype=np.uint8)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    for run in np.split(np.arange(len(ids)), breaks):
        first, last = int(sorted_ids[run[0]]), int(sorted_ids[run[-1]])
        out[order[run]] = source.read_rows(first, last + 1)[sorted_ids[run] - first]
    return out


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    checkpoint = make_checkpoint(WORK / "ckpt", "fp8", base=200_000, num_files=3)
    corpus = real_corpus.load()
    with open_source(checkpoint) as source:
        profiler = Profiler(source.spec)
        for request in real_corpus.requests(*corpus["profile"])[:800]:
            profiler.add_request(request)
        profile = profiler.finish(model="bench", tokenizer_sha256=None, inputs=[])
        order = plan_order(profile, source.num_rows, 25, max_placed=source.num_rows // 4).order
        chunks = [order.slot_rows[i:i + CHUNK_ROWS].astype(np.int64)
                  for i in range(0, order.num_placed, CHUNK_ROWS)]
        source.read_rows(0, source.num_rows)  # warm the page cache for both
        results = {}
        for name, gather in (("loop_per_run", lambda ids: run_loop_gather(source, ids)),
                             ("gather_rows", source.gather_rows)):
            started = time.perf_counter()
            outputs = [gather(ids) for ids in chunks]
            seconds = time.perf_counter() - started
            results[name] = {"seconds": round(seconds, 2),
                             "rows_per_second": round(order.num_placed / seconds)}
        assert all(np.array_equal(a, source.read_rows(0, source.num_rows)[ids])
                   for a, ids in zip(outputs[:2], chunks[:2]))
    print(json.dumps({"rows": order.num_placed, "chunks": len(chunks), **results,
                      "speedup": round(results["loop_per_run"]["seconds"] / results["gather_rows"]["seconds"], 1)},
                     indent=2))
    shutil.rmtree(WORK)


if __name__ == "__main__":
    main()
