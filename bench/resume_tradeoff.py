"""Is `convert --resume` worth it? A real kill-and-resume against a full rerun, and what the
progress journal costs a convert that is never killed.

A `ple-prep convert` process is killed once its journal lists half of the table's checksum blocks;
then `convert --resume` and a full `convert --force` are timed, the source and output files' pages
dropped from the page cache (posix_fadvise) before each. Pairs are repeated and interleaved because
the host is noisy; each pair's ratio is printed. The journal's cost: in-process converts with and
without the per-block fsync and journal line, interleaved.

    PYTHONPATH=. python bench/resume_tradeoff.py /work/bigdata/issue6 --base 400000 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ple_prep.converters import open_source
from ple_prep.offline import writer
from ple_prep.offline.writer import WriteOptions  # noqa: E402
from ple_prep.tools.benchmark import evict
from ple_prep.tools.fixtures import make_checkpoint


def kill_and_resume(model: Path, out: Path, blocks: int) -> tuple[float, float, int]:
    """Kill a convert at half its blocks; (resume seconds, full rerun seconds, blocks it had)."""
    command = [sys.executable, "-m", "ple_prep", "convert", "--model", str(model), "--out", str(out), "-q"]
    for path in (out, out.with_name(out.name + ".json")):
        path.unlink(missing_ok=True)
    process = subprocess.Popen(command)
    journal = out.with_name(f".{out.name}.progress.{process.pid}.partial")
    while process.poll() is None:
        if journal.exists() and journal.read_bytes().count(b"\n") >= blocks // 2 + 1:
            break
        time.sleep(0.005)
    process.kill()
    process.wait()
    kept = journal.read_bytes().count(b"\n") - 1
    for path in (*model.glob("*.safetensors"), out.with_name(f".{out.name}.{process.pid}.partial")):
        evict(path)
    started = time.perf_counter()
    subprocess.run(command + ["--resume"], check=True)
    resume_seconds = time.perf_counter() - started
    for path in (*model.glob("*.safetensors"), out):
        evict(path)
    started = time.perf_counter()
    subprocess.run(command + ["--force"], check=True)
    return resume_seconds, time.perf_counter() - started, kept


def timed_convert(model: Path, out: Path, journal: bool) -> float:
    write_chunk = writer._write_chunk
    if not journal:
        writer._write_chunk = lambda descriptor, pages, _journal, _block: writer.write_all(descriptor, pages)
    try:
        for path in model.glob("*.safetensors"):
            evict(path)
        with open_source(model) as source:
            started = time.perf_counter()
            writer.convert(source, out, WriteOptions(force=True))
            return time.perf_counter() - started
    finally:
        writer._write_chunk = write_chunk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--base", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = args.folder / f"fp8-base{args.base}"
    if not model.exists():
        make_checkpoint(model, "fp8", base=args.base)
    out = args.folder / "resume-tradeoff.bin"
    with_journal, without_journal = [], []
    for _ in range(args.repeat):
        with_journal.append(timed_convert(model, out, True))
        without_journal.append(timed_convert(model, out, False))
    blocks = len(json.loads(out.with_name(out.name + ".json").read_text())["checksums"]["blocks"])
    pairs = [kill_and_resume(model, out, blocks) for _ in range(args.repeat)]
    print(json.dumps({
        "file_gib": round(out.stat().st_size / 2**30, 3), "blocks": blocks,
        "convert_s_with_journal": [round(s, 2) for s in with_journal],
        "convert_s_without_journal": [round(s, 2) for s in without_journal],
        "journal_cost_median_ratio": round(statistics.median(
            w / o for w, o in zip(with_journal, without_journal)), 3),
        "killed_after_blocks": [kept for _, _, kept in pairs],
        "resume_s": [round(r, 2) for r, _, _ in pairs], "rerun_s": [round(f, 2) for _, f, _ in pairs],
        "resume_over_rerun_median": round(statistics.median(r / f for r, f, _ in pairs), 3),
    }, indent=2))
    out.unlink()
    out.with_name(out.name + ".json").unlink()


if __name__ == "__main__":
    main()
