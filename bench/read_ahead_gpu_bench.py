"""A cold 65,536-token prompt as 16 chunks with GPU work between them, with and without read-ahead.

    python bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000 --placed 21000000
    python bench/read_ahead_gpu_bench.py /tmp/ple.bin --resident-fraction 0.05 --work-ms 100,20
    python bench/read_ahead_gpu_bench.py /tmp/ple.bin --device cpu --old-tree /tmp/old   # beside older code

A prefill proxy: an EmbeddingSource holds the table's leading slots on the GPU; the prompt (held-out
real text, 65,536 tokens) is served as 16 chunks of 4,096 tokens, each chunk's lookup
(`source(ids)`) followed by W ms of other GPU work (bf16 matrix products, calibrated) and a
synchronisation, as a prefill step ends. Without read-ahead each chunk's disk rows are read when
its lookup comes; with it, `source.read_ahead(chunks)` is called when the prompt arrives and the
chunks then find their rows in the host cache as the read-ahead thread gets ahead of them.

Every run starts cold: the table opened afresh (an empty host cache; the GPU tier stays), then the
file evicted from the page cache once no table maps it (cached_at_start says what stayed). Variants
alternate, order swapped each round. The disk floor is the prompt's distinct disk pages divided by
the disk's random-read rate measured in the same run: fio's 4 KiB O_DIRECT random reads at queue
depths 64 and 512, the faster (where fio is installed; else cold O_DIRECT reads of that many random
pages through the table's reader at depths 64 and 512, the faster). Beside fio, the table's reader
reads as many random pages sorted by offset at its depth (`reader_sorted`): on a virtual disk a
sorted sweep runs faster than random reads (BENCHMARKS.md, "Host cache and read-ahead"), and each
prompt is set against that floor too (`*_x_sorted_floor_beside`). A shared disk's rate moves by
tens of percent from minute to minute, so besides the floor measured once at the start
(`disk_floor_s`, `*_x_bound`) the rate is measured again before the first prompt of each round and
after each prompt, and each prompt is also set against the floor from the mean of the two rates on
either side of it (`*_x_bound_beside`). Each chunk's values are checked bit for bit
against `Table.values` rounded to bf16. The host cache's memory is faulted in before the clock
starts (its thread joined), as a serving process has it long before its first prompt.

`read_ahead_alone`: the prompt's read-ahead with nothing else running (`Table.read_ahead`, then
`wait`), in disk pages per second, beside fio's 4 KiB random reads at queue depth 64 and the
table's own O_DIRECT reader reading as many random pages at its depth (512), the three alternating
over `--alone-rounds` rounds: how close read-ahead comes to the disk's full rate.

With `--old-tree DIR` (a built checkout of older code, e.g. `git worktree add /tmp/old 845d5f7`
and `python3 setup.py build_ext --inplace` there) the older code's read-ahead runs too, in a child
process importing ple_prep from DIR, in the same rounds: its prompt with read-ahead at each W, and
its read-ahead alone. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

# A child run of older code (--old-tree) imports ple_prep from that tree.
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]) if "--tree" in sys.argv else Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TREE))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import hostcache, open_table  # noqa: E402
from ple_prep.runtime.dequant import round_to_bf16  # noqa: E402
from ple_prep.runtime.device import EmbeddingSource  # noqa: E402
from ple_prep.runtime.direct import DEFAULT_QUEUE_DEPTH  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction, evict, fio_random_read  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

CHUNK_TOKENS = 4096
CHUNKS = 16


class SleepWork:
    """`--device cpu` (a check of this script where no GPU is): the other work is a sleep."""

    def __init__(self, ms: float):
        self.ms = ms

    def __call__(self) -> None:
        time.sleep(self.ms / 1e3)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GpuWork:
    """bf16 matrix products on the current stream lasting `ms` (calibrated with CUDA events)."""

    def __init__(self, ms: float, size: int = 4096):
        self.a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.count = 1
        per_product = self.measure() / self.count
        self.count = max(1, round(ms / per_product))
        self.ms = self.measure()

    def __call__(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.out)

    def measure(self) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            begin.record()
            self()
            end.record()
            torch.cuda.synchronize()
        return begin.elapsed_time(end)


def disk_rate(path: Path, table, pages: int) -> dict:
    """Random page reads per second on this table's disk: fio at queue depths 64 and 512 where
    installed, else the table's O_DIRECT reader at depth 64 and at its default depth, the faster
    kept (the floor is then no easier to meet than either); beside fio, the reader's sorted sweep."""
    if shutil.which("fio"):
        rates = {depth: fio_random_read(path, 3, queue_depth=depth)["iops"] for depth in (64, 512)}
        return {"how": "fio 4 KiB random reads, O_DIRECT, the faster of queue depths 64, 512",
                "reads_per_s_by_depth": rates, "reads_per_s": max(rates.values()),
                "reader_sorted_per_s": round(reader_rate(path, pages, 7))}
    rates = {depth: round(reader_rate(path, pages, seed, depth))
             for seed, depth in enumerate((64, DEFAULT_QUEUE_DEPTH), start=7)}
    return {"how": "O_DIRECT reads of random pages through the table's reader, the faster of queue depths "
                   f"{', '.join(map(str, rates))}", "reads_per_s_by_depth": rates, "reads_per_s": max(rates.values())}


def open_cold(path: Path):
    """The table with open_table's defaults; where O_DIRECT is refused (the mapped path, which has
    no host cache by default) with the default budget given explicitly. Its host cache's memory is
    faulted in first (older code's thread, which has no handle, by its name)."""
    table = open_table(path)
    if table.host_cache is None:
        table.close()
        table = open_table(path, host_cache_bytes=hostcache.default_budget(path.stat().st_size))
    populating = getattr(table.host_cache.cache, "populating", None)
    for thread in [populating] if populating else threading.enumerate():
        if thread.name == "ple-prep-host-cache":
            thread.join()
    return table


def reader_rate(path: Path, pages: int, seed: int, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> float:
    """Random pages per second, sorted by offset, through the table's O_DIRECT reader at
    `queue_depth`, cold."""
    evict(path)
    with open_table(path, queue_depth=queue_depth, host_cache_bytes=0) as fresh:
        slots = np.random.default_rng(seed).choice(fresh.header.num_pages, pages, replace=False) * fresh.rows_per_page
        started = time.perf_counter()
        fresh.gather_slots(np.sort(slots))
        return pages / (time.perf_counter() - started)


def read_ahead_alone(path: Path, chunks: list[np.ndarray], skip_slots: int) -> dict:
    """The prompt's read-ahead with nothing else running, from a cold table: pages per second."""
    with open_cold(path) as table:
        evict(path)
        began = time.perf_counter()
        job = table.read_ahead(chunks, skip_slots=skip_slots)
        job.wait()
        seconds = time.perf_counter() - began
        job.cancel()
        return {"seconds": round(seconds, 4), "pages": job.pages_read, "rows": job.rows_read,
                "pages_per_s": round(job.pages_read / seconds), "error": repr(job.error)}


def old_tree_run(old_tree: Path, path: Path, ids_file: Path, what: list[str]) -> dict:
    """One run of the older code (a child process importing ple_prep from `old_tree`)."""
    done = subprocess.run([sys.executable, __file__, str(path), "--tree", str(old_tree), "--child-ids", str(ids_file),
                           *what], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run_prompt(source: EmbeddingSource, path: Path, chunks: list[np.ndarray], work, read_ahead: bool) -> dict:
    old = source.table
    source.reopen(open_cold(path))
    old.close()
    # Evicted once no table of this process maps the file: a mapping's pages would stay cached.
    evict(path)
    cached = cached_fraction(path)
    synchronize()
    began = time.perf_counter()
    job = source.read_ahead(chunks) if read_ahead else None
    values = []
    for ids in chunks:
        values.append(source(ids).clone())
        work()
        synchronize()
    total = time.perf_counter() - began
    tier = source.table.host_cache
    result = {"total_s": round(total, 4), "cached_at_start": cached, "demand_rows_read": tier.rows_read,
              "demand_pages_read": tier.pages_read}
    if job is not None:
        result |= {"read_ahead_rows": job.rows_read, "read_ahead_pages": job.pages_read,
                   "read_ahead_found": job.rows_found, "read_ahead_hits": tier.cache.read_ahead_hits,
                   "read_ahead_error": repr(job.error)}
        job.cancel()
    result["values"] = values
    return result


def child(args, path: Path) -> None:
    """A run of the code in --tree on the parent's ids: a prompt with read-ahead, or read-ahead alone."""
    ids = np.load(args.child_ids, allow_pickle=False)
    chunks = [ids[k * CHUNK_TOKENS:(k + 1) * CHUNK_TOKENS] for k in range(CHUNKS)]
    table = open_cold(path)
    resident_bytes = int(table.num_rows * args.resident_fraction) * table.row_bytes
    if args.child_alone:
        skip = resident_bytes // table.row_bytes  # the leading slots a source keeps resident
        table.close()
        print(json.dumps(read_ahead_alone(path, chunks, skip)))
        return
    source = EmbeddingSource(table, device=args.device, resident_bytes=resident_bytes, max_ids=CHUNK_TOKENS * 16)
    work = GpuWork(args.child_work_ms) if args.device != "cpu" else SleepWork(args.child_work_ms)
    result = run_prompt(source, path, chunks, work, True)
    result.pop("values")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--resident-fraction", type=float, default=0.05)
    parser.add_argument("--work-ms", default="100,20")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alone-rounds", type=int, default=2, help="rounds of read-ahead alone (0: none)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--old-tree", type=Path, help="a built checkout of older code to run beside this one")
    # A child run (--old-tree's): the tree it imports, the parent's ids, and what it runs.
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-ids", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-alone", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-work-ms", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = args.table
    if args.child_ids is not None:
        child(args, path)
        return
    table = open_cold(path)
    spec = NgramSpec.from_json(table.manifest["ngram"])
    ids = real_text_row_ids(spec, CHUNK_TOKENS * CHUNKS, part=0, parts=2)
    chunks = [ids[k * CHUNK_TOKENS:(k + 1) * CHUNK_TOKENS] for k in range(CHUNKS)]
    resident_bytes = int(table.num_rows * args.resident_fraction) * table.row_bytes
    source = EmbeddingSource(table, device=args.device, resident_bytes=resident_bytes, max_ids=CHUNK_TOKENS * 16)
    scratch = tempfile.TemporaryDirectory()
    ids_file = Path(scratch.name) / "ids.npy"
    np.save(ids_file, ids)
    with open_table(path, read_path="mapped") as reference:
        # The bits of each value rounded to bf16 as the model rounds them (bench/gpu_bench.py).
        expected = [(round_to_bf16(reference.values(chunk.reshape(-1)).astype(np.float64)).view(np.uint32)
                     >> 16).astype(np.uint16) for chunk in chunks]
        slots = reference.slot_of(ids.reshape(-1))
        disk = slots[slots >= source.num_resident]
        distinct_pages = int(len(np.unique(disk // reference.rows_per_page)))
        distinct_rows = int(len(np.unique(disk)))
    rate = disk_rate(path, table, distinct_pages)
    floor = distinct_pages / rate["reads_per_s"]
    report = {"table": str(path), "rows": table.num_rows, "read_path": table.read_path,
              "read_path_note": table.read_path_note,
              "gpu": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
              "compiled": table.compiled, "host_cache_compiled": hostcache._native is not None,
              "host_cache_bytes": table.host_cache.cache.budget_bytes, "resident_rows": source.num_resident,
              "prompt_tokens": CHUNK_TOKENS * CHUNKS, "distinct_disk_rows": distinct_rows,
              "distinct_disk_pages": distinct_pages, "disk": rate, "disk_floor_s": round(floor, 4), "runs": {}}
    exact = True
    variants = ("without", "with") + (("old_with",) if args.old_tree else ())
    for work_ms in [float(w) for w in args.work_ms.split(",")]:
        work = GpuWork(work_ms) if args.device != "cpu" else SleepWork(work_ms)
        bound = max(CHUNKS * work.ms / 1e3, floor)
        runs: dict[str, list] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            rate_before = disk_rate(path, table, distinct_pages)
            for name in variants if round_index % 2 == 0 else variants[::-1]:
                if name == "old_with":
                    result = old_tree_run(args.old_tree, path, ids_file,
                                          ["--device", args.device, "--child-work-ms", str(work_ms),
                                           "--resident-fraction", str(args.resident_fraction)])
                else:
                    result = run_prompt(source, path, chunks, work, name == "with")
                    values = result.pop("values")
                    exact &= all(np.array_equal(v.reshape(-1, table.values_per_row).cpu().view(torch.int16)
                                                .numpy().view(np.uint16), e) for v, e in zip(values, expected))
                rate_after = disk_rate(path, table, distinct_pages)
                for key, name_beside in (("reads_per_s", "bound_beside_s"),
                                         ("reader_sorted_per_s", "sorted_floor_beside_s")):
                    if key in rate_after:
                        beside = [rate_before[key], rate_after[key]]
                        result[f"disk_{key}_beside"] = beside
                        result[name_beside] = round(max(CHUNKS * work.ms / 1e3, 2 * distinct_pages / sum(beside)), 4)
                rate_before = rate_after
                runs[name].append(result)
        report["runs"][f"W={work_ms:g}"] = {"work_ms": round(work.ms, 2), "bound_s": round(bound, 4), **runs} | {
            f"{name}_x_bound": [round(r["total_s"] / bound, 3) for r in runs[name]] for name in variants} | {
            f"{name}_x_bound_beside": [round(r["total_s"] / r["bound_beside_s"], 3) for r in runs[name]]
            for name in variants} | {
            f"{name}_x_sorted_floor_beside": [round(r["total_s"] / r["sorted_floor_beside_s"], 3) for r in runs[name]
                                              if "sorted_floor_beside_s" in r] for name in variants}
    report["exact"] = exact
    if args.alone_rounds:
        report["read_ahead_alone"] = alone_rounds(args, path, chunks, source.num_resident, distinct_pages, ids_file)
    print(json.dumps(report, indent=1))


def alone_rounds(args, path: Path, chunks: list[np.ndarray], skip_slots: int, pages: int, ids_file: Path) -> dict:
    """Read-ahead alone against fio at depth 64 and the table's reader at its depth, alternating."""
    sides = ["fio_qd64", "reader", "read_ahead"] + (["old_read_ahead"] if args.old_tree else [])
    rates: dict[str, list] = {side: [] for side in sides}
    for round_index in range(args.alone_rounds):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            if side == "fio_qd64":
                evict(path)
                rate = fio_random_read(path, 6)["iops"] if shutil.which("fio") else None
            elif side == "reader":
                rate = round(reader_rate(path, pages, round_index))
            elif side == "read_ahead":
                rate = read_ahead_alone(path, chunks, skip_slots)["pages_per_s"]
            else:
                what = ["--child-alone", "--resident-fraction", str(args.resident_fraction)]
                rate = old_tree_run(args.old_tree, path, ids_file, what)["pages_per_s"]
            rates[side].append(rate)
    ratios = {f"read_ahead_x_{side}": [round(a / b, 3) for a, b in zip(rates["read_ahead"], rates[side]) if a and b]
              for side in sides if side != "read_ahead"}
    return {"pages_per_s": rates, **ratios}


if __name__ == "__main__":
    main()
