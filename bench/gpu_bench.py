"""Issue 4's GPU target: PLE rows of real text delivered as bf16 on the GPU, per 4,096-token chunk.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000
    python bench/gpu_bench.py /tmp/ple.bin --resident-fraction 0.05

An EmbeddingSource holds the table's leading 5% of slots (the hottest rows of a profile text, which
shares no file with the measured text) on the GPU; each call takes a chunk's (4096, 16) row ids on
the GPU and returns bf16 (4096, 2560) there. Timed from ids on the GPU to values ready
(torch.cuda.synchronize on both sides): warm (the disk tier's pages cached), cold (the file evicted
before every chunk), and the decode step (one token, 16 rows). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.dequant import round_to_bf16  # noqa: E402
from ple_prep.runtime.torch import EmbeddingSource  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

CHUNK_TOKENS = 4096


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(source: EmbeddingSource, requests: list[torch.Tensor], before=None) -> dict:
    seconds, disk_rows = [], []  # disk_rows: distinct rows each call read from the disk tier
    for ids in requests:
        if before is not None:
            before()
        sync(source.device)
        started = time.perf_counter()
        source(ids)
        sync(source.device)
        seconds.append(time.perf_counter() - started)
        disk_rows.append(source.last_disk_rows)
    rows = sum(ids.numel() for ids in requests)
    return {"requests": len(requests), "p50_ms": round(float(np.percentile(seconds, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1e3, 3),
            "mean_ms": round(float(np.mean(seconds)) * 1e3, 3),
            "rows_per_s": round(rows / sum(seconds)),
            "ids_per_request": rows // len(requests),
            "distinct_disk_rows_per_request": round(float(np.mean(disk_rows)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=2000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", default="1,4", help="Gather threads to compare, warm.")
    args = parser.parse_args()
    device = torch.device(args.device)
    table = open_table(args.table)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    row_ids = real_text_row_ids(spec, args.chunks * CHUNK_TOKENS + args.decode_tokens, part=0, parts=2)
    chunks = [torch.from_numpy(row_ids[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS]).to(device)
              for i in range(args.chunks)]
    tokens = [torch.from_numpy(row_ids[args.chunks * CHUNK_TOKENS + i:][:1]).to(device)
              for i in range(args.decode_tokens)]
    resident_bytes = int(args.resident_fraction * table.num_rows * table.row_bytes)
    started = time.perf_counter()
    source = EmbeddingSource(table, device=device, resident_bytes=resident_bytes,
                             max_tokens=CHUNK_TOKENS)
    report = {"table": str(args.table), "rows": table.num_rows, "placed": table.order.num_placed,
              "resident_rows": source.num_resident, "resident_bytes": resident_bytes,
              "load_seconds": round(time.perf_counter() - started, 2),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    # Exactness on one chunk: the numpy reference, rounded to bf16, concatenated per token.
    values = source(chunks[0])
    reference = table.values(row_ids[:CHUNK_TOKENS].reshape(-1)).reshape(CHUNK_TOKENS, -1)
    reference_bits = (round_to_bf16(reference.astype(np.float64)).view(np.uint32) >> 16)
    got_bits = values.cpu().view(torch.int16).numpy().view(np.uint16)
    report["bit_exact"] = bool(np.array_equal(got_bits, reference_bits.astype(np.uint16)))

    def reopen_cold() -> None:
        source.table.close()
        evict(args.table)
        source.table = open_table(args.table)

    report["cold_chunk"] = timed(source, chunks, reopen_cold)
    reopen_cold()
    report["cold_decode_16"] = timed(source, tokens[:200])
    for ids in chunks + tokens:
        source(ids)
    for threads in [int(t) for t in args.threads.split(",")]:
        source.table.threads = threads
        report[f"warm_chunk_threads{threads}"] = timed(source, chunks * 3)
    # Where a warm call's time goes: every stage synchronised and timed (4 gather threads).
    source.table.threads = max(int(t) for t in args.threads.split(","))
    source.profile = True
    for name, requests in (("warm_chunk_stages_ms", chunks), ("warm_decode_stages_ms", tokens[:200])):
        stages: dict[str, list[float]] = {}
        for ids in requests:
            source(ids)
            for stage, seconds in source.last_stages.items():
                stages.setdefault(stage, []).append(seconds)
        report[name] = {stage: round(float(np.median(v)) * 1e3, 3) for stage, v in stages.items()}
    source.profile = False
    source.table.threads = 1
    report["warm_decode_16"] = timed(source, tokens)
    # The host's share of a warm chunk: gathering its disk rows from the page cache.
    slots = source.table.slot_of(row_ids[:CHUNK_TOKENS].reshape(-1))
    disk_slots = np.unique(slots[slots >= source.num_resident])
    for threads in [int(t) for t in args.threads.split(",")]:
        source.table.threads = threads
        seconds = []
        for _ in range(10):
            started = time.perf_counter()
            source.table.gather_slots(disk_slots)
            seconds.append(time.perf_counter() - started)
        report[f"warm_host_gather_ms_threads{threads}"] = round(float(np.median(seconds)) * 1e3, 3)
    report["warm_host_gather_rows"] = len(disk_slots)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
