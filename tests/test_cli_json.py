"""CLI tests of the scriptable surface: --json parsed and checked, --quiet, progress bars, exit codes."""
from __future__ import annotations

import io
import json
import sys

import pytest

from ple_prep.cli import cli
from ple_prep.format.manifest import manifest_path
from ple_prep.tools.fixtures import FIXTURE_ROWS


def test_convert_json_is_the_only_stdout(runner, fp8_checkpoint, tmp_path):
    out = tmp_path / "ple.bin"
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out)
    assert summary["rows"] == FIXTURE_ROWS and summary["encoding"] == "fp8_e4m3"
    assert summary["file_size"] == out.stat().st_size
    assert isinstance(summary["seconds"], float)
    # stderr is no terminal here, so tqdm stays silent.
    assert result.stderr == ""


def test_inspect_json_is_the_manifest(runner, fp8_table):
    result = runner.invoke(cli, ["inspect", str(fp8_table), "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest == json.loads(manifest_path(fp8_table).read_text())
    assert manifest["num_rows"] == FIXTURE_ROWS and manifest["row_bytes"] == 160
    assert manifest["file_size"] == fp8_table.stat().st_size


def test_verify_json_ok(runner, fp8_table, fp8_checkpoint):
    result = runner.invoke(cli, ["verify", str(fp8_table), "--model", str(fp8_checkpoint), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["rows_compared"] == FIXTURE_ROWS and report["mismatched_rows"] == 0
    assert report["bad_blocks"] == [] and report["header_ok"] is True
    assert report["checksum_blocks"] == len(json.loads(manifest_path(fp8_table).read_text())["checksums"]["blocks"])


def test_verify_json_failure_exits_1_with_the_report(runner, fp8_table, fp8_checkpoint, tmp_path):
    broken = tmp_path / "ple.bin"
    data = bytearray(fp8_table.read_bytes())
    manifest = json.loads(manifest_path(fp8_table).read_text())
    data[manifest["data_offset"] + 5] ^= 0x40  # row in slot 0, byte 5
    broken.write_bytes(bytes(data))
    manifest_path(broken).write_text(manifest_path(fp8_table).read_text())
    result = runner.invoke(cli, ["verify", str(broken), "--model", str(fp8_checkpoint), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert report["mismatched_rows"] == 1 and report["first_mismatches"] == [0]
    assert [block["block"] for block in report["bad_blocks"]] == [0]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_demo_json(runner, tmp_path):
    result = runner.invoke(cli, ["demo", "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["verified"] is True and summary["rows_verified"] == summary["rows"] == FIXTURE_ROWS
    assert len(summary["token_0_rows"]) == 16


def test_convert_quiet_prints_nothing(runner, fp8_checkpoint, tmp_path):
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(tmp_path / "a.bin"),
                                 "--quiet"])
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""
    assert (tmp_path / "a.bin").exists()


def test_verify_quiet_keeps_the_error_line(runner, fp8_table, tmp_path):
    broken = tmp_path / "ple.bin"
    data = bytearray(fp8_table.read_bytes())
    data[-1] ^= 1
    broken.write_bytes(bytes(data))
    manifest_path(broken).write_text(manifest_path(fp8_table).read_text())
    result = runner.invoke(cli, ["verify", str(broken), "--quiet"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"error: {broken} does not match\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_convert_progress_bar_only_on_a_terminal(fp8_checkpoint, tmp_path, monkeypatch, quiet):
    from ple_prep.cli import convert

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = ["--model", str(fp8_checkpoint), "--out", str(tmp_path / "a.bin")] + (["--quiet"] if quiet else [])
    convert.main(args, standalone_mode=False)
    assert ("convert" in terminal.getvalue()) is not quiet


def test_bad_input_exits_2_with_one_line(runner, tmp_path):
    result = runner.invoke(cli, ["inspect", str(tmp_path / "missing.bin"), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: no such file: ") and result.stderr.count("\n") == 1
