"""`ple-prep make-fixture` and `ple-prep demo` through the CLI."""
from __future__ import annotations

import hashlib
import json

import pytest
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.converters.safetensors import open_checkpoint
from ple_prep.core.errors import BadInput
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint, make_fixture


def folder_digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("variant, encoding", [("fp8", "fp8_e4m3"), ("bf16", "bf16"),
                                               ("nvfp4", "nvfp4_packed")])
def test_make_fixture_writes_real_layout(variant, encoding, runner, tmp_path):
    out = tmp_path / "tiny"
    result = runner.invoke(cli, ["make-fixture", str(out), "--variant", variant])
    assert result.exit_code == 0 and result.stdout == f"wrote {variant} checkpoint to {out}\n"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["ngram_vocab_size_base"] == 1000 and config["split_ngram_parts"] == 128
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert any(name.endswith("mlp.up_proj.weight") for name in index["weight_map"])
    with open_checkpoint(out) as source:
        assert source.encoding.label == encoding and source.num_rows == FIXTURE_ROWS
        assert source.extra["shards"] == 128


def test_make_fixture_is_deterministic(runner, tmp_path):
    for name in ("a", "b"):
        assert runner.invoke(cli, ["make-fixture", str(tmp_path / name), "--seed", "4"]).exit_code == 0
    assert folder_digest(tmp_path / "a") == folder_digest(tmp_path / "b")
    assert runner.invoke(cli, ["make-fixture", str(tmp_path / "c"), "--seed", "5"]).exit_code == 0
    assert folder_digest(tmp_path / "a") != folder_digest(tmp_path / "c")


def test_make_fixture_refuses_a_negative_seed(runner, tmp_path):
    result = runner.invoke(cli, ["make-fixture", str(tmp_path / "m"), "--seed", "-1"])
    assert_refused(result, tmp_path, "--seed", "-1 is not in the range x>=0")
    with pytest.raises(BadInput, match="seed must be a non-negative integer, not -1"):
        make_fixture(tmp_path / "m", seed=-1)
    assert list(tmp_path.iterdir()) == []


def test_make_fixture_matches_library(runner, tmp_path):
    assert runner.invoke(cli, ["make-fixture", str(tmp_path / "cli"), "--variant", "bf16",
                               "--base", "1200", "--shards", "7"]).exit_code == 0
    make_checkpoint(tmp_path / "lib", "bf16", base=1200, num_shards=7)
    assert folder_digest(tmp_path / "cli") == folder_digest(tmp_path / "lib")
    with open_checkpoint(tmp_path / "cli") as source:
        assert source.spec.ngram_vocab_size_base == 1200 and source.extra["shards"] == 7
        assert source.num_rows == source.spec.rows_stored


def test_make_fixture_unsplittable_shards_refused(runner, tmp_path):
    # FIXTURE_ROWS rows in 16,000 shards would leave the last shards empty.
    result = runner.invoke(cli, ["make-fixture", str(tmp_path / "x"), "--shards", "16000"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {FIXTURE_ROWS} rows cannot be split into 16000 shards")
    assert list(tmp_path.iterdir()) == []  # nothing left behind


@pytest.mark.parametrize("variant", ["fp8", "bf16", "nvfp4"])
def test_demo_converts_and_verifies(variant, runner, tmp_path):
    result = runner.invoke(cli, ["demo", "--dir", str(tmp_path), "--variant", variant, "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["verified"] is True and summary["rows_verified"] == FIXTURE_ROWS == summary["rows"]
    assert len(summary["token_0_rows"]) == 16
    assert (tmp_path / f"ple-{variant}.bin").exists() and (tmp_path / f"ple-{variant}.bin.json").exists()


def test_demo_prints_summary_in_temporary_folder(runner):
    result = runner.invoke(cli, ["demo"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["verified"] == "True" and lines["encoding"] == "fp8_e4m3"
    # The temporary folder is gone when the summary prints: no path to it is shown.
    assert "ple-prep-demo-" not in result.stdout and "checkpoint" not in lines and "table" not in lines
    assert lines["files"] == "written to a temporary folder and removed (keep them with --dir DIR)"
    summary = json.loads(runner.invoke(cli, ["demo", "--json", "-q"]).stdout)
    assert summary["checkpoint"] is None and summary["table"] is None and summary["verified"] is True


def test_make_fixture_refuses_an_existing_folder_without_force(runner, tmp_path):
    out = tmp_path / "tiny"
    assert runner.invoke(cli, ["make-fixture", str(out)]).exit_code == 0
    before = folder_digest(out)
    result = runner.invoke(cli, ["make-fixture", str(out), "--seed", "3"])
    assert result.exit_code == 2
    assert result.stderr == f"error: {out} exists; pass --force to replace it\n"
    assert folder_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_make_fixture_force_replaces_the_folder_whole(runner, tmp_path):
    out = tmp_path / "tiny"
    assert runner.invoke(cli, ["make-fixture", str(out)]).exit_code == 0
    result = runner.invoke(cli, ["make-fixture", str(out), "--variant", "gguf-q8_0", "--force"])
    assert result.exit_code == 0, result.output
    # Only the GGUF model: no safetensors files of the fp8 fixture left beside it for convert to refuse.
    assert sorted(p.name for p in out.iterdir()) == ["model.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    converted = runner.invoke(cli, ["convert", "--model", str(out), "--out", str(tmp_path / "t.bin"), "-q"])
    assert converted.exit_code == 0, converted.output


def test_make_fixture_force_never_replaces_other_files(runner, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    result = runner.invoke(cli, ["make-fixture", str(out), "--force"])
    assert result.exit_code == 2
    assert "holds files a fixture does not write (notes.txt)" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
