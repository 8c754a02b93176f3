"""Profile throughput from token ids (target: at least 1M tokens/s on this 2-core machine).

Run: flock /tmp/ple-bench.lock python bench/profile_throughput.py

Tokens: both halves of bench/real_corpus.py (real documents, one request each). Three paths, side
by side in one run:
- library: `Profiler.add_request` on in-memory arrays (hash, count, finish);
- npy files: `profile_files` on one .npy per document (reading, sha256 of every input, hashing);
- cli: `python -m ple_prep profile --prompts *.npy --out P` end to end (interpreter start, the
  checkpoint's spec, writing the zstd profile), against the fixture checkpoint (same hash rules;
  only `ngram_vocab_size_base` differs, which changes no per-token work).
Tokens per second is total tokens over wall time, best of REPEATS.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_corpus  # noqa: E402

from ple_prep.converters import read_spec  # noqa: E402
from ple_prep.offline.profile import Profiler, profile_files  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402

WORK = Path("/work/bigdata/issue3/throughput")
REPEATS = 3


def best_seconds(run) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    corpus = real_corpus.load()
    requests = [r.astype(np.int64) for half in ("profile", "evaluation")
                for r in real_corpus.requests(*corpus[half])]
    tokens = sum(len(r) for r in requests)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    checkpoint = make_checkpoint(WORK / "ckpt", "fp8", num_shards=4)
    spec = read_spec(checkpoint)
    files = []
    for index, request in enumerate(requests):
        path = WORK / "npy" / f"{index:05d}.npy"
        path.parent.mkdir(exist_ok=True)
        np.save(path, request.astype(np.int32), allow_pickle=False)
        files.append(path)

    def library() -> None:
        profiler = Profiler(spec)
        for request in requests:
            profiler.add_request(request)
        profiler.finish(model="bench", tokenizer_sha256=None, inputs=[])

    def npy_files() -> None:
        profile_files(checkpoint, files, spec=spec)

    def cli() -> None:
        subprocess.run([sys.executable, "-m", "ple_prep", "profile", "--model", str(checkpoint),
                        "--prompts", *map(str, files), "--out", str(WORK / "p.prof"), "--force",
                        "--quiet"], check=True, cwd=Path(__file__).resolve().parent.parent)

    results = {}
    for name, run in (("library", library), ("npy_files", npy_files), ("cli", cli)):
        seconds = best_seconds(run)
        results[name] = {"seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds)}
    print(json.dumps({"tokens": tokens, "requests": len(requests), "repeats": REPEATS,
                      "profile_bytes": (WORK / "p.prof").stat().st_size, **results}, indent=2))
    shutil.rmtree(WORK)


if __name__ == "__main__":
    main()
