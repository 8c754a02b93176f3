"""Conversion throughput and memory, side by side with `cat` copying the same source files.

Builds (once) an FP8 fixture checkpoint whose table is at least 4 GiB, then, for each round,
copies the checkpoint's safetensors files with `cat` and converts it with `ple-prep convert`, both
from a cold page cache to a fresh file on the same disk, both fsynced, alternating which goes first.
`cat` (coreutils 9) copies with copy_file_range, inside the kernel: the fastest copy there is.
A round's ratio is copy seconds / convert seconds (the same source files, back to back); the
summary gives the median and the minimum over rounds, since a shared host is noisy. Peak RSS is
the convert process's own (os.wait4 on the child). The fixture is generated one file at a time,
so building it needs memory for one file (--files). Run it alone:

    flock /tmp/ple-bench.lock python bench/bench_convert.py --dir /work/bigdata/issue2

Targets: convert throughput >= 0.8x the copy's, peak RSS < 512 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# This checkout's package, not whichever ple_prep is installed.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ple_prep.converters.config import load_config  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402

RSS_TARGET_MIB = 512
RATIO_TARGET = 0.8


def build_checkpoint(folder: Path, base: int, num_files: int) -> Path:
    checkpoint = folder / f"fp8-base{base}"
    if (checkpoint / "config.json").exists():
        if load_config(checkpoint)["ngram_vocab_size_base"] == base:
            return checkpoint
    started = time.perf_counter()
    # In a child: this process stays small, and a forked child's peak RSS (as wait4 reports it)
    # starts from its parent's, so a big parent would inflate the convert figure.
    subprocess.run([sys.executable, "-c", "import sys; from ple_prep.tools.fixtures import make_checkpoint; "
                    f"make_checkpoint(sys.argv[1], 'fp8', base={base}, num_shards=128, "
                    f"num_files={num_files})", str(checkpoint)], cwd=REPO, check=True)
    print(f"built {checkpoint} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return checkpoint


def run_timed(command: list[str], stdout=subprocess.DEVNULL,
              min_free: tuple[Path, int] | None = None, cwd: Path = REPO) -> tuple[float, int, bytes]:
    """(seconds, peak RSS bytes, stdout) of one child process, measured on that child alone, run in
    `cwd` (`python -m ple_prep` there runs that checkout's). With `min_free` (folder, bytes), the
    child is killed when the folder's disk has less free space (the disk is shared: a benchmark
    must never fill it)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=stdout, stderr=subprocess.PIPE, cwd=cwd)
    done, starved = threading.Event(), threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            if shutil.disk_usage(min_free[0]).free < min_free[1]:
                starved.set()
                process.kill()
                return

    watcher = threading.Thread(target=watch, daemon=True) if min_free else None
    if watcher is not None:
        watcher.start()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    done.set()
    if starved.is_set():
        raise SystemExit(f"{command[0]} killed: less than {min_free[1] / 2**30:.1f} GiB free on {min_free[0]}")
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read()
    if process.returncode:
        raise SystemExit(f"{command[0]} failed ({process.returncode}): {error.decode()}")
    return seconds, usage.ru_maxrss * 1024, error


def copy_once(sources: list[Path], out: Path) -> dict[str, float]:
    for path in sources:
        evict(path)
    with open(out, "wb") as handle:
        started = time.perf_counter()
        _, rss, _ = run_timed(["cat", *map(str, sources)], stdout=handle)
        os.fsync(handle.fileno())  # as convert fsyncs its output before it exits
        seconds = time.perf_counter() - started
    evict(out)
    out.unlink()
    return {"seconds": seconds, "peak_rss": rss}


def convert_once(checkpoint: Path, sources: list[Path], out: Path) -> dict[str, float]:
    for path in sources:
        evict(path)
    command = [sys.executable, "-m", "ple_prep", "convert", "--model", str(checkpoint),
               "--out", str(out), "--force", "--quiet"]
    seconds, rss, _ = run_timed(command)  # convert fsyncs its files before it exits
    for path in (out, out.with_name(out.name + ".json")):
        evict(path)
        path.unlink()
    return {"seconds": seconds, "peak_rss": rss}


def compare_rounds(model: Path, sources: list[Path], table_bytes: int, folder: Path,
                   count: int) -> dict:
    """`count` paired rounds: `cat` of `sources` and a convert of `model`, alternating which goes
    first, both writing into `folder`; returns the summary (shared with bench_convert_gguf.py)."""
    source_bytes = sum(p.stat().st_size for p in sources)
    rounds = []
    for index in range(count):
        steps = [("copy", lambda: copy_once(sources, folder / "copy.bin")),
                 ("convert", lambda: convert_once(model, sources, folder / "table.bin"))]
        result = {}
        for name, step in (steps if index % 2 == 0 else steps[::-1]):
            result[name] = step()
        result["ratio"] = result["copy"]["seconds"] / result["convert"]["seconds"]
        rounds.append(result)
        print(f"round {index}: copy {source_bytes / result['copy']['seconds'] / 2**20:.0f} MiB/s, "
              f"convert {table_bytes / result['convert']['seconds'] / 2**20:.0f} MiB/s, "
              f"ratio {result['ratio']:.2f}, convert peak RSS "
              f"{result['convert']['peak_rss'] / 2**20:.0f} MiB", file=sys.stderr)

    ratios = [r["ratio"] for r in rounds]
    peak_rss = max(r["convert"]["peak_rss"] for r in rounds)
    summary = {
        "table_bytes": table_bytes,
        "source_file_bytes": source_bytes,
        "rounds": rounds,
        "copy_mib_per_s_median": statistics.median(
            source_bytes / r["copy"]["seconds"] / 2**20 for r in rounds),
        "convert_mib_per_s_median": statistics.median(
            table_bytes / r["convert"]["seconds"] / 2**20 for r in rounds),
        # Paired: each round's copy and convert ran back to back on the same files.
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "convert_peak_rss_mib": peak_rss / 2**20,
        "meets_targets": statistics.median(ratios) >= RATIO_TARGET and peak_rss < RSS_TARGET_MIB << 20,
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="Folder for the big files.")
    parser.add_argument("--base", type=int, default=1_750_000,
                        help="ngram_vocab_size_base of the fixture (1,750,000: a 4.2 GiB table).")
    parser.add_argument("--files", type=int, default=16, help="safetensors files in the fixture.")
    parser.add_argument("--rounds", type=int, default=5, help="Copy/convert pairs, alternating order.")
    parser.add_argument("--keep", action="store_true", help="Keep the fixture checkpoint afterwards.")
    args = parser.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(args.dir, args.base, args.files)
    spec = NgramSpec.from_config(load_config(checkpoint))
    table_bytes = spec.rows_stored * 160
    sources = sorted(checkpoint.glob("*.safetensors"))
    os.sync()

    summary = compare_rounds(checkpoint, sources, table_bytes, args.dir, args.rounds)
    summary["rows"] = spec.rows_stored
    print(json.dumps(summary, indent=2))
    if not args.keep:
        for path in [*sources, *checkpoint.iterdir()]:
            path.unlink(missing_ok=True)
        checkpoint.rmdir()


if __name__ == "__main__":
    main()
