"""CLI: GGUF and NVFP4 input end to end, and every bad input as one `error:` line, exit 2, no files."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_gguf


def patch_tensor_info(path, name: str, *, dims=None, type_id=None, new_name=None, move_by=0) -> None:
    """Rewrite one tensor-info record of a GGUF file in place (hostile files, hand-packed)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    start = data.index(key) + len(key)
    if new_name is not None:
        assert len(new_name) == len(name)
        data[start - len(name):start] = new_name.encode()
    (n_dims,) = struct.unpack_from("<I", data, start)
    if dims is not None:
        assert len(dims) == n_dims
        struct.pack_into(f"<{n_dims}Q", data, start + 4, *dims)
    if type_id is not None:
        struct.pack_into("<I", data, start + 4 + 8 * n_dims, type_id)
    if move_by:
        at = start + 4 + 8 * n_dims + 4
        struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + move_by)
    path.write_bytes(bytes(data))


def run_convert(runner, model, out_dir):
    return runner.invoke(cli, ["convert", "--model", str(model), "--out", str(out_dir / "t.bin"),
                               "--json", "--quiet"])



def test_convert_gguf_cli_converts_and_verifies(runner, tmp_path):
    model = make_gguf(tmp_path / "m", "iq4_nl", layout="split", num_files=2)
    out = tmp_path / "out"
    out.mkdir()
    result = run_convert(runner, model / "model-00002-of-00002.gguf", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["encoding"] == "gguf_iq4_nl"
    result = runner.invoke(cli, ["verify", str(out / "t.bin"), "--model", str(model), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows_compared"] == FIXTURE_ROWS
    result = runner.invoke(cli, ["inspect", str(out / "t.bin"), "--json"])
    assert json.loads(result.stdout)["ggml_type"] == {"name": "IQ4_NL", "id": 20}
    result = runner.invoke(cli, ["inspect", str(out / "t.bin")])
    assert "encoding:   gguf_iq4_nl (GGML type IQ4_NL), 160 values in 90 bytes a row" in result.stdout


@pytest.mark.parametrize("variant,layout", [("gguf-q5_1", "joined"), ("gguf-bf16", "split")])
def test_make_fixture_writes_gguf(runner, tmp_path, variant, layout):
    result = runner.invoke(cli, ["make-fixture", str(tmp_path / "m"), "--variant", variant,
                                 "--gguf-layout", layout, "--gguf-files", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
    out = tmp_path / "out"
    out.mkdir()
    assert run_convert(runner, tmp_path / "m", out).exit_code == 0


def _wrong_arch(tmp_path):
    return make_gguf(tmp_path, "q8_0", arch="gemma3n") / "model.gguf"


def _k_quant(tmp_path):
    path = make_gguf(tmp_path, "q8_0") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", type_id=12)  # Q4_K
    return path


def _unknown_type(tmp_path):
    path = make_gguf(tmp_path, "q8_0") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", type_id=99)
    return path


def _unsupported_type(tmp_path):
    path = make_gguf(tmp_path, "f16") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", type_id=25)  # I16: same size, not a table type
    return path


def _partial_block(tmp_path):
    path = make_gguf(tmp_path, "q8_0") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", dims=(150, FIXTURE_ROWS))
    return path


def _wrong_width(tmp_path):
    path = make_gguf(tmp_path, "f32") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", dims=(128, FIXTURE_ROWS))
    return path


def _truncated(tmp_path):
    path = make_gguf(tmp_path, "q4_1") / "model.gguf"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 5000)
    return path


def _truncated_header(tmp_path):
    path = make_gguf(tmp_path, "q4_1") / "model.gguf"
    with open(path, "r+b") as handle:
        handle.truncate(200)
    return path


def _not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    tmp_path.mkdir()
    path.write_bytes(b"not a gguf file at all" * 10)
    return path


def _missing_split(tmp_path):
    folder = make_gguf(tmp_path, "q5_0", layout="split", num_files=3)
    (folder / "model-00002-of-00003.gguf").unlink()
    return folder / "model-00001-of-00003.gguf"


def _missing_head(tmp_path):
    path = make_gguf(tmp_path, "q4_0", layout="split") / "model.gguf"
    patch_tensor_info(path, "ple_ngram_embd.5.weight", new_name="ple_ngram_embq.5.weight")
    return path


def _head_rows(tmp_path):
    path = make_gguf(tmp_path, "q4_0", layout="split") / "model.gguf"
    patch_tensor_info(path, "ple_ngram_embd.15.weight", dims=(160, 1096))
    return path


def _misaligned(tmp_path):
    path = make_gguf(tmp_path, "q4_0", layout="split") / "model.gguf"
    patch_tensor_info(path, "ple_ngram_embd.3.weight", move_by=4)
    return path


def _overlapping(tmp_path):
    path = make_gguf(tmp_path, "q4_0", layout="split") / "model.gguf"
    patch_tensor_info(path, "ple_ngram_embd.3.weight", move_by=64)
    return path


def _two_models(tmp_path):
    folder = make_gguf(tmp_path, "q8_0")
    shutil.copy(make_gguf(tmp_path.with_name("other"), "q4_0") / "model.gguf", folder / "q4.gguf")
    return folder


def _no_table(tmp_path):
    path = make_gguf(tmp_path, "q8_0") / "model.gguf"
    patch_tensor_info(path, "per_layer_token_embd.weight", new_name="per_layer_token_embq.weight")
    return path


def _no_vocab_size(tmp_path):
    # The fixture has no tokenizer.ggml.tokens either: nothing gives the vocabulary size.
    path = make_gguf(tmp_path, "q8_0") / "model.gguf"
    path.write_bytes(path.read_bytes().replace(b"qwen4exp.vocab_size", b"qwen4exp.vocab_sizz"))
    return path


BAD_GGUF = {
    "wrong architecture": (_wrong_arch, ["not a Qwen3.8-Flash-Next model", "general.architecture is 'gemma3n'",
                                         "qwen4exp"]),
    "k-quant": (_k_quant, ["Q4_K", "K-quant"]),
    "unknown type": (_unknown_type, ["unknown GGML type"]),
    "unsupported type": (_unsupported_type, ["I16", "unsupported"]),
    "partial block": (_partial_block, ["not a whole number of blocks"]),
    "wrong width": (_wrong_width, [f"[128, {FIXTURE_ROWS}]", "expected [160, rows]"]),
    "truncated": (_truncated, ["truncated"]),
    "truncated header": (_truncated_header, ["truncated"]),
    "not gguf": (_not_gguf, ["not a readable GGUF file"]),
    "missing split": (_missing_split, ["model-00002-of-00003.gguf", "missing"]),
    "missing head": (_missing_head, ["head tensors 5 missing"]),
    "head rows": (_head_rows, ["ple_ngram_embd.15.weight has 1096 rows", "1097"]),
    "misaligned": (_misaligned, ["ple_ngram_embd.3.weight starts at byte", "not an aligned offset"]),
    "overlapping": (_overlapping, ["overlaps ple_ngram_embd.3.weight"]),
    "two models": (_two_models, ["2 GGUF models"]),
    "no table": (_no_table, ["no n-gram PLE table"]),
    "no vocabulary size": (_no_vocab_size, ["lacks qwen4exp.vocab_size", "tokenizer.ggml.tokens"]),
}


@pytest.mark.parametrize("case", BAD_GGUF)
def test_convert_gguf_bad_input_exits_2(runner, tmp_path, case):
    build, fragments = BAD_GGUF[case]
    model = build(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    assert_refused(run_convert(runner, model, out), out, *fragments)
