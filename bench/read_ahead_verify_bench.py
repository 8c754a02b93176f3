"""A cold prompt's read-ahead with open_table's `verify_reads` against without.

    python bench/synthetic.py /tmp/ple.bin --base 2500000
    ple-prep pagesums /tmp/ple.bin
    python bench/read_ahead_verify_bench.py /tmp/ple.bin --rounds 8 [--old-tree /tmp/old]

The prompt of bench/read_ahead_gpu_bench.py (65,536 held-out real-text tokens as 16 chunks of 4,096)
read ahead into the default host cache from a cold file, nothing else running: the table opened
afresh (an empty host cache, its memory faulted in first), the file evicted, then
`Table.read_ahead(chunks)` and `wait`, timed. Each round reads it with and without verification,
the order swapped every round (a shared disk's rate moves from minute to minute). With
`--old-tree DIR` (a built checkout of older code) the older code's verified read-ahead runs in
the same rounds, in a child process importing ple_prep from DIR. After each timed read-ahead every
chunk is gathered and checked against the synthetic table's bytes (bench/synthetic.py). Prints
one JSON object: each variant's seconds and pages per second by round, and the medians of the
rounds' ratios to the unverified read-ahead.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# A child run of older code (--old-tree) imports ple_prep from that tree.
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]) if "--tree" in sys.argv else Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TREE))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from python_busy import PythonBusy  # noqa: E402
from synthetic import expected_rows  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

CHUNK_TOKENS = 4096
CHUNKS = 16


def read_ahead_cold(path: Path, chunks: list[np.ndarray], verify: bool, busy: bool) -> dict:
    """The chunks read ahead from a cold file (with `busy`, beside a PythonBusy); then every chunk's
    rows checked."""
    with open_table(path, verify_reads=verify) as table:
        if table.host_cache is None:
            raise SystemExit(f"error: {path}: no host cache on the {table.read_path} read path")
        populating = table.host_cache.cache.populating
        if populating is not None:  # faulted in, as a server has it long before its first prompt
            populating.join()
        evict(path)
        with PythonBusy() if busy else contextlib.nullcontext():
            began = time.perf_counter()
            job = table.read_ahead(chunks)
            job.wait()
            seconds = time.perf_counter() - began
        error = job.error
        job.cancel()
        exact = error is None and all(np.array_equal(table.gather(chunk), expected_rows(chunk)) for chunk in chunks)
        return {"seconds": round(seconds, 4), "pages": job.pages_read, "rows": job.rows_read,
                "pages_per_s": round(job.pages_read / seconds), "error": repr(error), "exact": exact}


def old_tree_run(old_tree: Path, path: Path, ids_file: Path, busy: bool) -> dict:
    """The older code's verified read-ahead (a child process importing ple_prep from `old_tree`)."""
    done = subprocess.run([sys.executable, __file__, str(path), "--tree", str(old_tree), "--child-ids", str(ids_file),
                           *(["--busy"] if busy else [])], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def chunks_of(ids: np.ndarray) -> list[np.ndarray]:
    return [ids[k * CHUNK_TOKENS:(k + 1) * CHUNK_TOKENS] for k in range(CHUNKS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--old-tree", type=Path, help="a built checkout of older code to run beside this one")
    parser.add_argument("--busy", action="store_true", help="a Python thread computing beside each read-ahead")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-ids", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = args.table
    if args.child_ids is not None:
        print(json.dumps(read_ahead_cold(path, chunks_of(np.load(args.child_ids, allow_pickle=False)), True,
                                         args.busy)))
        return
    with open_table(path, read_path="mapped") as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        ids = real_text_row_ids(spec, CHUNK_TOKENS * CHUNKS, part=0, parts=2)
        report = {"table": str(path), "rows": table.num_rows, "prompt_tokens": CHUNK_TOKENS * CHUNKS, "busy": args.busy,
                  "distinct_pages": int(len(np.unique(table.slot_of(ids.reshape(-1)) // table.rows_per_page)))}
    chunks = chunks_of(ids)
    scratch = tempfile.TemporaryDirectory()
    ids_file = Path(scratch.name) / "ids.npy"
    np.save(ids_file, ids)
    variants = ("unverified", "verified") + (("verified_before",) if args.old_tree else ())
    runs: dict[str, list] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name in variants if round_index % 2 == 0 else variants[::-1]:
            if name == "verified_before":
                runs[name].append(old_tree_run(args.old_tree, path, ids_file, args.busy))
            else:
                runs[name].append(read_ahead_cold(path, chunks, name == "verified", args.busy))
    unverified = np.array([run["seconds"] for run in runs["unverified"]])
    report |= {"runs": runs, "exact": all(run["exact"] for name in variants for run in runs[name])}
    report |= {f"{name}_x_unverified_median": round(float(np.median(
        np.array([run["seconds"] for run in runs[name]]) / unverified)), 3) for name in variants[1:]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
