"""`ple-prep verify` and `ple-prep inspect` through the CLI."""
from __future__ import annotations

import json
import shutil

import pytest
from support.file_systems import skip_unless_on_a_block_file_system
from support.handmade import find, load_tensors

from ple_prep.cli import cli
from ple_prep.converters.safetensors import read_header
from ple_prep.tools.benchmark import cached_fraction, evict
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint


@pytest.fixture
def converted(fp8_checkpoint, runner, tmp_path):
    """A private copy of the FP8 checkpoint and its converted table."""
    model = tmp_path / "ckpt"
    shutil.copytree(fp8_checkpoint, model)
    out = tmp_path / "t.bin"
    result = runner.invoke(cli, ["convert", "--model", str(model), "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return model, out


def flip_source_rows(model, shard, local_rows):
    """Flip one byte in each given row of one shard, in place; returns their global row ids."""
    name, tensor = find(load_tensors(model), f".shard_{shard}.weight")
    info = read_header(model / name)[tensor]
    with open(model / name, "r+b") as handle:
        for row in local_rows:
            handle.seek(info.offset + row * 160 + 17)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0x40]))
    return [shard * 132 + row for row in local_rows]


def test_verify_match_exits_zero(converted, runner):
    model, out = converted
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model)])
    assert result.exit_code == 0, result.output
    assert result.stdout == ("checksums: 1 block, 0 bad, header ok\n"
                             f"rows: {FIXTURE_ROWS:,} compared, 0 differ\n")


def test_verify_json_report(converted, runner):
    model, out = converted
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model), "--json", "-q"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["rows_compared"] == FIXTURE_ROWS
    assert report["checksum_blocks"] == 1 and report["bad_blocks"] == []


def test_verify_checksums_only_without_model(converted, runner):
    _, out = converted
    result = runner.invoke(cli, ["verify", str(out), "--json", "-q"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["rows_compared"] == 0


def test_verify_reads_the_table_past_the_page_cache(converted, runner):
    """A verify of a table the size of RAM must not push the host's other pages out of the cache."""
    _, out = converted
    skip_unless_on_a_block_file_system(out)
    evict(out)
    if (cached_fraction(out) or 0) > 0.5:
        pytest.skip("the page cache does not let this file's pages go")
    result = runner.invoke(cli, ["verify", str(out), "--json", "-q"])
    assert result.exit_code == 0 and json.loads(result.stdout)["checksum_blocks"] == 1
    assert cached_fraction(out) < 0.1


def test_verify_source_difference_names_first_rows(converted, runner):
    model, out = converted
    changed = flip_source_rows(model, 7, [3, 90, 131]) + flip_source_rows(model, 100, [0])
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model)])
    assert result.exit_code == 1
    assert f"rows: {FIXTURE_ROWS:,} compared, 4 differ, first {changed}" in result.stdout
    assert result.stderr == f"error: {out} does not match: rows {changed} differ\n"
    report = json.loads(runner.invoke(cli, ["verify", str(out), "--model", str(model), "--json",
                                            "-q"]).stdout)
    assert report["ok"] is False and report["first_mismatches"] == changed
    assert report["mismatched_rows"] == 4 and report["bad_blocks"] == []


def test_verify_sample_compares_n_rows(converted, runner):
    model, out = converted
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model), "--sample", "500",
                                 "--json", "-q"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["rows_compared"] == 500
    # A sample covering every row finds a difference anywhere.
    changed = flip_source_rows(model, 127, [5])
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model), "--sample", "20000",
                                 "--json", "-q"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["first_mismatches"] == changed


def test_verify_damaged_table_fails_checksum(converted, runner):
    model, out = converted
    data = bytearray(out.read_bytes())
    page, position = divmod(1000, 25)
    data[4096 + page * 4096 + position * 160 + 5] ^= 0xFF
    out.write_bytes(bytes(data))
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model), "--json", "-q"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [block["block"] for block in report["bad_blocks"]] == [0]
    assert report["first_mismatches"] == [1000]


def test_verify_damaged_header_region_fails(converted, runner):
    _, out = converted
    data = bytearray(out.read_bytes())
    data[2000] = 1  # inside the zero padding before the data region
    out.write_bytes(bytes(data))
    result = runner.invoke(cli, ["verify", str(out)])
    assert result.exit_code == 1
    assert "header BAD" in result.stdout


def test_verify_other_source_reported(converted, bf16_checkpoint, runner):
    _, out = converted
    result = runner.invoke(cli, ["verify", str(out), "--model", str(bf16_checkpoint)])
    assert result.exit_code == 1
    assert "\nsource: " in result.stdout and "rows: 0 compared" in result.stdout


def test_verify_another_checkpoint_names_the_one_the_table_came_from(converted, runner, tmp_path):
    model, out = converted
    other = make_checkpoint(tmp_path / "other", "fp8", seed=7)
    result = runner.invoke(cli, ["verify", str(out), "--model", str(other)])
    assert result.exit_code == 1
    assert result.stderr == (f"error: {out} was converted from {model.resolve()}, not from {other}: give that "
                             f"checkpoint to --model (or convert {other} again)\n")
    assert "source: another checkpoint: the 256 sampled rows differ" in result.stdout
    assert "changed since conversion" not in result.output
    report = json.loads(runner.invoke(cli, ["verify", str(out), "--model", str(other), "--json", "-q"]).stdout)
    assert report["converted_from"] == str(model.resolve()) and report["ok"] is False


def test_verify_changed_checkpoint_says_it_changed(converted, runner):
    model, out = converted
    tensors = {}
    for path in model.glob("*.safetensors"):
        tensors.update(read_header(path))
    scale = next(info for name, info in tensors.items() if name.endswith("ngram_embedding.weight_scale"))
    with open(scale.path, "r+b") as handle:  # the table's own checkpoint, its scale changed in place
        handle.seek(scale.offset)
        handle.write(bytes([0x54, 0x39]))
    result = runner.invoke(cli, ["verify", str(out), "--model", str(model), "--json", "-q"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["converted_from"] is None
    assert report["source_problems"] == ["changed since conversion: the scale was 5339, now 5439"]


def test_verify_missing_table_is_bad_input(runner, tmp_path):
    result = runner.invoke(cli, ["verify", str(tmp_path / "none.bin")])
    assert result.exit_code == 2
    assert result.stderr == f"error: no such file: {tmp_path / 'none.bin'}\n"


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_table_path_mistakes_say_what_is_wrong(command, converted, runner):
    _, out = converted
    mistakes = {out.with_name("pel.bin"): f"error: no such file: {out.with_name('pel.bin')} (tables in "
                                          f"{out.parent}: t.bin)",
                out.parent: f"error: {out.parent} is a folder; give the prepared table file in it",
                out.with_name("t.bin.json"): f"error: {out.with_name('t.bin.json')} is a manifest; give the "
                                             f"table it describes ({out})"}
    for given, message in mistakes.items():
        result = runner.invoke(cli, [command, str(given)])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def test_inspect_human(converted, runner):
    _, out = converted
    result = runner.invoke(cli, ["inspect", str(out)])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == f"table:      {out} ({4096 + 676 * 4096:,} bytes, format v2)"
    assert lines[1] == "encoding:   fp8_e4m3, 160 values in 160 bytes a row, 25 rows a 4096-byte page"
    assert lines[2] == f"rows:       {FIXTURE_ROWS:,} (global 0 to {FIXTURE_ROWS:,} of {FIXTURE_ROWS:,})"
    assert lines[3].startswith("scale:      0.0002012252807617") and lines[3].endswith("(BF16 0x5339)")
    assert lines[5] == "layout:     source-order, 0 rows placed first"


def test_inspect_json(converted, runner):
    _, out = converted
    result = runner.invoke(cli, ["inspect", str(out), "--json"])
    assert result.exit_code == 0
    manifest = json.loads(result.stdout)
    assert manifest == json.loads(out.with_name("t.bin.json").read_text())
    assert manifest["num_rows"] == FIXTURE_ROWS and manifest["encoding"] == "fp8_e4m3"


def test_inspect_refuses_a_manifest_of_another_conversion(converted, runner, tmp_path):
    model, out = converted
    other = tmp_path / "other.bin"
    assert runner.invoke(cli, ["convert", "--model", str(model), "--out", str(other), "-q"]).exit_code == 0
    shutil.copy(other.with_name("other.bin.json"), out.with_name("t.bin.json"))
    for command in (["inspect", str(out)], ["inspect", str(out), "--json"]):
        result = runner.invoke(cli, command)
        assert result.exit_code == 2 and result.stdout == "", command
        assert result.stderr.startswith("error: t.bin and t.bin.json come from different conversions")
    verified = runner.invoke(cli, ["verify", str(out)])  # what inspect now agrees with
    assert verified.exit_code == 1 and "t.bin and t.bin.json come from different conversions" in verified.stdout


def test_inspect_not_a_table(runner, tmp_path):
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.bin.json").write_text("[]")
    result = runner.invoke(cli, ["inspect", str(tmp_path / "x.bin")])
    assert result.exit_code == 2
    assert result.stderr == "error: x.bin.json: the manifest is not a JSON object\n"


def test_counts_and_sizes_read_as_english(converted, runner):
    _, out = converted
    verified = runner.invoke(cli, ["verify", str(out)]).stdout
    assert verified.startswith("checksums: 1 block, 0 bad") and "1 blocks" not in verified
    inspected = runner.invoke(cli, ["inspect", str(out)]).stdout
    assert "checksums:  1 crc32 block of 64.00 MiB" in inspected
    bench = runner.invoke(cli, ["bench", str(out), "--prefill-requests", "1", "--decode-requests", "2",
                                "--fio-seconds", "0"]).stdout
    assert f"({out.stat().st_size / 2**20:.2f} MiB)" in bench and "0.00 GiB" not in bench
