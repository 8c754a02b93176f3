"""The step service (StepLookup's thread) with the table's host cache against without it, cold and warm.

    python bench/synthetic.py T --base 500000 --profile-tokens 1000000 --placed 4200000
    flock /tmp/ple-bench.lock python bench/step_cache_bench.py T

Two tables open on the same file with the direct read path: one with open_table's default host
cache, one with none (`host_cache_bytes=0`, the plugin before the cache served StepLookup); a
StepLookup on the CPU for each (the same C thread as on a GPU; the host does the device's part),
its resident tier the hottest 1% of the table's rows. Each round, both sides in turn (the order
swapped every round), each case:
1. chunk: a 4,096-token chunk of real text (65,536 ids), cold (the file evicted from the page
   cache, the host cache emptied), then the same chunk again (warm);
2. decode: one token's 16 rows, for each of `--tokens` consecutive tokens of later text, cold
   (the file evicted, the cache emptied before the first), then the same tokens again (warm);
   p50 over the tokens.
Timed: a step's start and finish (wall), and the service thread's own time on it (`host_ns` of
StepLookup.stats(): the slot lookup, the host cache, the disk reads). Every step's values are
checked against the synthetic table's bytes, decoded. Prints one JSON object: per case and side
the rounds' figures, and the ratio with the cache over without per round.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import expected_rows  # noqa: E402

from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.runtime import StepLookup, open_table  # noqa: E402
from ple_prep.runtime.dequant import decode, round_to_bf16  # noqa: E402
from ple_prep.tools.benchmark import evict  # noqa: E402
from ple_prep.tools.realtext import real_text_row_ids  # noqa: E402

CHUNK_TOKENS = 4096


def expected_bits(table, ids: np.ndarray) -> np.ndarray:
    """The bf16 bits of the rows' values, rounded as the model rounds (tests/support/bf16_bits.py)."""
    values = decode(table.header.encoding, expected_rows(ids), table.values_per_row, table.scale)
    return (round_to_bf16(values.astype(np.float64)).view(np.uint32) >> 16).astype(np.uint16).view(np.int16).reshape(-1)


def step(lookup: StepLookup, ids: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(wall us, the service thread's us, the values' bf16 bits) of one step of `ids`."""
    before = lookup.stats()["host_ns"]
    tensor = torch.from_numpy(ids)
    started = time.perf_counter_ns()
    lookup.start(tensor)
    values = lookup.finish()
    wall = (time.perf_counter_ns() - started) / 1e3
    return wall, (lookup.stats()["host_ns"] - before) / 1e3, values.view(torch.int16).numpy()


def cold_start(path: Path, table) -> None:
    evict(path)
    if table.host_cache is not None:
        table.host_cache.cache.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--resident-fraction", type=float, default=0.01)
    args = parser.parse_args()
    path = args.table
    tables = {"host_cache": open_table(path, read_path="direct"),
              "no_cache": open_table(path, read_path="direct", host_cache_bytes=0)}
    first = tables["host_cache"]
    spec = NgramSpec.from_json(first.manifest["ngram"])
    resident = int(first.num_rows * args.resident_fraction) * first.row_bytes
    lookups = {side: StepLookup(table, device="cpu", resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
               for side, table in tables.items()}
    text = real_text_row_ids(spec, args.rounds * (CHUNK_TOKENS + args.tokens) + CHUNK_TOKENS)
    time.sleep(5)  # the host cache's memory faulted in (in the background, once, as a server has it)
    results = {case: {side: [] for side in tables} for case in
               ("chunk_cold", "chunk_warm", "decode_cold", "decode_warm")}
    for round_index in range(args.rounds):
        base = round_index * (CHUNK_TOKENS + args.tokens)
        chunk = text[base:base + CHUNK_TOKENS].reshape(-1).copy()
        tokens = [text[base + CHUNK_TOKENS + k].copy() for k in range(args.tokens)]
        chunk_bits = expected_bits(first, chunk)
        token_bits = [expected_bits(first, token) for token in tokens]
        sides = list(tables) if round_index % 2 == 0 else list(tables)[::-1]
        for side in sides:
            table, lookup = tables[side], lookups[side]
            cold_start(path, table)
            for case in ("chunk_cold", "chunk_warm"):
                wall, host, got = step(lookup, chunk)
                if not np.array_equal(got.reshape(-1), chunk_bits):
                    raise SystemExit(f"{side} {case}: values differ from the table's bytes")
                results[case][side].append((wall, host))
            cold_start(path, table)
            for case in ("decode_cold", "decode_warm"):
                walls, hosts = [], []
                for token, bits in zip(tokens, token_bits):
                    wall, host, got = step(lookup, token)
                    if not np.array_equal(got.reshape(-1), bits):
                        raise SystemExit(f"{side} {case}: values differ from the table's bytes")
                    walls.append(wall)
                    hosts.append(host)
                results[case][side].append((float(np.median(walls)), float(np.median(hosts))))
    report = {"table": str(path), "rows": first.num_rows, "resident_rows": lookups["no_cache"].num_resident,
              "host_cache_bytes": first.host_cache.cache.budget_bytes, "rounds": args.rounds,
              "decode_tokens": args.tokens, "chunk_ids": CHUNK_TOKENS * 16}
    for case, sides in results.items():
        entry = {}
        for side, samples in sides.items():
            entry[f"{side}_wall_us"] = [round(wall, 1) for wall, _ in samples]
            entry[f"{side}_thread_us"] = [round(host, 1) for _, host in samples]
        for index, kind in ((0, "wall"), (1, "thread")):
            ratios = [cached[index] / plain[index] for cached, plain in zip(sides["host_cache"], sides["no_cache"])]
            entry[f"{kind}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        report[case] = entry
    report["stats"] = {side: lookup.stats() for side, lookup in lookups.items()}
    for lookup in lookups.values():
        lookup.close()
    for table in tables.values():
        table.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
