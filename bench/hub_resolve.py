"""How long `--model NAME` takes to resolve in a large Hugging Face cache (real layout, built here).

Builds REPOS model repos of FILES files each (blobs, snapshot symlinks, refs/main) under a temporary
folder, then times `resolve_model` for a full name, a bare name and a name that matches nothing,
beside `huggingface_hub.scan_cache_dir` of the same cache (which stats every file, so resolution
reads folder names and the one repo's refs instead).

    python bench/hub_resolve.py [--repos 200] [--files 100]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from support.hubcache import add_snapshot, commit_hash  # noqa: E402

from ple_prep.converters.hub import resolve_model  # noqa: E402
from ple_prep.core.errors import BadInput  # noqa: E402


def best_of(runs: int, call) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repos", type=int, default=200)
    parser.add_argument("--files", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "hub"
        started = time.perf_counter()
        for repo in range(args.repos):
            files = {f"model-{i:05d}.safetensors": f"{repo}-{i}".encode() for i in range(args.files)}
            add_snapshot(cache, f"owner{repo % 7}/Model-{repo}", commit_hash(str(repo)), files)
        print(f"built {args.repos} repos x {args.files} files in {time.perf_counter() - started:.1f} s")
        from huggingface_hub import scan_cache_dir

        def missing() -> None:
            try:
                resolve_model("No-Such-Model", cache_dir=cache)
            except BadInput:
                pass

        for label, call in (("scan_cache_dir alone", lambda: scan_cache_dir(cache)),
                            ("resolve OWNER/NAME", lambda: resolve_model("owner3/Model-3", cache_dir=cache)),
                            ("resolve bare NAME", lambda: resolve_model("Model-150", cache_dir=cache)),
                            ("resolve, no match", missing)):
            print(f"{label:24} {best_of(5, call) * 1000:8.1f} ms (best of 5)")


if __name__ == "__main__":
    main()
