"""The profile loop: record while serving, merge, convert --profile, and page reads per token after.

    python bench/served_profile_bench.py /work/scratch/cache/loop --base 250000

1. A checkpoint in the model's layout (`make_checkpoint`, FP8, `--base` rows per head base) whose
   tokenizer.json is a byte-level BPE trained on the standard library (tools/realtext.py).
2. The operator's guess: `ple-prep profile` of texts under /usr/share/doc, then `ple-prep convert
   --profile` of it: table A.
3. Serving: real traffic of another kind (standard library sources, one file a request, part 0 of
   3) gathered from table A in 4,096-token chunks while a `TrafficRecorder` keeps a sample of the
   requests (`--sample-every`) and writes served.prof. The recorder's CPU time (its thread's
   hashing and counting, and the serving thread's calls) is reported against the lookups' time;
   so is the cost at the recorder's default sample.
4. `ple-prep profile merge` of the operator's profile and served.prof, `ple-prep convert --profile`
   of the merge: table B.
5. Later traffic of the same kind (part 1 of 3: other files): page reads per token on A and on B,
   each with its leading `--resident-fraction` of slots resident (the GPU tier) and no host cache:
   per token, the distinct pages of its rows outside that tier.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.ngram import NgramSpec, row_ids  # noqa: E402
from ple_prep.offline.profile import tokenizer_fingerprint  # noqa: E402
from ple_prep.runtime import TrafficRecorder, open_table  # noqa: E402
from ple_prep.runtime.recording import DEFAULT_SAMPLE_EVERY  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402
from ple_prep.tools.realtext import stdlib_sources, train_tokenizer  # noqa: E402

CHUNK_TOKENS = 4096


def cli(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "ple_prep", *arguments, "--quiet"], check=True)


def doc_texts(limit_chars: int) -> list[str]:
    texts, total = [], 0
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
            text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.strip() and "\0" not in text:
            texts.append(text[:65536])
            total += len(texts[-1])
            if total >= limit_chars:
                break
    return texts


def traffic(tokenizer, part: int, tokens: int) -> list[np.ndarray]:
    """Standard library files (part `part` of 3 in a fixed shuffle), tokenised, one a request."""
    paths = stdlib_sources()
    shuffled = [paths[i] for i in np.random.default_rng(1).permutation(len(paths))][part::3]
    requests, total = [], 0
    for path in shuffled:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if ids:
            requests.append(np.array(ids, dtype=np.int64))
            total += len(ids)
            if total >= tokens:
                break
    return requests


def page_reads_per_token(table_path: Path, spec: NgramSpec, requests: list[np.ndarray], fraction: float) -> float:
    with open_table(table_path, host_cache_bytes=0) as table:
        resident = int(table.num_rows * fraction)
        reads = tokens = 0
        for request in requests:
            slots = table.slot_of(row_ids(request, spec)).reshape(len(request), -1)
            pages = np.where(slots >= resident, slots // table.rows_per_page, -1)
            pages.sort(axis=1)
            distinct = (pages[:, 1:] != pages[:, :-1]) & (pages[:, 1:] >= 0)
            reads += int(distinct.sum() + (pages[:, 0] >= 0).sum())
            tokens += len(request)
    return reads / tokens


def serve(table_path: Path, spec: NgramSpec, requests: list[np.ndarray], recorder: TrafficRecorder) -> dict:
    lookup = calls = 0.0
    with open_table(table_path) as table:
        for request in requests:
            began = time.thread_time()
            recorder.add_request(request)
            calls += time.thread_time() - began
            ids = row_ids(request, spec)
            began = time.thread_time()
            for start in range(0, len(ids), CHUNK_TOKENS):
                table.gather(ids[start:start + CHUNK_TOKENS])
            lookup += time.thread_time() - began
    recorder.close()
    return {"lookup_cpu_s": round(lookup, 3), "recorder_calls_cpu_s": round(calls, 5),
            "recorder_thread_cpu_s": round(recorder.cpu_seconds, 3), "requests": len(requests),
            "recorded": recorder.recorded, "dropped": recorder.dropped,
            "recorded_tokens": int(sum(len(r) for r in requests[recorder.sample_every - 1::recorder.sample_every]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--base", type=int, default=250_000)
    parser.add_argument("--sample-every", type=int, default=2)
    parser.add_argument("--served-tokens", type=int, default=1_500_000)
    parser.add_argument("--later-tokens", type=int, default=300_000)
    parser.add_argument("--resident-fraction", type=float, default=0.01)
    args = parser.parse_args()
    folder = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    checkpoint = make_checkpoint(folder / "ckpt", "fp8", base=args.base)
    tokenizer = train_tokenizer()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    with open(folder / "operator.jsonl", "w") as handle:
        for text in doc_texts(8_000_000):
            handle.write(json.dumps({"text": text}) + "\n")
    cli("profile", "--model", str(checkpoint), "--prompts", str(folder / "operator.jsonl"),
        "--out", str(folder / "operator.prof"), "--force")
    cli("convert", "--model", str(checkpoint), "--profile", str(folder / "operator.prof"),
        "--out", str(folder / "a.bin"), "--force")
    with open_table(folder / "a.bin") as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
    served = traffic(tokenizer, 0, args.served_tokens)
    recorder = TrafficRecorder(spec, folder / "served.prof", sample_every=args.sample_every,
                               tokenizer_sha256=tokenizer_fingerprint(checkpoint), model=checkpoint.name)
    serving = serve(folder / "a.bin", spec, served, recorder)
    # The recorder's cost at its default sample: its per-token CPU time scaled to that share.
    per_token = serving["recorder_thread_cpu_s"] / max(1, serving["recorded_tokens"])
    served_tokens = sum(len(r) for r in served)
    serving["recorder_cost_x_lookup"] = round((serving["recorder_thread_cpu_s"] + serving["recorder_calls_cpu_s"])
                                              / serving["lookup_cpu_s"], 4)
    serving["recorder_cost_x_lookup_at_default_sample"] = round(
        (per_token * served_tokens / DEFAULT_SAMPLE_EVERY + serving["recorder_calls_cpu_s"])
        / serving["lookup_cpu_s"], 4)
    cli("profile", "merge", str(folder / "operator.prof"), str(folder / "served.prof"),
        "-o", str(folder / "merged.prof"), "--force")
    cli("convert", "--model", str(checkpoint), "--profile", str(folder / "merged.prof"),
        "--out", str(folder / "b.bin"), "--force")
    later = traffic(tokenizer, 1, args.later_tokens)
    report = {"base": args.base, "sample_every": args.sample_every, "default_sample_every": DEFAULT_SAMPLE_EVERY,
              "served_tokens": served_tokens, "later_tokens": int(sum(len(r) for r in later)),
              "resident_fraction": args.resident_fraction, "serving": serving,
              "page_reads_per_token": {
                  "operator_profile": round(page_reads_per_token(folder / "a.bin", spec, later,
                                                                 args.resident_fraction), 4),
                  "merged_with_served": round(page_reads_per_token(folder / "b.bin", spec, later,
                                                                   args.resident_fraction), 4)}}
    reads = report["page_reads_per_token"]
    reads["merged_x_operator"] = round(reads["merged_with_served"] / reads["operator_profile"], 3)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
