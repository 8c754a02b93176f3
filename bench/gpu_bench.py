"""PLE rows of real text from host row ids to bf16 values on the GPU: a decode step and a chunk.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000
    python bench/gpu_bench.py /tmp/ple.bin --resident-fraction 0.05

An EmbeddingSource holds the table's leading 5% of slots (the hottest rows of a profile text, which
shares no file with the measured text) on the GPU; row ids are numpy int64 on the host, as a
serving stack has them after input preparation. Three measurements, all warm (every disk-tier
page cached) unless named cold:

- `call`: `source(ids)`, timed on the host from the ids to the values ready on the GPU
  (torch.cuda.synchronize on both sides);
- `prefetch`: `start(ids)`, then at least `--other-ms` of other GPU work (bf16 matrix products)
  launched on the current stream, then `finish()`: the time finish adds to the stream is the
  span between events recorded after the other work and after finish (CUDA events); also with
  `finish` captured once in a CUDA graph and replayed after `join()`;
- cold: `source(ids)` with the file evicted from the page cache before each request.

Each result is checked bit for bit against `Table.values` rounded to bf16. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import importlib.util
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
from ple_prep.runtime.device import (
    EmbeddingSource,  # noqa: E402
    staging,  # noqa: E402
)
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

CHUNK_TOKENS = 4096


def summary(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"n": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p90_ms": round(float(np.percentile(ms, 90)), 4), "p99_ms": round(float(np.percentile(ms, 99)), 4)}


def real_text_requests(spec: NgramSpec, chunks: int, decode_tokens: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Row ids of real text (a part the table's profile never saw): `chunks` prefill chunks of
    CHUNK_TOKENS tokens, then `decode_tokens` decode steps of one token each."""
    row_ids = real_text_row_ids(spec, chunks * CHUNK_TOKENS + decode_tokens, part=0, parts=2)
    chunk_ids = [row_ids[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS] for i in range(chunks)]
    decode_ids = [row_ids[chunks * CHUNK_TOKENS + i:][:1] for i in range(decode_tokens)]
    return chunk_ids, decode_ids


def bf16_bits(table, ids: np.ndarray) -> np.ndarray:
    """The bits of each id's values rounded to bf16 as the model rounds them: (ids, values_per_row) uint16."""
    values = table.values(ids.reshape(-1)).astype(np.float64)
    return (round_to_bf16(values).view(np.uint32) >> 16).astype(np.uint16)


def exact(source: EmbeddingSource, values: torch.Tensor, ids: np.ndarray) -> bool:
    got = values.reshape(-1, source.table.values_per_row).cpu().view(torch.int16).numpy().view(np.uint16)
    return bool(np.array_equal(got, bf16_bits(source.table, ids)))


def timed_calls(source: EmbeddingSource, requests: list[np.ndarray], before=None) -> dict:
    seconds, disk_rows, stages = [], [], {}
    for ids in requests:
        if before is not None:
            before()
        torch.cuda.synchronize()
        started = time.perf_counter()
        source(ids)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        disk_rows.append(source.last_disk_rows)
        for stage, value in source.last_stages.items():
            stages.setdefault(stage, []).append(value)
    return summary(seconds) | {
        "ids_per_request": int(requests[0].size),
        "distinct_disk_rows_per_request": round(float(np.mean(disk_rows)), 1),
        "host_stages_p50_ms": {k: round(float(np.median(v)) * 1e3, 4) for k, v in stages.items()}}


class OtherWork:
    """bf16 matrix products on the current stream lasting at least `ms` (calibrated by events)."""

    def __init__(self, ms: float, size: int = 4096):
        self.a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.count = 1
        while self.measure() < ms:
            self.count *= 2
        self.ms = self.measure()

    def __call__(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.b, out=self.out)

    def measure(self) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            begin.record()
            self()
            end.record()
            torch.cuda.synchronize()
        return begin.elapsed_time(end)


def timed_prefetch(source: EmbeddingSource, requests: list[np.ndarray], other: OtherWork,
                   graph: torch.cuda.CUDAGraph | None = None) -> dict:
    """The time finish (or the replayed graph holding it) adds after `other`; all on one stream."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    added, others, start_returns, join_waits, exact_all = [], [], [], [], True
    for ids in requests:
        torch.cuda.synchronize()
        began = time.perf_counter()
        source.start(ids)
        start_returns.append(time.perf_counter() - began)
        marks[0].record()
        other()
        marks[1].record()
        began = time.perf_counter()
        if graph is None:
            source.finish()
        else:
            source.join()
            graph.replay()
        join_waits.append(time.perf_counter() - began)
        marks[2].record()
        torch.cuda.synchronize()
        others.append(marks[0].elapsed_time(marks[1]) / 1e3)
        added.append(marks[1].elapsed_time(marks[2]) / 1e3)
    exact_all = exact(source, source.output[:requests[-1].size], requests[-1])
    return {"finish_adds": summary(added), "other_work": summary(others),
            "start_returns": summary(start_returns), "finish_host": summary(join_waits),
            "bit_exact_last": exact_all}


def captured_finish(source: EmbeddingSource, ids: np.ndarray) -> torch.cuda.CUDAGraph:
    source.start(ids)
    source.finish()
    source.start(ids)
    source.join()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        source.finish(count=ids.size)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=2000)
    parser.add_argument("--cold-chunks", type=int, default=6)
    parser.add_argument("--other-ms", type=float, default=1.0)
    parser.add_argument("--lookup-threads", type=int, default=staging.LOOKUP_THREADS,
                        help="Threads of a large request's slot lookup (1: one).")
    args = parser.parse_args()
    staging.LOOKUP_THREADS = args.lookup_threads
    torch.cuda.init()
    table = open_table(args.table)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    chunks, tokens = real_text_requests(spec, args.chunks, args.decode_tokens)
    resident_bytes = int(args.resident_fraction * table.num_rows * table.row_bytes)
    started = time.perf_counter()
    source = EmbeddingSource(table, device="cuda", resident_bytes=resident_bytes,
                             max_ids=CHUNK_TOKENS * spec.heads)
    report = {"table": str(args.table), "rows": table.num_rows, "placed": table.order.num_placed,
              "resident_rows": source.num_resident, "resident_bytes": resident_bytes,
              "load_seconds": round(time.perf_counter() - started, 2),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "numpy": np.__version__,
              "compiled_helper": all(importlib.util.find_spec(f"ple_prep.{layer}._native") is not None
                                     for layer in ("core", "runtime")),
              "lookup_threads": args.lookup_threads}
    report["bit_exact_chunk"] = exact(source, source(chunks[0]), chunks[0])
    source.start(chunks[1])
    report["bit_exact_split_chunk"] = exact(source, source.finish(), chunks[1])

    def reopen_cold() -> None:
        # Mapped pages cannot be evicted: both mappings (the table's, the source's) close first.
        source.close()
        source.table.close()
        evict(args.table)
        source.reopen(open_table(args.table))

    report["cold_call_chunk"] = timed_calls(source, chunks[:args.cold_chunks], reopen_cold)
    reopen_cold()
    report["cold_call_decode"] = timed_calls(source, tokens[:200])
    # Warm: the disk tier's pages in the page cache, which only the mapped read path fills.
    source.close()
    source.table.close()
    source.reopen(open_table(args.table, read_path="mapped"))
    for ids in chunks + tokens:  # every page warm
        source(ids)
    report["warm_call_chunk"] = timed_calls(source, chunks * 4)
    report["warm_call_decode"] = timed_calls(source, tokens)
    report["bit_exact_after_warm"] = exact(source, source(chunks[2]), chunks[2])

    other = OtherWork(args.other_ms)
    report["other_work_ms"] = round(other.ms, 3)
    report["prefetch_chunk"] = timed_prefetch(source, chunks * 2, other)
    report["prefetch_decode"] = timed_prefetch(source, tokens[:500], other)
    report["prefetch_decode_graph"] = timed_prefetch(source, tokens[:500], other,
                                                     captured_finish(source, tokens[0]))
    report["prefetch_chunk_graph"] = timed_prefetch(source, chunks * 2, other,
                                                    captured_finish(source, chunks[0]))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
