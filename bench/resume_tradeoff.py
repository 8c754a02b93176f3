"""Is `convert --resume` worth it? Time a full convert against re-reading its output.

A resume after a kill at fraction f of the table would have to re-read and check the f already
written (its CRC blocks, and its rows again for the whole-table SHA-256) before writing the rest,
so it saves at most f * (convert - reread) of a rerun's time. This measures both on one table,
cold (the files' pages dropped from the page cache with posix_fadvise before each step).

    python bench/resume_tradeoff.py /work/bigdata/issue6 --base 400000
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import zlib
from pathlib import Path

from ple_prep.converters import open_source
from ple_prep.fixtures import make_checkpoint
from ple_prep.layouts.writer import convert


def evict(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def reread(path: Path) -> float:
    """Read the whole file once, CRC-32 and SHA-256 over it: what a resume must redo for its prefix."""
    started = time.perf_counter()
    crc, digest = 0, hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        while piece := handle.read(16 << 20):
            crc = zlib.crc32(piece, crc)
            digest.update(piece)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--base", type=int, default=400_000)
    args = parser.parse_args()
    model = args.folder / f"fp8-base{args.base}"
    if not model.exists():
        make_checkpoint(model, "fp8", base=args.base)
    out = args.folder / "resume-tradeoff.bin"
    for path in model.glob("*.safetensors"):
        evict(path)
    with open_source(model) as source:
        started = time.perf_counter()
        manifest = convert(source, out, force=True)
        convert_seconds = time.perf_counter() - started
    evict(out)
    reread_seconds = reread(out)
    size = manifest["file_size"]
    per_gib = {"convert_s_per_gib": convert_seconds / (size / 2**30),
               "reread_s_per_gib": reread_seconds / (size / 2**30)}
    table_gib = 47.68 * size / (manifest["num_rows"] * manifest["row_bytes"])
    print(json.dumps({
        "file_gib": round(size / 2**30, 3), "convert_s": round(convert_seconds, 2),
        "reread_s": round(reread_seconds, 2),
        "reread_over_convert": round(reread_seconds / convert_seconds, 3),
        "full_table_convert_min": round(per_gib["convert_s_per_gib"] * table_gib / 60, 1),
        "best_resume_saving_min_at_99pct": round(
            0.99 * (per_gib["convert_s_per_gib"] - per_gib["reread_s_per_gib"]) * table_gib / 60, 1),
    }, indent=2))
    out.unlink()
    out.with_name(out.name + ".json").unlink()


if __name__ == "__main__":
    main()
