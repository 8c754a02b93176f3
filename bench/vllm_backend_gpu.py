"""The vLLM plugin's lookup without vLLM: PrefetchedRows' start/finish pair on a chunk and a decode step.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000
    python bench/vllm_backend_gpu.py /tmp/ple.bin --resident-fraction 0.05          # on a GPU
    python bench/vllm_backend_gpu.py /tmp/small.bin --device cpu --chunks 2 --decode-tokens 50

`ple_prep.integrations.vllm.backend.PrefetchedRows` is what the plugin's storage class calls from
vLLM's `start_prefetch` and `finalize_prefetch` (with the compiled helper, `StepLookup`: both calls
queue device work only; bench/vllm_full_graph.py holds the lookup in one FULL CUDA graph). As in
vLLM, the row ids of real text (a part of the text the table's profile never saw) arrive as an
int64 tensor on the device, written by a kernel just before `start` (here a device-to-device copy
into a fixed ids buffer, as vLLM's id kernel writes its `_prefetch_ids`). With `--read-path
mapped` (the default here) all measurements are warm: every disk-tier page is in the page cache,
which only the mapped read path fills; with
`--read-path direct` every disk-tier row is read from the drive with O_DIRECT, every time.

- `pair`: `start(ids)` then `finish()` back to back, from the ids kernel to the values ready on the
  device (the device synchronised on both sides): the whole lookup when nothing hides it;
- `prefetch`: `start(ids)`, then at least `--other-ms` of other device work (bf16 matrix products,
  standing for decoder layer 0), then `finish()`: the time `finish` adds to the stream (CUDA events
  after the other work and after finish; on the CPU, host seconds of `finish`), and how long
  `start` held the host.

Every request's values are checked bit for bit against `Table.values` rounded to bf16, after the
timed loop (a copy of each kept on the device): reading a chunk's 21 MB of values and its expected
bits on the host between two pairs would push the lookup's index out of the CPU caches, which the
host of a serving stack does not do between steps. Prints JSON.
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

from gpu_bench import CHUNK_TOKENS, bf16_bits, real_text_requests, summary  # noqa: E402  (bench/, beside this file)

from ple_prep.integrations.vllm.backend import PrefetchedRows  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402


class Device:
    """Synchronisation, stream marks and stand-in model work on the device under test."""

    def __init__(self, device: torch.device, other_ms: float, size: int = 2048):
        self.device = device
        self.cuda = device.type == "cuda"
        self.a = torch.randn(size, size, device=device).to(torch.bfloat16 if self.cuda else torch.float32)
        self.b = torch.randn_like(self.a)
        self.out = torch.empty_like(self.a)
        self.count = 1
        while self.measure_other() < other_ms:
            self.count *= 2
        self.other_ms = self.measure_other()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self):
        """A point on the stream (a CUDA event), or the host clock on the CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin, end) -> float:
        if self.cuda:
            return begin.elapsed_time(end) / 1e3
        return end - begin

    def other(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.b, out=self.out)

    def measure_other(self) -> float:
        for _ in range(2):
            self.sync()
            begin = self.mark()
            self.other()
            end = self.mark()
            self.sync()
        return self.seconds(begin, end) * 1e3


def expected_bits(table, ids: np.ndarray) -> np.ndarray:
    """(tokens, heads * values_per_row): the layout of PrefetchedRows.finish."""
    return bf16_bits(table, ids).reshape(len(ids), -1)


def run(rows: PrefetchedRows, device: Device, requests: list[torch.Tensor], expected: list[np.ndarray],
        ids_buffer: torch.Tensor, with_other: bool) -> dict:
    total, added, start_host, outputs = [], [], [], []
    for ids in requests:
        device.sync()
        began = time.perf_counter()
        written = ids_buffer[:len(ids)]
        written.copy_(ids)                     # the ids kernel
        rows.start(written)
        start_host.append(time.perf_counter() - began)
        if with_other:
            device.other()
            before_finish = device.mark()
            values = rows.finish()
            after_finish = device.mark()
            device.sync()
            added.append(device.seconds(before_finish, after_finish))
        else:  # no marks: each is a new timing event and its record, host time inside the pair
            values = rows.finish()
            device.sync()
            total.append(time.perf_counter() - began)
        outputs.append(values.clone())  # checked after the loop: a check here would flush the host's caches
    exact = all(np.array_equal(values.cpu().view(torch.int16).numpy().view(np.uint16), want)
                for values, want in zip(outputs, expected))
    report = {"start_holds_host": summary(start_host), "bit_exact": exact, "tokens": len(requests[0])}
    if with_other:
        return report | {"finish_adds": summary(added)}
    return report | {"pair": summary(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=2000)
    parser.add_argument("--other-ms", type=float, default=1.0)
    parser.add_argument("--read-path", default="mapped", choices=["mapped", "direct"])
    args = parser.parse_args()
    table = open_table(args.table, read_path=args.read_path)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    host, host_decode = real_text_requests(spec, args.chunks, args.decode_tokens)
    resident_bytes = int(args.resident_fraction * table.num_rows * table.row_bytes)
    started = time.perf_counter()
    rows = PrefetchedRows(table, device=args.device, resident_bytes=resident_bytes, max_tokens=CHUNK_TOKENS,
                          heads=spec.heads)
    device = Device(rows.device, args.other_ms)
    report = {"table": str(args.table), "read_path": table.read_path, "rows": table.num_rows,
              "placed": table.order.num_placed,
              "resident_bytes": rows.resident_bytes, "load_seconds": round(time.perf_counter() - started, 2),
              "device": torch.cuda.get_device_name() if device.cuda else "cpu", "torch": torch.__version__,
              "other_work_ms": round(device.other_ms, 3)}
    chunks = [torch.from_numpy(ids).to(rows.device) for ids in host]
    decode = [torch.from_numpy(ids).to(rows.device) for ids in host_decode]
    chunk_bits = [expected_bits(table, ids) for ids in host]
    decode_bits = [expected_bits(table, ids) for ids in host_decode]
    ids_buffer = torch.empty((CHUNK_TOKENS, spec.heads), dtype=torch.int64, device=rows.device)
    run(rows, device, chunks + decode, chunk_bits + decode_bits, ids_buffer, False)  # warm (mapped)
    report["chunk"] = run(rows, device, chunks * 2, chunk_bits * 2, ids_buffer, False)
    report["decode"] = run(rows, device, decode, decode_bits, ids_buffer, False)
    report["chunk_prefetch"] = run(rows, device, chunks * 2, chunk_bits * 2, ids_buffer, True)
    report["decode_prefetch"] = run(rows, device, decode, decode_bits, ids_buffer, True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
