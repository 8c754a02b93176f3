"""Tensor-parallel rank files: each rank's block of rows, global ids, and the union equals the table."""
from __future__ import annotations

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.format.manifest import load_manifest, manifest_path, validate_manifest
from ple_prep.offline.ranks import convert_ranks, rank_path, rank_rows
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS


def test_rank_rows_match_spec_section_6():
    assert rank_rows(320_001_536, 2, 0) == (0, 160_000_768)
    assert rank_rows(320_001_536, 2, 1) == (160_000_768, 160_000_768)
    assert rank_rows(FIXTURE_ROWS, 8, 7) == (7 * 2112, 2112)


@pytest.mark.parametrize("size, rank", [(5, 0), (7, 3), (0, 0), (2, 2), (2, -1)])
def test_rank_rows_refuses_sizes_that_do_not_divide_and_bad_ranks(size, rank):
    with pytest.raises(BadInput):
        rank_rows(FIXTURE_ROWS, size, rank)


def test_rank_path_puts_rank_before_suffix(tmp_path):
    assert rank_path(tmp_path / "ple.bin", 1, 4).name == "ple.tp1of4.bin"
    assert rank_path(tmp_path / "ple", 0, 2).name == "ple.tp0of2"


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_convert_ranks_union_equals_full_table(fp8_checkpoint, tmp_path, tp_size):
    with open_source(fp8_checkpoint) as source:
        written = convert_ranks(source, tmp_path / "ple.bin", tp_size)
        expected = source.read_rows(0, source.num_rows)
    covered = np.zeros(len(expected), dtype=np.int64)
    union = np.zeros_like(expected)
    for rank, (path, manifest) in enumerate(written):
        assert path == rank_path(tmp_path / "ple.bin", rank, tp_size)
        assert manifest["tensor_parallel"] == {"rank": rank, "size": tp_size}
        with open_table(path) as table:
            first, stop = table.row_range
            assert (first, stop) == (rank * len(expected) // tp_size, (rank + 1) * len(expected) // tp_size)
            assert table.tensor_parallel == {"rank": rank, "size": tp_size}
            ids = np.arange(first, stop)
            union[ids] = table.gather(ids)
            covered[ids] += 1
            for outside in (first - 1, stop):
                if 0 <= outside < len(expected):
                    with pytest.raises(IndexError):
                        table.gather(np.array([outside]))
    assert np.all(covered == 1)
    assert np.array_equal(union, expected)


def test_convert_ranks_one_rank_only(bf16_checkpoint, tmp_path):
    with open_source(bf16_checkpoint) as source:
        written = convert_ranks(source, tmp_path / "ple.bin", 4, [2])
        expected = source.read_rows(0, source.num_rows)
    assert [p.name for p, _ in written] == ["ple.tp2of4.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ple.tp2of4.bin", "ple.tp2of4.bin.json"]
    with open_table(written[0][0]) as table:
        ids = np.arange(*table.row_range)
        assert table.values(ids).shape == (len(ids), 160)
        assert np.array_equal(table.gather(ids), expected[ids])


def test_manifest_refuses_rank_rows_that_are_not_the_ranks_block(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        path, _ = convert_ranks(source, tmp_path / "ple.bin", 2, [1])[0]
    manifest = load_manifest(manifest_path(path))
    validate_manifest(manifest)
    for tp in ({"rank": 0, "size": 2}, {"rank": 1, "size": 4}, {"rank": 2, "size": 2},
               {"rank": "1", "size": 2}, [1, 2]):
        with pytest.raises(BadInput):
            validate_manifest(manifest | {"tensor_parallel": tp})
