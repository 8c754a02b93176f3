"""Host cache policies on held-out real text: hit rates by budget against the offline optimum.

    python bench/synthetic.py /work/scratch/cache/ple-6g-placed.bin --base 2500000 \\
        --profile-tokens 1000000 --placed 21000000
    python bench/host_cache_policy_bench.py /work/scratch/cache/ple-6g-placed.bin --tokens 300000

The table's order comes from one half of the standard library's sources (synthetic.py, part 1);
the trace is real text from the other half (part 0), so nothing measured was profiled. Each
token's rows that the GPU tier (the file's leading `--gpu-fraction` of slots) does not hold are
one access each (a token's repeated rows once), in token order. For budgets of 0.5-10% of the
table's bytes, the share of those accesses served by:

- `lru`, `clock`, `s3fifo`, `2q`: fully associative caches of rows (Python models of each policy);
- `belady`: the offline optimum (evict the row used furthest in the future; a row whose next use
  is further than every cached row's is not admitted), an upper bound for any policy;
- `hostcache`: runtime/hostcache.py itself (set-associative, per-set clock), run on the trace;
- `lru_pages`: an LRU cache of whole pages of the same bytes (what a page cache of that size gets).

Page reads per token left after each cache (the distinct pages of a token's missed rows) are
printed beside the hit rates. Prints one JSON object; BENCHMARKS.md records it.
"""
from __future__ import annotations

import argparse
import collections
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.hostcache import HostCache  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

BUDGETS = (0.005, 0.01, 0.02, 0.05, 0.10)


def trace(table, tokens: int, gpu_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Disk-tier slots of each token of held-out text, end to end, and each token's start."""
    spec = NgramSpec.from_json(table.manifest["ngram"])
    ids = real_text_row_ids(spec, tokens, part=0, parts=2)
    slots = table.slot_of(ids).reshape(ids.shape)
    resident = int(table.num_rows * gpu_fraction)
    pieces, starts = [], [0]
    for row in slots:
        disk = np.unique(row[row >= resident])
        pieces.append(disk)
        starts.append(starts[-1] + len(disk))
    return np.concatenate(pieces), np.array(starts, dtype=np.int64)


def lru(keys: list[int], capacity: int) -> int:
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = 0
    for key in keys:
        if key in cache:
            cache.move_to_end(key)
            hits += 1
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def clock(keys: list[int], capacity: int) -> int:
    where: dict[int, int] = {}
    ring = [-1] * capacity
    referenced = bytearray(capacity)
    hand = hits = 0
    for key in keys:
        entry = where.get(key)
        if entry is not None:
            referenced[entry] = 1
            hits += 1
            continue
        while referenced[hand]:
            referenced[hand] = 0
            hand = (hand + 1) % capacity
        if ring[hand] >= 0:
            del where[ring[hand]]
        ring[hand], where[key] = key, hand
        hand = (hand + 1) % capacity
    return hits


def s3fifo(keys: list[int], capacity: int) -> int:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10%) filters rows seen once; a main FIFO
    with reinsertion; a ghost FIFO of keys evicted from the small one."""
    small_size = max(1, capacity // 10)
    main_size = capacity - small_size
    small: collections.deque[int] = collections.deque()
    main: collections.deque[int] = collections.deque()
    ghost: collections.OrderedDict[int, None] = collections.OrderedDict()
    frequency: dict[int, int] = {}
    hits = 0

    def evict_main() -> None:
        while True:
            key = main.popleft()
            if frequency[key]:
                frequency[key] -= 1
                main.append(key)
            else:
                del frequency[key]
                return

    for key in keys:
        if key in frequency:
            frequency[key] = min(frequency[key] + 1, 3)
            hits += 1
            continue
        if key in ghost:
            del ghost[key]
            if len(main) >= main_size:
                evict_main()
            main.append(key)
            frequency[key] = 0
            continue
        while len(small) >= small_size:
            old = small.popleft()
            if frequency[old]:
                if len(main) >= main_size:
                    evict_main()
                main.append(old)
                frequency[old] = 0
            else:
                del frequency[old]
                ghost[old] = None
                if len(ghost) > main_size:
                    ghost.popitem(last=False)
        small.append(key)
        frequency[key] = 0
    return hits


def two_queue(keys: list[int], capacity: int) -> int:
    """2Q (Johnson and Shasha, 1994): A1in FIFO (25%), A1out ghost (50%), Am LRU."""
    in_size = max(1, capacity // 4)
    out_size = max(1, capacity // 2)
    a1in: collections.OrderedDict[int, None] = collections.OrderedDict()
    a1out: collections.OrderedDict[int, None] = collections.OrderedDict()
    am: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = 0
    for key in keys:
        if key in am:
            am.move_to_end(key)
            hits += 1
            continue
        if key in a1in:
            hits += 1
            continue
        if key in a1out:
            del a1out[key]
            am[key] = None
            if len(am) + len(a1in) > capacity:
                am.popitem(last=False)
            continue
        a1in[key] = None
        if len(a1in) > in_size:
            old, _ = a1in.popitem(last=False)
            a1out[old] = None
            if len(a1out) > out_size:
                a1out.popitem(last=False)
        if len(am) + len(a1in) > capacity:
            am.popitem(last=False)
    return hits


def next_uses(keys: np.ndarray) -> np.ndarray:
    """Index of each access's key's next access (len(keys) when there is none)."""
    order = np.argsort(keys, kind="stable")
    following = np.full(len(keys), len(keys), dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    return following


def belady(keys: np.ndarray, capacity: int) -> int:
    following = next_uses(keys).tolist()
    cached: dict[int, int] = {}   # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for index, key in enumerate(keys.tolist()):
        upcoming = following[index]
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while -heap[0][0] != cached.get(heap[0][1]):
                heapq.heappop(heap)
            if -heap[0][0] <= upcoming:
                continue  # not admitted: every cached row is used before this one
            del cached[heapq.heappop(heap)[1]]
        if upcoming == len(following):
            cached.pop(key, None)  # never used again: holding it helps nothing
            continue
        cached[key] = upcoming
        heapq.heappush(heap, (-upcoming, key))
    return hits


def host_cache(table, keys: np.ndarray, starts: np.ndarray, budget: int) -> tuple[int, int]:
    """Hits of runtime/hostcache.py on the trace, token by token; and the page reads left."""
    cache = HostCache(table.header, budget)
    rows = np.zeros((int(np.diff(starts).max()), table.row_bytes), dtype=np.uint8)
    hits = page_reads = 0
    for low, high in zip(starts[:-1].tolist(), starts[1:].tolist()):
        if high == low:
            continue
        slots = keys[low:high]
        missed = cache.lookup(slots, rows[:high - low])
        hits += high - low - len(missed)
        if len(missed):
            cache.admit(slots[missed], rows[:len(missed)])
            page_reads += len(np.unique(slots[missed] // table.rows_per_page))
    return hits, page_reads


def lru_pages(pages: np.ndarray, starts: np.ndarray, capacity: int) -> int:
    """Page reads left after an LRU cache of `capacity` pages, token by token."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    reads = 0
    for low, high in zip(starts[:-1].tolist(), starts[1:].tolist()):
        for page in set(pages[low:high].tolist()):
            if page in cache:
                cache.move_to_end(page)
            else:
                reads += 1
                cache[page] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--gpu-fraction", type=float, default=0.01)
    args = parser.parse_args()
    with open_table(args.table) as table:
        started = time.perf_counter()
        keys, starts = trace(table, args.tokens, args.gpu_fraction)
        tokens = len(starts) - 1
        key_list = keys.tolist()
        page_keys = keys // table.rows_per_page
        no_cache_pages = sum(len(np.unique(page_keys[a:b])) for a, b in zip(starts[:-1], starts[1:]))
        report = {"table": str(args.table), "rows": table.num_rows, "tokens": tokens,
                  "gpu_fraction": args.gpu_fraction, "disk_accesses": len(keys),
                  "distinct_disk_rows": int(len(np.unique(keys))),
                  "page_reads_per_token_without_cache": round(no_cache_pages / tokens, 3), "budgets": {}}
        for fraction in BUDGETS:
            capacity = int(table.num_rows * fraction)  # rows of the table's bytes
            budget = capacity * table.row_bytes
            result = {"budget_bytes": budget, "rows": capacity}
            for name, run in (("lru", lru), ("clock", clock), ("s3fifo", s3fifo), ("2q", two_queue)):
                result[name] = round(run(key_list, capacity) / len(keys), 4)
            result["belady"] = round(belady(keys, capacity) / len(keys), 4)
            hits, reads = host_cache(table, keys, starts, budget)
            result["hostcache"] = round(hits / len(keys), 4)
            result["hostcache_x_belady"] = round(result["hostcache"] / result["belady"], 3)
            result["hostcache_page_reads_per_token"] = round(reads / tokens, 3)
            page_capacity = budget // table.page_size
            result["lru_pages_hit"] = round(1 - lru_pages(page_keys, starts, page_capacity) / no_cache_pages, 4)
            report["budgets"][f"{fraction:.3f}"] = result
            print(json.dumps({f"{fraction:.3f}": result}), file=sys.stderr, flush=True)
        report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
