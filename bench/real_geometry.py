"""The whole offline path at one geometry, each step a `ple-prep` child timed with its peak RSS.

Run (the real geometry, 320,001,536 IQ4_NL rows: a 26.8 GiB checkpoint and a 27 GiB table):
    flock /tmp/ple-bench.lock python bench/real_geometry.py --dir /work/scratch/scale --base 20000000
1/8 of it (40,001,792 rows) with `--base 2500000`; tests/test_real_geometry.py runs a tiny one.

Steps, in order (seconds and peak RSS of each child, from os.wait4):
1. checkpoint: a qwen4exp GGUF with the joined IQ4_NL table (bench/big_gguf.py), reused when
   DIR/ckpt/model.gguf already has this geometry; beside it the tokenizer of the corpus.
2. profile: `ple-prep profile` of the profile half of bench/real_corpus.py's documents, as text
   (one JSON line a document, tokenised by the profile's workers).
3. convert: `ple-prep convert --profile` (cold page cache) against `cat` of the .gguf into a file
   on the same disk (cold, fsynced), alternating which goes first (the last round's convert goes
   last), `--rounds` pairs; ratio = copy seconds / convert seconds of a round (`totals_ratio`: of
   all rounds' seconds). The last convert's table is kept for the next steps. With `--old-tree OLD`
   (a checkout of an older commit, its compiled helper built: `git worktree add OLD COMMIT`, then
   `python setup.py build_ext --inplace` there), that checkout's convert runs in each round too, the
   three in turn, and `old_ratio` is its seconds over this one's.
4. verify: `ple-prep verify --sample N` against the checkpoint.
5. first gather: bench/first_gather.py (the first gather after open against a later one).
6. bench: `ple-prep bench` of the table (real-text gathers, cold and warm; fio when installed).
The table and the copies are deleted at the end (the checkpoint too unless --keep).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import real_corpus  # noqa: E402
from bench_convert import evict, run_timed  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.tools.fixtures import fixture_config  # noqa: E402

CLI = [sys.executable, "-m", "ple_prep"]
ROW_BYTES = 90  # IQ4_NL: 5 blocks of 18 bytes
# The disk is shared: a step that writes needs its file's size and this much more free before it
# starts, and is killed (its files removed) when free space falls below the floor while it runs.
SPARE_BYTES = 4 << 30
FLOOR_BYTES = 1 << 30


def check_room(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + SPARE_BYTES:
        raise SystemExit(f"{folder}: {free / 2**30:.1f} GiB free, a step needs {needed / 2**30:.1f} GiB "
                         f"and {SPARE_BYTES / 2**30:.0f} GiB to spare; nothing written")


def step(name: str, command: list[str], results: dict, stdout=subprocess.DEVNULL,
         watch: Path | None = None, tree: Path = REPO) -> None:
    """Run one child; its seconds and peak RSS (the largest process of its tree) into results.
    `watch`: a folder whose disk must keep FLOOR_BYTES free while it runs; `tree`: the checkout
    whose ple_prep it runs."""
    seconds, rss, _ = run_timed(command, stdout=stdout, min_free=(watch, FLOOR_BYTES) if watch else None, cwd=tree)
    results[name] = {"seconds": round(seconds, 2), "peak_rss_mib": round(rss / 2**20, 1)}
    print(f"{name}: {seconds:.1f} s, peak RSS {rss / 2**20:.0f} MiB", file=sys.stderr)


def checkpoint(folder: Path, base: int, results: dict) -> Path:
    path = folder / "model.gguf"
    rows = NgramSpec.from_config(fixture_config(base)).rows_stored
    if not path.exists() or path.stat().st_size < rows * ROW_BYTES:
        shutil.rmtree(folder, ignore_errors=True)
        step("checkpoint", [sys.executable, str(REPO / "bench" / "big_gguf.py"), str(folder), "--type", "iq4_nl",
                            "--base", str(base)], results)
    else:
        results["checkpoint"] = {"reused": True}
    return path


def write_prompts(folder: Path, documents: int | None, train_chars: int) -> None:
    """The profile half as DIR/prompts.jsonl (one text a line) with DIR/prompts.json describing it,
    and the corpus tokenizer as DIR/ckpt/tokenizer.json. Run in a child of its own: a child's peak
    RSS as wait4 reports it starts from its parent's, so the parent never holds the corpus."""
    docs = real_corpus.documents()[:documents]
    profile_docs = [text for name, text in docs if not real_corpus.is_evaluation(name)]
    cached = real_corpus.CACHE / "tokenizer.json"
    if documents is None and cached.exists():
        shutil.copy(cached, folder / "tokenizer.json")
    else:
        tokenizer = real_corpus.train_bpe(profile_docs[:max(1, train_chars // 20_000)], real_corpus.VOCAB_SIZE)
        tokenizer.save(str(folder / "tokenizer.json"))
    path = folder.parent / "prompts.jsonl"
    with open(path, "w") as handle:
        for text in profile_docs:
            handle.write(json.dumps({"text": text}) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"documents": len(profile_docs),
                                                    "chars": sum(map(len, profile_docs)),
                                                    "bytes": path.stat().st_size}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="Folder for the big files.")
    parser.add_argument("--base", type=int, default=20_000_000, help="ngram_vocab_size_base.")
    parser.add_argument("--rounds", type=int, default=2, help="cat/convert pairs, alternating order.")
    parser.add_argument("--map-fraction", type=float, default=0.01)
    parser.add_argument("--sample", type=int, default=100_000, help="Rows verify compares.")
    parser.add_argument("--documents", type=int, help="Only the first N documents (small runs).")
    parser.add_argument("--train-chars", type=int, default=real_corpus.TRAIN_CHARS,
                        help="Tokenizer training text when not cached (small runs: less).")
    parser.add_argument("--fio-seconds", type=float, default=8.0)
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoint afterwards.")
    parser.add_argument("--old-tree", type=Path, help="A checkout of an older ple-prep to convert beside this one.")
    parser.add_argument("--prompts-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompts_only:
        write_prompts(args.dir / "ckpt", args.documents, args.train_chars)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"base": args.base}
    model = checkpoint(args.dir / "ckpt", args.base, results)
    step("prompts", [sys.executable, __file__, "--prompts-only", "--dir", str(args.dir), "--train-chars",
                     str(args.train_chars), *(["--documents", str(args.documents)] if args.documents else [])],
         results)
    prompt_file = args.dir / "prompts.jsonl"
    results["prompts"] |= json.loads(prompt_file.with_suffix(".json").read_text())
    profile = args.dir / "real.prof"
    step("profile", CLI + ["profile", "--model", str(model), "--prompts", str(prompt_file), "--out", str(profile),
                           "--force", "--quiet"], results)
    table, copy = args.dir / "table.bin", args.dir / "copy.bin"
    rounds = []
    for index in range(args.rounds):
        pair = {}
        # In turn, except that the last round ends with its convert: its table is kept, and a
        # copy beside it would need the source's size again on the disk.
        names = ["copy", "convert"] + (["old"] if args.old_tree else [])
        order = names[index % len(names):] + names[:index % len(names)]
        if index == args.rounds - 1:
            order = [name for name in order if name != "convert"] + ["convert"]
        for name in order:
            evict(model)
            check_room(args.dir, model.stat().st_size)
            if name == "copy":
                with open(copy, "wb") as handle:
                    started = time.perf_counter()
                    try:
                        run_timed(["cat", str(model)], stdout=handle, min_free=(args.dir, FLOOR_BYTES))
                    except SystemExit:
                        copy.unlink()
                        raise
                    os.fsync(handle.fileno())
                    pair["copy_s"] = round(time.perf_counter() - started, 2)
                evict(copy)
                copy.unlink()
            else:
                last = index == args.rounds - 1 and name == "convert"
                measured: dict = {}
                try:
                    step(name, CLI + ["convert", "--model", str(model), "--profile", str(profile), "--out",
                                      str(table), "--map-fraction", str(args.map_fraction), "--force", "--quiet"],
                         measured, watch=args.dir, tree=args.old_tree.resolve() if name == "old" else REPO)
                except SystemExit:
                    for partial in args.dir.glob(f".{table.name}*.partial"):
                        partial.unlink()
                    raise
                pair[f"{name}_s"], pair[f"{name}_peak_rss_mib"] = (measured[name]["seconds"],
                                                                   measured[name]["peak_rss_mib"])
                if not last:
                    for path in (table, table.with_name(table.name + ".json")):
                        path.unlink()
        pair["ratio"] = round(pair["copy_s"] / pair["convert_s"], 3)
        if args.old_tree:
            pair["old_ratio"] = round(pair["old_s"] / pair["convert_s"], 3)
        rounds.append(pair)
        print(f"round {index}: {pair}", file=sys.stderr)
    manifest = json.loads(table.with_name(table.name + ".json").read_text())
    # The rounds' totals: the disk's speed moves by the minute on a shared disk, so one round can
    # fall in a slow spell on one side; over alternating rounds both sides meet the spells alike.
    results["convert"] = {"rounds": rounds, "totals_ratio": round(sum(pair["copy_s"] for pair in rounds)
                                                                  / sum(pair["convert_s"] for pair in rounds), 3),
                          "source_bytes": model.stat().st_size,
                          "table_bytes": manifest["file_size"], "layout": manifest["layout"] | {"profile": None}}
    evict(table)
    report = args.dir / "verify.json"
    with open(report, "wb") as handle:
        step("verify", CLI + ["verify", str(table), "--model", str(model), "--sample", str(args.sample), "--json"],
             results, stdout=handle)
    results["verify"]["report"] = {key: value for key, value in json.loads(report.read_text()).items()
                                   if key in ("ok", "rows_compared", "mismatched_rows", "checksum_blocks")}
    first = args.dir / "first_gather.json"
    with open(first, "wb") as handle:
        step("first_gather", [sys.executable, str(REPO / "bench" / "first_gather.py"), str(table)], results,
             stdout=handle)
    results["first_gather"]["report"] = json.loads(first.read_text())
    first.unlink()
    bench = args.dir / "bench.json"
    with open(bench, "wb") as handle:
        step("bench", CLI + ["bench", str(table), "--json", "--fio-seconds", str(args.fio_seconds)], results,
             stdout=handle)
    results["bench"]["report"] = json.loads(bench.read_text())
    for path in (table, table.with_name(table.name + ".json"), report, bench, prompt_file,
                 prompt_file.with_suffix(".json"), profile):
        path.unlink(missing_ok=True)
    if not args.keep:
        shutil.rmtree(model.parent)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
