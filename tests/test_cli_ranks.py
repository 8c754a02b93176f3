"""`ple-prep convert --tp-size/--tp-rank`: file names, JSON summary, refusals."""
from __future__ import annotations

import json

import numpy as np
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.converters import open_source
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS


def test_convert_tp_size_writes_one_file_per_rank(runner, fp8_checkpoint, tmp_path):
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out",
                                 str(tmp_path / "ple.bin"), "--tp-size", "2", "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["tp_size"] == 2
    assert [(f["tp_rank"], f["first_row"], f["rows"]) for f in summary["files"]] == [
        (0, 0, FIXTURE_ROWS // 2), (1, FIXTURE_ROWS // 2, FIXTURE_ROWS // 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ple.tp0of2.bin", "ple.tp0of2.bin.json", "ple.tp1of2.bin", "ple.tp1of2.bin.json"]
    with open_source(fp8_checkpoint) as source, open_table(tmp_path / "ple.tp1of2.bin") as table:
        half = FIXTURE_ROWS // 2
        assert np.array_equal(table.gather(np.arange(half, FIXTURE_ROWS)), source.read_rows(half, FIXTURE_ROWS))


def test_convert_tp_rank_writes_one_file(runner, fp8_checkpoint, tmp_path):
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out",
                                 str(tmp_path / "ple.bin"), "--tp-size", "4", "--tp-rank", "3"])
    assert result.exit_code == 0, result.output
    assert f"rank 3 of 4, rows {FIXTURE_ROWS * 3 // 4:,} to {FIXTURE_ROWS:,}" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ple.tp3of4.bin", "ple.tp3of4.bin.json"]
    inspected = runner.invoke(cli, ["inspect", str(tmp_path / "ple.tp3of4.bin")])
    assert "tp rank:    3 of 4" in inspected.output


def test_convert_tp_size_that_does_not_divide_rows_is_refused(runner, fp8_checkpoint, tmp_path):
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out",
                                 str(tmp_path / "ple.bin"), "--tp-size", "5"])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {FIXTURE_ROWS} rows do not split evenly over 5 ranks")
    assert list(tmp_path.iterdir()) == []


def test_convert_tp_rank_without_size_or_out_of_range_is_refused(runner, fp8_checkpoint, tmp_path):
    base = ["convert", "--model", str(fp8_checkpoint), "--out", str(tmp_path / "ple.bin")]
    result = runner.invoke(cli, base + ["--tp-rank", "1"])
    assert (result.exit_code, result.output) == (2, "error: --tp-rank needs --tp-size\n")
    result = runner.invoke(cli, base + ["--tp-size", "2", "--tp-rank", "2"])
    assert result.exit_code == 2 and "outside 0..1" in result.output
    assert list(tmp_path.iterdir()) == []


def test_convert_tp_size_refuses_before_writing_any_rank_when_a_later_one_exists(runner, fp8_checkpoint, tmp_path):
    (tmp_path / "ple.tp1of2.bin").write_bytes(b"an older rank")
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(tmp_path / "ple.bin"),
                                 "--tp-size", "2", "-q"])
    assert_refused(result, tmp_path, "ple.tp1of2.bin exists; pass --force", left=["ple.tp1of2.bin"])
    assert (tmp_path / "ple.tp1of2.bin").read_bytes() == b"an older rank"
