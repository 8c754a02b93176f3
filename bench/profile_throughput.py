"""Profile throughput from token ids, one process against every core, this tree against an older
one side by side (target: 5M tokens/s end to end on this host).

Run: python bench/profile_throughput.py [--old-tree DIR] [--repeats N] [--work DIR]
         [--workers 1,4,16] [--copies K]

Tokens: both halves of bench/real_corpus.py (real documents, one .npy file each). Paths, each
REPEATS times in alternating order (the host is shared: best and range of each):
- library: `Profiler.add_request` on in-memory arrays (hash, count, finish), one process;
- cli: `python -m ple_prep profile --prompts *.npy --out P` end to end (interpreter start, the
  checkpoint's spec, reading and sha256 of every input, hashing, merging, writing the zstd
  profile) with `--workers 1` and by default (every core), or with each count of --workers,
  against the fixture checkpoint (same hash rules; only `ngram_vocab_size_base` differs, which
  changes no per-token work); --copies K writes every document K times (K times the tokens, for a
  machine with many cores);
- with --old-tree (a checkout of an older commit, e.g. `git worktree add /tmp/old bec157c`): the
  same two cli runs from that tree, each right after this tree's, and their ratio per round.
Tokens per second is total tokens over wall time; cpu is the user + system seconds of the run's
processes. Every profile written must be the same bytes.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import real_corpus  # noqa: E402

from ple_prep.converters import read_spec  # noqa: E402
from ple_prep.offline.profile import Profiler  # noqa: E402
from ple_prep.offline.profile_pool import default_workers  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="a checkout of an older ple-prep to run side by side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/work/bigdata/issue3/throughput"))
    parser.add_argument("--workers", help="worker counts to run the cli with, comma-separated "
                                          "(default: 1 and the default, every core)")
    parser.add_argument("--copies", type=int, default=1)
    args = parser.parse_args()
    corpus = real_corpus.load()
    requests = [r.astype(np.int64) for half in ("profile", "evaluation")
                for r in real_corpus.requests(*corpus[half])]
    tokens = sum(len(r) for r in requests) * args.copies
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    checkpoint = make_checkpoint(work / "ckpt", "fp8", num_shards=4)
    spec = read_spec(checkpoint)
    files = []
    for copy in range(args.copies):
        for index, request in enumerate(requests):
            path = work / "npy" / f"{copy:03d}-{index:05d}.npy"
            path.parent.mkdir(exist_ok=True)
            np.save(path, request.astype(np.int32), allow_pickle=False)
            files.append(path)

    def library() -> None:
        profiler = Profiler(spec)
        for _ in range(args.copies):
            for request in requests:
                profiler.add_request(request)
        profiler.finish(model="bench", tokenizer_sha256=None, inputs=[])

    def cli(tree: Path, workers: int | None, name: str):
        option = [] if workers is None else ["--workers", str(workers)]
        return lambda: subprocess.run([sys.executable, "-m", "ple_prep", "profile", "--model", str(checkpoint),
                                       "--prompts", *map(str, files), "--out", str(work / f"{name}.prof"), "--force",
                                       "--quiet", *option], check=True, cwd=tree)

    counts = [1, None] if args.workers is None else [int(n) for n in args.workers.split(",")]
    labels = [f"{n or default_workers()}_worker{'s' if (n or default_workers()) > 1 else ''}" for n in counts]
    paths = {"library": library}
    for workers, label in zip(counts, labels):
        paths[f"cli_{label}"] = cli(ROOT, workers, f"cli_{label}")
        if args.old_tree is not None:
            paths[f"old_cli_{label}"] = cli(args.old_tree.resolve(), workers, f"old_cli_{label}")
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for repeat in range(args.repeats):
        for name in (list(paths) if repeat % 2 == 0 else list(paths)[::-1]):
            before, started = _cpu_seconds(), time.perf_counter()
            paths[name]()
            wall[name].append(round(time.perf_counter() - started, 2))
            cpu[name].append(round(_cpu_seconds() - before, 2))
    written = {path.read_bytes() for path in work.glob("*.prof")}
    assert len(written) == 1, "the profiles differ"
    results = {name: {"seconds": wall[name], "cpu_seconds": cpu[name],
                      "tokens_per_second": [round(tokens / max(wall[name])), round(tokens / min(wall[name]))]}
               for name in paths}
    if args.old_tree is not None:
        for label in labels:
            results[f"speedup_{label}"] = sorted(round(old / new, 2) for new, old in
                                                 zip(wall[f"cli_{label}"], wall[f"old_cli_{label}"]))
    print(json.dumps({"tokens": tokens, "requests": len(requests) * args.copies, "repeats": args.repeats,
                      "workers": default_workers(), "profile_bytes": len(written.pop()), **results}, indent=2))
    shutil.rmtree(work)


def _cpu_seconds() -> float:
    """User + system seconds of this process and its finished children."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


if __name__ == "__main__":
    main()
