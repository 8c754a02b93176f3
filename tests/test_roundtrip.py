"""Convert a fixture checkpoint, read it back, and compare with the source bytes."""
from __future__ import annotations

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table


@pytest.mark.parametrize("variant", ["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def test_convert_gather_returns_source_bytes(variant, request, tmp_path):
    checkpoint = request.getfixturevalue(variant)
    with open_source(checkpoint) as source:
        convert(source, tmp_path / "t.bin")
        expected = source.read_rows(0, source.num_rows)
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(1).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])
