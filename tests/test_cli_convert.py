"""`ple-prep convert` through the CLI: success, and every bad input refused cleanly.

A refusal is one line `error: ...` on stderr, exit code 2, no traceback, and no file left in the
output folder (neither the output nor a temporary).
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from support.handmade import INDEX, Tensor, find, load_tensors, pack_safetensors, save_tensors
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint


def convert_args(model, out, *extra):
    return ["convert", "--model", str(model), "--out", str(out), "--quiet", *extra]



# --- Breakers: each turns a good fixture checkpoint into one bad input ----------------------------

def edit_tensors(edit):
    def breaker(folder):
        files = load_tensors(folder)
        edit(files)
        save_tensors(folder, files)
    return breaker


def drop_shard(files):
    name, tensor = find(files, ".shard_5.weight")
    del files[name][tensor]


def duplicate_shard(files):
    name, tensor = find(files, ".shard_3.weight")
    other = next(f for f in files if f != name)
    files[other]["reexport.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"] = files[name][tensor]


def narrow_shard(files):
    name, tensor = find(files, ".shard_2.weight")
    rows = files[name][tensor].shape[0]
    files[name][tensor] = Tensor("F8_E4M3", (rows, 159), files[name][tensor].data[:rows * 159])


def relabel_shards(dtype, width):
    def edit(files):
        for tensors in files.values():
            for key, tensor in tensors.items():
                if ".ngram_embedding.shard_" in key:
                    tensors[key] = Tensor(dtype, (tensor.shape[0], width), tensor.data)
    return edit


def set_scale(dtype, shape, data):
    def edit(files):
        name, tensor = find(files, ".ngram_embedding.weight_scale")
        files[name][tensor] = Tensor(dtype, shape, data)
    return edit


def drop_scale(files):
    name, tensor = find(files, ".ngram_embedding.weight_scale")
    del files[name][tensor]


def drop_table(files):
    for tensors in files.values():
        for key in [k for k in tensors if ".ngram_embedding." in k]:
            del tensors[key]


def change_constant(suffix, position):
    def edit(files):
        name, tensor = find(files, suffix)
        values = np.frombuffer(files[name][tensor].data, dtype="<i8").copy()
        values[position] += 2
        files[name][tensor].data = values.tobytes()
    return edit


def add_file(content: bytes, keep_index: bool = False):
    def breaker(folder):
        if not keep_index:
            (folder / INDEX).unlink()
        (folder / "model-hostile.safetensors").write_bytes(content)
    return breaker


def truncate_shard_file(folder):
    files = load_tensors(folder)
    name, _ = find(files, ".shard_0.weight")
    path = folder / name
    path.write_bytes(path.read_bytes()[:-100])


def delete_named_file(folder):
    name = sorted(folder.glob("*.safetensors"))[1]
    name.unlink()


def remove_all_files(folder):
    for path in [*folder.glob("*.safetensors"), folder / INDEX]:
        path.unlink()


def break_index(folder):
    (folder / INDEX).write_text("{\"weight_map\": ")


def remove_config(folder):
    (folder / "config.json").unlink()


def set_config(key, value):
    def breaker(folder):
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return breaker


SHARD_F8 = {"dtype": "F8_E4M3", "shape": [2, 160]}
BAD_INPUTS = [
    ("missing_shard", edit_tensors(drop_shard), "shard 5 of the table missing"),
    ("two_tensors_one_shard", edit_tensors(duplicate_shard), "two tensors for shard 3"),
    ("wrong_row_width", edit_tensors(narrow_shard), "wrong row width"),
    ("unsupported_dtype", edit_tensors(relabel_shards("F16", 80)), "table dtype F16 is unsupported"),
    ("unsupported_dtype_f32", edit_tensors(relabel_shards("F32", 40)), "table dtype F32 is unsupported"),
    ("scale_not_scalar", edit_tensors(set_scale("BF16", (2,), b"\x53\x39\x53\x39")), "only a scalar"),
    ("scale_matrix", edit_tensors(set_scale("F32", (1, 160), b"\0\0\x80\x3f" * 160)), "only a scalar"),
    ("scale_zero", edit_tensors(set_scale("BF16", (1,), b"\0\0")), "finite and non-zero"),
    ("scale_nan", edit_tensors(set_scale("BF16", (1,), struct.pack("<H", 0x7FC0))), "is nan"),
    ("scale_inf", edit_tensors(set_scale("F32", (1,), struct.pack("<f", float("inf")))), "is inf"),
    ("scale_negative_inf", edit_tensors(set_scale("F16", (1,), struct.pack("<H", 0xFC00))), "is -inf"),
    ("scale_int_dtype", edit_tensors(set_scale("I32", (1,), b"\1\0\0\0")), "dtype I32"),
    ("scale_missing", edit_tensors(drop_scale), "without its scale"),
    ("data_offsets_past_end", add_file(pack_safetensors(
        {"x.ple.ple_embedding.ngram_embedding.shard_0.weight": SHARD_F8 | {"data_offsets": [0, 320]}},
        bytes(160))), "past the 160 data bytes"),
    ("data_offsets_disagree_with_shape", add_file(pack_safetensors(
        {"t": SHARD_F8 | {"data_offsets": [0, 300]}}, bytes(300))), "do not hold"),
    ("truncated_shard_file", truncate_shard_file, "past the"),
    ("header_length_past_end", add_file(pack_safetensors(b"{}", header_len=1000)), "runs past the end"),
    ("header_length_above_limit", add_file(pack_safetensors(b"{}", header_len=100_000_001)),
     "above the 100 MB limit"),
    ("header_length_huge", add_file(pack_safetensors(b"{}", header_len=2**64 - 1)), "100 MB limit"),
    ("file_too_short", add_file(b"\1\2\3"), "too short for a safetensors file"),
    ("header_not_json", add_file(pack_safetensors(b"{not json}")), "header is not JSON"),
    ("header_not_utf8", add_file(pack_safetensors(b"\xff\xfe\xfd")), "header is not JSON"),
    ("header_not_object", add_file(pack_safetensors(b"[1, 2]")), "not a JSON object"),
    ("index_names_missing_file", delete_named_file, "not found in"),
    ("index_not_json", break_index, "model.safetensors.index.json is not JSON"),
    ("no_table", edit_tensors(drop_table), "no n-gram PLE table"),
    ("no_safetensors_files", remove_all_files, "no *.safetensors files"),
    ("multipliers_disagree", edit_tensors(change_constant(".layer_multipliers", 1)),
     "multipliers [23703573157769, 20109073645367"),
    ("head_offsets_disagree", edit_tensors(change_constant(".ngram_heads_offsets", 15)),
     "head offsets"),
    ("head_sizes_disagree", edit_tensors(change_constant(".ngram_heads_vocab_sizes", 0)),
     "disagree with config.json"),
    ("no_config", remove_config, "config.json not found"),
    ("config_base_float", set_config("ngram_vocab_size_base", 1000.5),
     "config.json: ngram_vocab_size_base: expected an integer"),
    ("config_vocab_string", set_config("vocab_size", "248320"), "config.json: vocab_size: expected an integer"),
    ("config_heads_bool", set_config("heads_per_ngram", True), "config.json: heads_per_ngram: expected an integer"),
]


@pytest.mark.parametrize("breaker, message", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_convert_bad_input_refused(breaker, message, runner, tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", "fp8", num_files=3)
    breaker(folder)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = runner.invoke(cli, convert_args(folder, out_dir / "t.bin"))
    assert_refused(result, out_dir, message)


def test_convert_bad_input_nvfp4_without_block_scales(runner, tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", "nvfp4")
    files = load_tensors(folder)
    name, tensor = find(files, ".shard_7.weight_scale")
    del files[name][tensor]
    save_tensors(folder, files)
    (tmp_path / "out").mkdir()
    result = runner.invoke(cli, convert_args(folder, tmp_path / "out" / "t.bin"))
    assert_refused(result, tmp_path / "out", "each shard needs its .weight_scale")


def test_convert_bad_input_model_missing(runner, tmp_path):
    result = runner.invoke(cli, convert_args(tmp_path / "nowhere", tmp_path / "t.bin"))
    assert_refused(result, tmp_path, "does not exist")


def test_convert_bad_input_page_size(fp8_checkpoint, runner, tmp_path):
    result = runner.invoke(cli, convert_args(fp8_checkpoint, tmp_path / "t.bin", "--page-size", "1000"))
    assert_refused(result, tmp_path, "power of two")


def test_convert_bad_input_output_folder_missing(fp8_checkpoint, runner, tmp_path):
    result = runner.invoke(cli, convert_args(fp8_checkpoint, tmp_path / "no" / "t.bin"))
    assert_refused(result, tmp_path, "output folder")


def test_convert_existing_output_without_force(fp8_checkpoint, runner, tmp_path):
    out = tmp_path / "t.bin"
    assert runner.invoke(cli, convert_args(fp8_checkpoint, out)).exit_code == 0
    before = (out.read_bytes(), (tmp_path / "t.bin.json").read_bytes())
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out))
    assert_refused(result, tmp_path, "exists; pass --force", left=["t.bin", "t.bin.json"])
    assert (out.read_bytes(), (tmp_path / "t.bin.json").read_bytes()) == before
    # A manifest alone also blocks, so an old pair is never half replaced.
    out.unlink()
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out))
    assert_refused(result, tmp_path, "t.bin.json exists", left=["t.bin.json"])


def test_convert_resume_of_a_finished_table_says_there_is_nothing_to_resume(fp8_checkpoint, runner, tmp_path):
    out = tmp_path / "t.bin"
    assert runner.invoke(cli, convert_args(fp8_checkpoint, out)).exit_code == 0
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out, "--resume"))
    assert_refused(result, tmp_path, "t.bin is already complete: nothing to resume", left=["t.bin", "t.bin.json"])


def test_convert_force_replaces(fp8_checkpoint, runner, tmp_path):
    out = tmp_path / "t.bin"
    assert runner.invoke(cli, convert_args(fp8_checkpoint, out)).exit_code == 0
    first = json.loads((tmp_path / "t.bin.json").read_text())["file_id"]
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out, "--force", "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == FIXTURE_ROWS and summary["encoding"] == "fp8_e4m3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]
    with open_table(out) as table:
        assert table.manifest["file_id"] != first


def test_convert_prints_summary(bf16_checkpoint, runner, tmp_path):
    out = tmp_path / "t.bin"
    result = runner.invoke(cli, ["convert", "--model", str(bf16_checkpoint), "--out", str(out)])
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.startswith(f"wrote {tmp_path / 't.bin'}: {FIXTURE_ROWS:,} bf16 rows, ")


def test_convert_bad_input_real_process(tmp_path):
    # The installed entry point, not the test runner: the message and exit code a user sees.
    folder = make_checkpoint(tmp_path / "ckpt", "fp8")
    add_file(pack_safetensors(b"{}", header_len=1000))(folder)
    (tmp_path / "out").mkdir()
    result = subprocess.run([sys.executable, "-m", "ple_prep", *convert_args(folder, tmp_path / "out" / "t.bin")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    # The length read from the file is not echoed: bytes that failed validation are never printed.
    assert result.stderr == ("error: model-hostile.safetensors: the header length field runs past the end "
                             "of the 10-byte file (truncated, or not a safetensors file)\n")
    assert list((tmp_path / "out").iterdir()) == []


def test_convert_another_models_checkpoint_says_so(fp8_checkpoint, runner, tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    for path in fp8_checkpoint.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128256,
                                                   "hidden_size": 4096, "eos_token_id": 128001}))
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(cli, convert_args(model, out / "t.bin"))
    assert_refused(result, out, f"{model} is not a Qwen3.8-Flash-Next checkpoint: its config.json "
                                f"(model_type 'llama') has no n-gram PLE fields")
