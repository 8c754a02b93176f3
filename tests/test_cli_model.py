"""CLI tests of --model: a path or a model name found in a Hugging Face cache built in the test."""
from __future__ import annotations

import json

import numpy as np
import pytest
from support.hubcache import add_checkpoint, add_snapshot, commit_hash
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS


@pytest.fixture(scope="module")
def hub(fp8_checkpoint, bf16_checkpoint, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    add_checkpoint(cache, "Qwen/Qwen3.8-Flash-Next-FP8", fp8_checkpoint, commit_hash("fp8"))
    add_checkpoint(cache, "Qwen/Qwen3.8-Flash-Next-BF16", bf16_checkpoint, commit_hash("bf16"))
    return cache


def test_convert_model_name_from_hf_cache(runner, hub, fp8_checkpoint, tmp_path):
    out = tmp_path / "ple.bin"
    result = runner.invoke(cli, ["convert", "--model", "Qwen/Qwen3.8-Flash-Next-FP8", "--out", str(out),
                                 "--json"], env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["encoding"] == "fp8_e4m3"
    manifest = json.loads(out.with_name("ple.bin.json").read_text())
    assert manifest["source"]["model"] == str(hub / "models--Qwen--Qwen3.8-Flash-Next-FP8" / "snapshots"
                                              / commit_hash("fp8"))
    with open_table(out) as table:
        ids = np.arange(table.num_rows)
        assert table.gather(ids).tobytes() == _source_rows(fp8_checkpoint, table.num_rows)


def _source_rows(checkpoint, num_rows):
    from ple_prep.converters import open_source

    with open_source(checkpoint) as source:
        return source.read_rows(0, num_rows).tobytes()


def test_verify_model_name_through_hf_home(runner, hub, fp8_checkpoint, tmp_path):
    out = tmp_path / "ple.bin"
    assert runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(out)]).exit_code == 0
    result = runner.invoke(cli, ["verify", str(out), "--model", "Qwen3.8-Flash-Next-FP8", "--json"],
                           env={"HF_HOME": str(hub.parent), "HF_HUB_CACHE": None})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["rows_compared"] == FIXTURE_ROWS


def test_convert_model_name_matching_two_repos_exits_2(runner, hub, tmp_path):
    out = tmp_path / "ple.bin"
    result = runner.invoke(cli, ["convert", "--model", "Qwen3.8-Flash-Next", "--out", str(out)],
                           env={"HF_HUB_CACHE": str(hub)})
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (f"error: Qwen3.8-Flash-Next matches 2 models in the Hugging Face cache at "
                             f"{hub}: Qwen/Qwen3.8-Flash-Next-BF16, Qwen/Qwen3.8-Flash-Next-FP8; "
                             "name one in full\n")
    assert list(tmp_path.iterdir()) == []


def test_convert_model_name_matching_none_exits_2(runner, hub, tmp_path):
    result = runner.invoke(cli, ["convert", "--model", "Llama-9", "--out", str(tmp_path / "ple.bin")],
                           env={"HF_HUB_CACHE": str(hub)})
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: no model Llama-9 in the Hugging Face cache at {hub}; cached: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_convert_gguf_quant_from_hf_cache(runner, tmp_path):
    from support.hubcache import add_snapshot

    from ple_prep.tools.fixtures import make_gguf

    q8 = make_gguf(tmp_path / "q8", "q8_0", num_files=2)
    iq4 = make_gguf(tmp_path / "iq4", "iq4_nl")
    files = {f"Q8_0/Qwen3.8-Flash-Next-Q8_0-0000{i}-of-00002.gguf":
             (q8 / f"model-0000{i}-of-00002.gguf").read_bytes() for i in (1, 2)}
    files["Qwen3.8-Flash-Next-IQ4_NL.gguf"] = (iq4 / "model.gguf").read_bytes()
    cache = tmp_path / "hub"
    add_snapshot(cache, "unsloth/Qwen3.8-Flash-Next-GGUF", commit_hash("gguf"), files)
    for quant, encoding in (("Q8_0", "gguf_q8_0"), ("IQ4_NL", "gguf_iq4_nl")):
        out = tmp_path / f"{quant}.bin"
        result = runner.invoke(cli, ["convert", "--model", f"unsloth/Qwen3.8-Flash-Next-GGUF:{quant}",
                                     "--out", str(out), "--json"], env={"HF_HUB_CACHE": str(cache)})
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["encoding"] == encoding
        result = runner.invoke(cli, ["verify", str(out), "--model", f"Qwen3.8-Flash-Next:{quant}", "--json"],
                               env={"HF_HUB_CACHE": str(cache)})
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["rows_compared"] == FIXTURE_ROWS


def test_convert_model_name_skips_cache_folders_no_hub_repo_has(runner, fp8_checkpoint, tmp_path):
    cache = tmp_path / "hub"
    add_checkpoint(cache, "someone/c", fp8_checkpoint, commit_hash("c"))
    for odd in ("x/a..b", "a/b/c"):  # models--x--a..b and models--a--b--c: no valid repo id
        add_snapshot(cache, odd, commit_hash(odd), {"config.json": b"{}"})
    out = tmp_path / "out"
    out.mkdir()
    env = {"HF_HUB_CACHE": str(cache)}
    for name in ("a..b", "x/a..b"):
        result = runner.invoke(cli, ["convert", "--model", name, "--out", str(out / "t.bin")], env=env)
        assert_refused(result, out, f"no model {name} in the Hugging Face cache at {cache}; cached: someone/c;")
    result = runner.invoke(cli, ["convert", "--model", "c", "--out", str(out / "t.bin"), "-q"], env=env)
    assert result.exit_code == 0, result.output
