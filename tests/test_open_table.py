"""open_table: placed rows, refusals at open (other conversion, truncated, wrong size), staleness."""
from __future__ import annotations

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.layouts.order import RowOrder
from ple_prep.layouts.writer import convert
from ple_prep.runtime import open_table


def test_open_table_placed_rows_read_back_exact(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        order = RowOrder.from_placed(np.array([500, 3, 77, source.num_rows - 1]), source.num_rows)
        convert(source, tmp_path / "t.bin", order=order)
        expected = source.read_rows(0, source.num_rows)
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(2).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])
        assert table.slot_of(np.array([500, 3, 77])).tolist() == [0, 1, 2]
