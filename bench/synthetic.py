"""A synthetic table at the model's geometry with a smaller `ngram_vocab_size_base`, written fast.

The rows' bytes are a function of the row id (a fixed random block repeated, the row id stamped in
the first 8 bytes), so any row read back can be checked without keeping a copy. The hash spec is the
model's with a smaller base (every rule kept, head sizes the primes after the base), so real text
through `ple_prep.ngram.row_ids` gives ids inside this table.

    python bench/synthetic.py /work/bigdata/issue4/ple-6g.bin --base 2500000 [--profile-tokens N] [--placed N]

With --profile-tokens, the rows real text reads most (from a profile part of the text disjoint from
the one the benchmarks measure) are placed first, hottest first: an access-ordered layout. With
--placed, rows drawn at random (seeded) follow them until the map holds that many rows: a map of
the real table's default size (21M placed rows) on a smaller table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.converters.base import Scale, Segment, SourceFile, TableSource  # noqa: E402
from ple_prep.core.constants import Encoding  # noqa: E402
from ple_prep.format.layout import TableLayout  # noqa: E402
from ple_prep.format.order import RowOrder  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.offline.writer import (
    WriteOptions,  # noqa: E402
    convert,  # noqa: E402
)
from ple_prep.tools.fixtures import FIXTURE_SCALE_BF16, fixture_config  # noqa: E402

BLOCK_ROWS = 1 << 18
ROW_BYTES = 160


def _block(seed: int) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(0, 256, size=(BLOCK_ROWS, ROW_BYTES), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01  # no NaN codes, as in real tables
    return codes


def expected_rows(ids: np.ndarray, seed: int = 0, block: np.ndarray | None = None) -> np.ndarray:
    """The bytes of rows `ids` of the synthetic table."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    block = _block(seed) if block is None else block
    rows = block[ids % BLOCK_ROWS]
    rows[:, :8] = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
    return rows


class SyntheticSource(TableSource):
    """An FP8 table source with the fixture's scale whose rows come from `expected_rows`."""

    def __init__(self, base: int, seed: int = 0):
        spec = NgramSpec.from_config(fixture_config(base))
        raw = np.array([FIXTURE_SCALE_BF16], dtype="<u2").tobytes()
        scale = Scale("BF16", raw, float((np.array([FIXTURE_SCALE_BF16], dtype=np.uint32) << 16)
                                             .view(np.float32)[0]))
        rows = spec.rows_stored
        # Rows as an FP8 safetensors checkpoint holds them (the manifest's schema names real sources
        # only); the model's name says the table is synthetic.
        super().__init__(format="safetensors", model_dir=Path(f"synthetic-base{base}-seed{seed}"),
                         encoding=Encoding.FP8_E4M3, values_per_row=160,
                         parts=[[Segment(None, 0, 0, rows, ROW_BYTES)]], spec=spec,
                         files=[SourceFile("synthetic", rows * ROW_BYTES)], scale=scale)
        self.seed = seed
        self.block = _block(seed)

    def read_rows(self, start, stop, out=None):
        rows = expected_rows(np.arange(start, stop), self.seed, self.block)
        if out is not None:
            out[...] = rows
            return out
        return rows

    def gather_rows(self, ids):
        return expected_rows(ids, self.seed, self.block)

    def prefetch(self, start, stop):
        """Nothing to read ahead: rows are computed."""


def hot_order(spec: NgramSpec, num_rows: int, profile_tokens: int, placed: int = 0) -> RowOrder:
    """Rows read by the profile part of the real text, most read first, then random rows up to
    `placed` rows in all."""
    from ple_prep.tools.realtext import real_text_row_ids

    hottest = np.zeros(0, dtype=np.int64)
    if profile_tokens:
        ids = real_text_row_ids(spec, profile_tokens, part=1, parts=2).reshape(-1)
        rows, counts = np.unique(ids, return_counts=True)
        hottest = rows[np.argsort(-counts, kind="stable")]
    if placed > len(hottest):
        others = np.ones(num_rows, dtype=bool)
        others[hottest] = False
        fill = np.random.default_rng(1).permutation(np.flatnonzero(others))[:placed - len(hottest)]
        hottest = np.concatenate([hottest, fill])
    return RowOrder.from_placed(hottest, num_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=int, default=2_500_000)
    parser.add_argument("--profile-tokens", type=int, default=0)
    parser.add_argument("--placed", type=int, default=0,
                        help="Rows in the order map: the profile's hottest, then random rows.")
    args = parser.parse_args()
    source = SyntheticSource(args.base)
    order = hot_order(source.spec, source.num_rows, args.profile_tokens, args.placed) \
        if args.profile_tokens or args.placed else None
    started = time.perf_counter()
    layout = TableLayout(order, {"kind": "access-ordered", "num_placed": order.num_placed}) if order else None
    manifest = convert(source, args.out, WriteOptions(force=True), layout=layout)
    print(json.dumps({"table": str(args.out), "rows": manifest["num_rows"],
                      "file_bytes": manifest["file_size"], "placed": order.num_placed if order else 0,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
