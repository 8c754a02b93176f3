"""Profile throughput from token ids, one process against every core (target: 5M tokens/s end to
end on this host).

Run: flock /tmp/ple-bench.lock python bench/profile_throughput.py

Tokens: both halves of bench/real_corpus.py (real documents, one request each). Paths, side by
side in one run, each REPEATS times in alternating order (the host is shared: the best of each):
- library: `Profiler.add_request` on in-memory arrays (hash, count, finish), one process;
- npy files: `profile_files` on one .npy per document (reading, sha256 of every input, hashing),
  with `workers=1` and with every core;
- cli: `python -m ple_prep profile --prompts *.npy --out P` end to end (interpreter start, the
  checkpoint's spec, writing the zstd profile) with `--workers 1` and by default (every core),
  against the fixture checkpoint (same hash rules; only `ngram_vocab_size_base` differs, which
  changes no per-token work).
Tokens per second is total tokens over wall time. The profiles of one worker and of all are
checked to be the same bytes.
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
from ple_prep.offline.profile_pool import default_workers  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402

WORK = Path("/work/bigdata/issue3/throughput")
REPEATS = 3


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

    def npy_files(workers: int):
        return lambda: profile_files(checkpoint, files, spec=spec, workers=workers)

    def cli(workers: int | None):
        option = [] if workers is None else ["--workers", str(workers)]
        out = WORK / f"p{workers or 'all'}.prof"
        return lambda: subprocess.run([sys.executable, "-m", "ple_prep", "profile", "--model", str(checkpoint),
                                       "--prompts", *map(str, files), "--out", str(out), "--force", "--quiet",
                                       *option], check=True, cwd=Path(__file__).resolve().parent.parent)

    paths = {"library": library, "npy_files_1_worker": npy_files(1),
             f"npy_files_{default_workers()}_workers": npy_files(default_workers()),
             "cli_1_worker": cli(1), "cli_default": cli(None)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for repeat in range(REPEATS):
        for name in (list(paths) if repeat % 2 == 0 else list(paths)[::-1]):
            started = time.perf_counter()
            paths[name]()
            times[name].append(round(time.perf_counter() - started, 2))
    assert (WORK / "p1.prof").read_bytes() == (WORK / "pall.prof").read_bytes()
    results = {name: {"seconds": values, "best_tokens_per_second": round(tokens / min(values))}
               for name, values in times.items()}
    print(json.dumps({"tokens": tokens, "requests": len(requests), "repeats": REPEATS,
                      "workers": default_workers(), "profile_bytes": (WORK / "pall.prof").stat().st_size,
                      **results}, indent=2))
    shutil.rmtree(WORK)


if __name__ == "__main__":
    main()
