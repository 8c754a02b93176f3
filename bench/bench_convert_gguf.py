"""Conversion of a GGUF model of at least 4 GiB, side by side with `cat` copying the same file.

Writes (once, streaming) a qwen4exp GGUF whose joined table is at least 4 GiB (`big_gguf.py`),
then for each round copies the .gguf with `cat` and converts it with `ple-prep convert`, both from
a cold page cache (posix_fadvise DONTNEED) to a fresh file on the same disk, both fsynced,
alternating which goes first. The measuring is bench_convert.py's (compare_rounds); peak
RSS is the convert process's own. Run it alone:

    flock /tmp/ple-bench.lock python bench/bench_convert_gguf.py --dir /work/bigdata/issue5

Targets (issues 2 and 5): convert throughput >= 0.8x the copy's, peak RSS < 512 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_convert import compare_rounds  # noqa: E402
from big_gguf import write_big_gguf  # noqa: E402

from ple_prep.converters import open_source  # noqa: E402


def build_model(folder: Path, ggml_type: str, base: int) -> Path:
    model = folder / f"{ggml_type}-base{base}"
    if not (model / "model.gguf").exists():
        started = time.perf_counter()
        write_big_gguf(model, ggml_type, base)
        print(f"built {model} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="Folder for the big files.")
    parser.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0", "iq4_nl"],
                        help="GGML type of the table.")
    parser.add_argument("--base", type=int, default=None,
                        help="ngram_vocab_size_base (default: the smallest multiple of 100,000 "
                             "giving a table of at least 4 GiB).")
    parser.add_argument("--rounds", type=int, default=3, help="Copy/convert pairs, alternating order.")
    parser.add_argument("--keep", action="store_true", help="Keep the GGUF afterwards.")
    args = parser.parse_args()

    row_bytes = {"q8_0": 170, "q4_0": 90, "iq4_nl": 90}[args.type]
    # 16 heads of about `base` rows each: the table is about 16 * base * row_bytes bytes.
    base = args.base or -(-(4 << 30) // (16 * row_bytes * 100_000)) * 100_000
    args.dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.dir, args.type, base)
    with open_source(model) as source:
        table_bytes = source.num_rows * source.row_bytes
        sources = [model / f.name for f in source.files]
    os.sync()
    summary = compare_rounds(model, sources, table_bytes, args.dir, args.rounds)
    summary["ggml_type"] = args.type.upper()
    print(json.dumps(summary, indent=2))
    if not args.keep:
        for path in sources:
            path.unlink()
        model.rmdir()


if __name__ == "__main__":
    main()
