"""The step service (StepLookup's thread) with the table's host cache against without it, cold and warm.

    python bench/synthetic.py T --base 500000 --profile-tokens 1000000 --placed 4200000
    flock /tmp/ple-bench.lock python bench/step_cache_bench.py T

Two tables open on the same file with the direct read path: one with open_table's default host
cache, one with none (`host_cache_bytes=0`, the plugin before the cache served StepLookup); a
StepLookup on the CPU for each (the same C thread as on a GPU; the host does the device's part;
`--device cuda` runs it on a GPU),
its resident tier the hottest 1% of the table's rows. The disk is shared and its speed drifts, so
the two sides alternate step by step (which goes first swapped each time) and each ratio compares
neighbours. The file is evicted from the page cache once, then the slots of every id the run
will ask for are looked up (`slot_of`): the row map's pages are cached as a server's are, and no
side pays the faults for them in the other's place. Each round:
1. chunk: `--chunks` 4,096-token chunks of real text (65,536 ids each): each cold (the host cache
   emptied; O_DIRECT leaves nothing in the page cache), then at once the same chunk again (warm),
   one side then the other;
2. decode: one token's 16 rows, for `--tokens` consecutive tokens of later text that have a row
   off the resident tier, each token on one side then the other; first pass cold (the cache
   emptied before it: what a token's rows find is what earlier tokens of the text read), second
   pass the same tokens again (warm); p50 over the tokens.
Timed: the service thread's own time on a step (`host_ns` of StepLookup.stats(): the slot lookup,
the host cache, the disk reads: what a GPU would wait for) and a step's start and finish (wall,
which adds the CPU's decode). Every step's values are checked against the synthetic table's
bytes, decoded. A cold read right after the other side's read of the same blocks is faster (the
virtual disk's own cache), so the side that goes first pays more: each case reports the ratio of
the sides' medians over all steps (each order half the time), the median ratio of neighbours for
each order and their geometric mean, and each side's figures. Prints one JSON object.
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
    tensor = torch.from_numpy(ids).to(lookup.device)
    started = time.perf_counter_ns()
    lookup.start(tensor)
    values = lookup.finish()
    if lookup.device.type == "cuda":
        torch.cuda.synchronize(lookup.device)
    wall = (time.perf_counter_ns() - started) / 1e3
    return wall, (lookup.stats()["host_ns"] - before) / 1e3, values.view(torch.int16).cpu().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--resident-fraction", type=float, default=0.01)
    parser.add_argument("--device", default="cpu", help="cuda: the same steps on a GPU (the wall then adds its copy)")
    args = parser.parse_args()
    path = args.table
    tables = {"host_cache": open_table(path, read_path="direct"),
              "no_cache": open_table(path, read_path="direct", host_cache_bytes=0)}
    first = tables["host_cache"]
    spec = NgramSpec.from_json(first.manifest["ngram"])
    resident = int(first.num_rows * args.resident_fraction) * first.row_bytes
    lookups = {side: StepLookup(table, device=args.device, resident_bytes=resident, max_ids=CHUNK_TOKENS * 16)
               for side, table in tables.items()}
    per_round = args.chunks * CHUNK_TOKENS + 8 * args.tokens
    text = real_text_row_ids(spec, args.rounds * per_round)
    evict(path)
    first.slot_of(text.reshape(-1))  # the map's pages cached for both sides (the data stays out: O_DIRECT)
    time.sleep(5)  # the host cache's memory faulted in (in the background, once, as a server has it)
    results = {case: {side: [] for side in tables} for case in
               ("chunk_cold", "chunk_warm", "decode_cold", "decode_warm")}
    sides = list(tables)

    firsts = {case: [] for case in results}

    def run(case: str, ids: np.ndarray, bits: np.ndarray, order: int, cold: bool) -> None:
        firsts[case].append(sides[order % 2])
        for side in sides if order % 2 == 0 else sides[::-1]:
            if cold and tables[side].host_cache is not None:
                tables[side].host_cache.cache.clear()
            wall, host, got = step(lookups[side], ids)
            if not np.array_equal(got.reshape(-1), bits):
                raise SystemExit(f"{side} {case}: values differ from the table's bytes")
            results[case][side].append((wall, host))

    resident = lookups["no_cache"].num_resident
    for round_index in range(args.rounds):
        base = round_index * per_round
        for k in range(args.chunks):
            chunk = text[base + k * CHUNK_TOKENS:base + (k + 1) * CHUNK_TOKENS].reshape(-1).copy()
            bits = expected_bits(first, chunk)
            run("chunk_cold", chunk, bits, round_index + k, True)
            run("chunk_warm", chunk, bits, round_index + k, False)
        later = text[base + args.chunks * CHUNK_TOKENS:base + per_round]
        tokens = [token.copy() for token in later if (first.slot_of(token) >= resident).any()][:args.tokens]
        token_bits = [expected_bits(first, token) for token in tokens]
        for side in sides:
            if tables[side].host_cache is not None:
                tables[side].host_cache.cache.clear()
        for case in ("decode_cold", "decode_warm"):
            for k, (token, bits) in enumerate(zip(tokens, token_bits)):
                run(case, token, bits, round_index + k, False)
    report = {"table": str(path), "device": args.device, "rows": first.num_rows, "resident_rows": resident,
              "host_cache_bytes": first.host_cache.cache.budget_bytes, "rounds": args.rounds,
              "chunks_per_round": args.chunks, "decode_tokens_per_round": args.tokens, "chunk_ids": CHUNK_TOKENS * 16}
    for case, by_side in results.items():
        entry = {}
        for index, kind in ((1, "thread"), (0, "wall")):
            ratios = np.array([cached[index] / plain[index]
                               for cached, plain in zip(by_side["host_cache"], by_side["no_cache"])])
            first_side = np.array(firsts[case])
            by_order = {f"{side}_first": float(np.median(ratios[first_side == side])) for side in sides}
            medians = {side: float(np.median([sample[index] for sample in samples]))
                       for side, samples in by_side.items()}
            entry[f"{kind}_ratio"] = {"of_medians": round(medians["host_cache"] / medians["no_cache"], 3),
                                      **{key: round(value, 3) for key, value in by_order.items()},
                                      "geometric_mean": round(float(np.sqrt(np.prod(list(by_order.values())))), 3),
                                      "range": [round(float(ratios.min()), 3), round(float(ratios.max()), 3)]}
            for side, samples in by_side.items():
                values = [sample[index] for sample in samples]
                entry[f"{side}_{kind}_us"] = {"p50": round(float(np.median(values)), 1),
                                              "range": [round(min(values), 1), round(max(values), 1)]}
        report[case] = entry
    report["stats"] = {side: lookup.stats() for side, lookup in lookups.items()}
    for lookup in lookups.values():
        lookup.close()
    for table in tables.values():
        table.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
