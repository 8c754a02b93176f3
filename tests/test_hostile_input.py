"""Hostile and unlucky input, each case built here: one `error:` line and exit 2 (or a refused open, a
failed check, a failed gather naming the change), nothing left behind or written outside the output
folder, no traceback, and memory bounded (docs/RELIABILITY.md, "Hostile input")."""
from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.environment import child_environment
from support.hubcache import add_checkpoint

from ple_prep.cli import EXIT_BUG, cli
from ple_prep.core.errors import BadInput
from ple_prep.core.fileio import output_lock
from ple_prep.format.manifest import manifest_path
from ple_prep.offline import chat, prompts
from ple_prep.offline.profile import MAGIC as PROFILE_MAGIC
from ple_prep.offline.verify import verify
from ple_prep.runtime import open_table
from ple_prep.runtime.watch import FileWatch
from ple_prep.tools.fixtures import FIXTURE_ROWS

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def refused(result, message: str, folder: Path | None = None, left: tuple[str, ...] = ()) -> None:
    """One `error: ...` line holding `message`, exit 2, and only `left` in `folder`."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]
    if folder is not None:
        assert sorted(p.name for p in folder.iterdir()) == sorted(left)


def run_cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a process of its own: (result, its peak resident memory in bytes)."""
    measure = ("import resource, subprocess, sys\n"
               "done = subprocess.run([sys.executable, '-m', 'ple_prep', *sys.argv[1:]])\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(done.returncode)\n")
    result = subprocess.run([sys.executable, "-c", measure, *args], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO, env=child_environment())
    *lines, peak = result.stderr.splitlines()
    result.stderr = "".join(line + "\n" for line in lines)
    return result, int(peak) * 1024


def refused_in_process(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


@pytest.fixture
def checkpoint(fp8_checkpoint, tmp_path) -> Path:
    """A copy of the FP8 fixture to damage."""
    return Path(shutil.copytree(fp8_checkpoint, tmp_path / "ckpt"))


@pytest.fixture
def out_dir(tmp_path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def convert_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", "--model", str(model), "--out", str(out), "--quiet", *extra]


# --- Files written through symlinks ------------------------------------------------------------------

def test_a_symlink_planted_at_the_manifest_name_is_replaced_never_written_through(
        fp8_checkpoint, out_dir, tmp_path, runner):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (out_dir / "t.bin.json").symlink_to(victim)
    (out_dir / "t.bin").symlink_to(victim)
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out_dir / "t.bin", "--force"))
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == b"precious"
    assert not (out_dir / "t.bin.json").is_symlink() and not (out_dir / "t.bin").is_symlink()
    assert sorted(p.name for p in out_dir.iterdir()) == ["t.bin", "t.bin.json"]


def test_published_files_get_the_documented_mode(fp8_table):
    for path in (fp8_table, manifest_path(fp8_table)):
        assert path.stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- Files read from outside the model ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["/etc/shadow", "../../x.safetensors", "a/../../x.safetensors"])
def test_index_names_outside_the_checkpoint_are_refused_before_opening(checkpoint, out_dir, runner, name):
    index = checkpoint / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = name
    index.write_text(json.dumps(data))
    result = runner.invoke(cli, convert_args(checkpoint, out_dir / "t.bin"))
    refused(result, "names shard files outside the checkpoint folder", out_dir)


def test_a_shard_linked_to_a_device_is_refused_and_no_bytes_are_echoed(checkpoint, out_dir, runner):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    result = runner.invoke(cli, convert_args(checkpoint, out_dir / "t.bin"))
    refused(result, "is a character device, not a regular file", out_dir)


def test_a_file_that_is_not_safetensors_has_its_bytes_kept_out_of_the_message(checkpoint, out_dir, runner):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.write_bytes(b"root:$6$secretsecret:19000:0:99999:7:::\n" * 4)
    result = runner.invoke(cli, convert_args(checkpoint, out_dir / "t.bin"))
    refused(result, "the header length field", out_dir)
    assert "secret" not in result.output and str(int.from_bytes(b"root:$6$", "little")) not in result.output


def test_a_cache_ref_pointing_outside_the_cache_is_refused(fp8_checkpoint, tmp_path, out_dir, runner,
                                                           monkeypatch):
    cache = tmp_path / "hub"
    add_checkpoint(cache, "Qwen/Qwen3.8-Flash-Next-FP8", fp8_checkpoint, "a" * 40)
    (tmp_path / "elsewhere").mkdir()
    ref = cache / "models--Qwen--Qwen3.8-Flash-Next-FP8" / "refs" / "main"
    ref.write_text("../../../elsewhere")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    result = runner.invoke(cli, convert_args("Qwen/Qwen3.8-Flash-Next-FP8", out_dir / "t.bin"))
    refused(result, "refs/main", out_dir)
    assert "does not hold a commit hash" in result.stderr


# --- Inputs that crash, hang or exhaust memory -------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "tokenizer_config.json"])
def test_json_nested_100k_deep_is_refused_before_parsing(checkpoint, out_dir, tmp_path, runner, name):
    (checkpoint / name).write_text(DEEP)
    prompt = tmp_path / "chat.jsonl"
    prompt.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = (["profile", "--model", str(checkpoint), "--prompts", str(prompt), "--out",
             str(out_dir / "p.prof"), "--quiet"] if name == "tokenizer_config.json"
            else convert_args(checkpoint, out_dir / "t.bin"))
    refused(runner.invoke(cli, args), "nests deeper than 64 levels", out_dir)


def test_a_1_gib_config_is_refused_without_reading_it(checkpoint, out_dir):
    config = checkpoint / "config.json"
    with open(config, "r+b") as handle:
        handle.truncate(GIB)  # sparse: no disk used
    result, peak = run_cli(*convert_args(checkpoint, out_dir / "t.bin"))
    refused_in_process(result, "over the 16 MiB limit")
    assert peak < 300 << 20 and list(out_dir.iterdir()) == []


def test_a_config_linked_to_an_endless_device_is_refused(checkpoint, out_dir, runner):
    (checkpoint / "config.json").unlink()
    (checkpoint / "config.json").symlink_to("/dev/zero")
    refused(runner.invoke(cli, convert_args(checkpoint, out_dir / "t.bin")),
            "is a character device, not a regular file", out_dir)


def test_a_fifo_in_place_of_a_shard_or_the_table_is_refused_at_once(checkpoint, fp8_table, out_dir, tmp_path):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    result, _ = run_cli(*convert_args(checkpoint, out_dir / "t.bin"), timeout=30)
    refused_in_process(result, "is a FIFO, not a regular file")
    assert list(out_dir.iterdir()) == []
    table = tmp_path / "fifo.bin"
    shutil.copy(manifest_path(fp8_table), manifest_path(table))
    os.mkfifo(table)
    with pytest.raises(BadInput, match="is a FIFO"):
        open_table(table)
    result, _ = run_cli("verify", str(table), timeout=30)
    refused_in_process(result, "is a FIFO, not a regular file")



def test_a_fifo_or_a_folder_given_as_prompts_is_named_as_such(fp8_checkpoint, tmp_path):
    fifo, folder = tmp_path / "fifo.txt", tmp_path / "folder.txt"
    os.mkfifo(fifo)
    folder.mkdir()
    for path, kind in ((fifo, "a FIFO"), (folder, "a folder")):
        result, _ = run_cli("profile", "--model", str(fp8_checkpoint), "--prompts", str(path),
                            "--out", str(tmp_path / "p.prof"), "--quiet", timeout=30)
        refused_in_process(result, f"prompt file {path} is {kind}, not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.txt", "folder.txt"]

def _npy_record_with_header(header: bytes) -> bytes:
    """A .npy v1.0 record's magic, length and `header` text, padded as numpy pads it."""
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def _npy_header(shape: tuple[int, ...]) -> bytes:
    return _npy_record_with_header(repr({"descr": "<u8", "fortran_order": False, "shape": shape}).encode())


def _profile_bytes(arrays: list[tuple[str, int]], data: bytes = b"") -> bytes:
    """A profile stream whose arrays declare `count` uint64 items each (their data not included)."""
    header = json.dumps({"format": "ple-prep-profile", "version": 1, "arrays": [n for n, _ in arrays]}).encode()
    body = PROFILE_MAGIC + struct.pack("<Q", len(header)) + header
    return body + b"".join(_npy_header((count,)) for _, count in arrays[:1]) + data


@pytest.fixture(scope="module")
def profile_bomb(tmp_path_factory) -> Path:
    """About 100 KB that expands to a 3 GiB array, compressed here a chunk at a time."""
    import zstandard

    path = tmp_path_factory.mktemp("bomb") / "bomb.prof"
    count = 3 * GIB // 8
    with open(path, "wb") as handle, zstandard.ZstdCompressor(level=3).stream_writer(handle) as stream:
        stream.write(_profile_bytes([("train.groups.2", count)]))
        zeros = bytes(64 << 20)
        for _ in range(3 * GIB // len(zeros)):
            stream.write(zeros)
    assert path.stat().st_size < 200_000
    return path


def test_a_profile_bomb_is_refused_by_convert_and_merge(profile_bomb, fp8_checkpoint, out_dir):
    result, peak = run_cli(*convert_args(fp8_checkpoint, out_dir / "t.bin", "--profile", str(profile_bomb)))
    refused_in_process(result, "more than the rest of what a")
    assert peak < 300 << 20
    result, peak = run_cli("profile", "merge", str(profile_bomb), str(profile_bomb), "-o",
                           str(out_dir / "m.prof"), "--quiet")
    refused_in_process(result, "may expand to")
    assert peak < 300 << 20 and list(out_dir.iterdir()) == []


def test_a_profile_declaring_8_tib_is_refused_before_allocating(tmp_path, out_dir, runner):
    import zstandard

    path = tmp_path / "huge.prof"
    path.write_bytes(zstandard.ZstdCompressor().compress(_profile_bytes([("train.groups.2", 1 << 40)])))
    result = runner.invoke(cli, ["profile", "merge", str(path), "-o", str(out_dir / "m.prof")])
    refused(result, "declares 8,796,093,022,208 bytes", out_dir)


@pytest.fixture(scope="module")
def small_profile(fp8_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("small-profile")
    np.save(folder / "ids.npy", np.random.default_rng(0).integers(0, 2000, size=5000))
    from click.testing import CliRunner

    assert CliRunner().invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(folder / "ids.npy"),
                                    "--out", str(folder / "p.prof"), "--quiet"]).exit_code == 0
    return folder / "p.prof"


def _with_header(profile: Path, out: Path, field: str, value) -> Path:
    """A copy of `profile` with one header field (a dotted path) set to `value`, the arrays kept."""
    import zstandard

    with open(profile, "rb") as handle:
        data = zstandard.ZstdDecompressor().stream_reader(handle).read()
    (length,) = struct.unpack_from("<Q", data, len(PROFILE_MAGIC))
    start = len(PROFILE_MAGIC) + 8
    header = json.loads(data[start:start + length])
    *parents, last = field.split(".")
    target = header
    for key in parents:
        target = target[key]
    target[last] = value
    encoded = json.dumps(header).encode()
    out.write_bytes(zstandard.ZstdCompressor().compress(
        PROFILE_MAGIC + struct.pack("<Q", len(encoded)) + encoded + data[start + length:]))
    return out


@pytest.mark.parametrize("field, value, named", [
    ("inputs", [1, 2], "inputs"), ("inputs", [{}], "inputs"), ("inputs", "abc", "inputs"),
    ("spec", "x", "spec"), ("spec.multipliers", ["1"], "spec"), ("model", 3, "model"),
    ("parts.train.tokens", -1, "parts.train"), ("parts.heldout.requests", 1.5, "parts.heldout"),
    ("heldout_every", 0, "heldout_every"), ("tokenizer_sha256", [], "tokenizer_sha256"),
])
def test_a_profile_header_field_of_the_wrong_type_is_named(small_profile, fp8_checkpoint, tmp_path, out_dir,
                                                           runner, field, value, named):
    profile = _with_header(small_profile, tmp_path / "bad.prof", field, value)
    message = f"{profile}: corrupt profile (header field {named} must be"
    refused(runner.invoke(cli, convert_args(fp8_checkpoint, out_dir / "t.bin", "--profile", str(profile))),
            message, out_dir)
    refused(runner.invoke(cli, ["profile", "merge", str(profile), str(small_profile), "-o",
                                str(out_dir / "m.prof"), "--quiet"]), message, out_dir)


# A .npy header cut inside its shape: numpy's parser raises tokenize.TokenError on it, not ValueError.
UNCLOSED_NPY_HEADER = b"{'descr': '<u8', 'fortran_order': False, 'shape': (3, "


def test_a_profile_whose_array_header_numpy_cannot_tokenize_is_one_error_line(small_profile, fp8_checkpoint,
                                                                             tmp_path, out_dir, runner):
    import zstandard

    with open(small_profile, "rb") as handle:
        data = zstandard.ZstdDecompressor().stream_reader(handle).read()
    first = data.index(b"\x93NUMPY")
    header_end = first + 10 + int.from_bytes(data[first + 8:first + 10], "little")
    profile = tmp_path / "bad.prof"
    profile.write_bytes(zstandard.ZstdCompressor().compress(
        data[:first] + _npy_record_with_header(UNCLOSED_NPY_HEADER) + data[header_end:]))
    message = f"{profile}: corrupt profile (array "
    refused(runner.invoke(cli, convert_args(fp8_checkpoint, out_dir / "t.bin", "--profile", str(profile))),
            message, out_dir)
    refused(runner.invoke(cli, ["profile", "merge", str(profile), str(small_profile), "-o",
                                str(out_dir / "m.prof"), "--quiet"]), message, out_dir)


@pytest.mark.parametrize("header", [UNCLOSED_NPY_HEADER, b"{'descr': '<i9', 'fortran_order': False, 'shape': (3,), }"],
                         ids=["unclosed", "unknown dtype"])
def test_a_prompt_npy_whose_header_numpy_cannot_parse_is_one_error_line(fp8_checkpoint, tmp_path, out_dir,
                                                                       runner, header):
    prompts = tmp_path / "ids.npy"
    prompts.write_bytes(_npy_record_with_header(header) + bytes(24))
    result = runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts),
                                 "--out", str(out_dir / "p.prof"), "--quiet"])
    refused(result, f"{prompts} is not a numpy .npy array of token ids", out_dir)


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{{ 'ab' * 10**9 }}", "needs more than 512 MiB"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "ran longer than 1 s"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deep"),
    ("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", "output passed"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ raise_exception('bad conversation') }}", "bad conversation"),
    ("{% if %}", "does not parse"),
])
def test_hostile_chat_templates_are_one_error_line(checkpoint, tmp_path, out_dir, runner, monkeypatch,
                                                   template, message):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    prompt = tmp_path / "chat.jsonl"
    prompt.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    started = time.monotonic()
    result = runner.invoke(cli, ["profile", "--model", str(checkpoint), "--prompts", str(prompt),
                                 "--out", str(out_dir / "p.prof"), "--quiet"])
    refused(result, message, out_dir)
    assert time.monotonic() - started < 5


def test_a_long_single_line_prompt_is_tokenized_in_pieces_as_one_text(fp8_checkpoint, tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    words = np.random.default_rng(1).choice(["alpha", "beta", "gamma", "delta", "(x)", "12", "é"], 40_000)
    text = " ".join(words) + "\n"
    (tmp_path / "long.txt").write_text(text)
    whole = Tokenizer.from_file(str(fp8_checkpoint / "tokenizer.json")).encode(text).ids
    monkeypatch.setattr(prompts, "PIECE_CHARS", 4096)
    reader = prompts.PromptReader(fp8_checkpoint, None)
    pieces = list(reader._txt_pieces(tmp_path / "long.txt"))
    assert len(pieces) > 40 and "".join(pieces) == text
    assert reader._encode_pieces(iter(pieces), True).tolist() == whole


def test_a_100_mb_single_line_prompt_stays_under_1_gib(fp8_checkpoint, tmp_path, out_dir):
    # 4 MB here for CI time (16 pieces); the 100 MB figure is in docs/RELIABILITY.md.
    line = ("the quick brown fox jumps over the lazy dog " * 1000).encode()
    with open(tmp_path / "big.txt", "wb") as handle:
        for _ in range(4_000_000 // len(line)):
            handle.write(line)
    result, peak = run_cli("profile", "--model", str(fp8_checkpoint), "--prompts", str(tmp_path / "big.txt"),
                           "--out", str(out_dir / "p.prof"), "--quiet", timeout=120)
    assert result.returncode == 0, result.stderr
    assert peak < GIB, peak


def test_a_huge_tp_size_is_refused(fp8_checkpoint, out_dir, runner):
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out_dir / "t.bin", "--tp-size", str(2**62)))
    refused(result, "do not split evenly over 4611686018427387904 ranks", out_dir)


def test_an_unexpected_exception_is_one_line_with_its_own_exit_code(fp8_checkpoint, out_dir, runner,
                                                                     monkeypatch):
    from ple_prep.offline import writer

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(writer, "check_free_space", broken)
    result = runner.invoke(cli, convert_args(fp8_checkpoint, out_dir / "t.bin"))
    assert result.exit_code == EXIT_BUG == 70
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("error: internal error, a bug in ple-prep") and "ZeroDivisionError" in lines[0]
    assert "--debug" in lines[0] and "issue tracker" in lines[0]
    result = runner.invoke(cli, ["--debug", *convert_args(fp8_checkpoint, out_dir / "t.bin")])
    assert result.exit_code == 70 and "Traceback" in result.stderr and "def broken" not in result.stdout
    assert list(out_dir.iterdir()) == []


# --- A manifest edited or flipped --------------------------------------------------------------------

def _scale_times_1000(m):
    m["scale"]["value"] *= 1000


def _scale_negated(m):
    m["scale"]["value"] = -m["scale"]["value"]


def _scale_bit_flipped(m):
    m["scale"]["hex"] = f"{int(m['scale']['hex'], 16) ^ 0x0100:04x}"
    raw = bytes.fromhex(m["scale"]["hex"])
    m["scale"]["value"] = struct.unpack("<f", struct.pack("<I", int.from_bytes(raw, "little") << 16))[0]


def _multiplier_changed(m):
    m["ngram"]["multipliers"][1] += 2


@pytest.mark.parametrize("edit, message", [
    (_scale_times_1000, "disagrees with its bytes"), (_scale_negated, "disagrees with its bytes"),
    (_scale_bit_flipped, "was changed after conversion"), (_multiplier_changed, "was changed after conversion"),
])
def test_an_edited_manifest_is_refused_at_open_and_fails_verify(fp8_table, fp8_checkpoint, tmp_path, runner,
                                                                edit, message):
    table = tmp_path / "t.bin"
    shutil.copy(fp8_table, table)
    manifest = json.loads(manifest_path(fp8_table).read_text())
    edit(manifest)
    manifest_path(table).write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match=message):
        open_table(table)
    for extra in ([], ["--model", str(fp8_checkpoint)]):
        result = runner.invoke(cli, ["verify", str(table), *extra])
        assert result.exit_code in (1, 2) and message in result.output and "Traceback" not in result.output
    if message == "was changed after conversion":
        report = verify(table, fp8_checkpoint)
        assert not report.ok and any(message in problem for problem in report.file_problems)


# --- A table changed under a reader ------------------------------------------------------------------

@pytest.fixture
def watched(fp8_table, tmp_path, monkeypatch):
    monkeypatch.setattr(FileWatch, "CHECK_SECONDS", 0.0)
    table = tmp_path / "t.bin"
    shutil.copy(fp8_table, table)
    shutil.copy(manifest_path(fp8_table), manifest_path(table))
    with open_table(table, read_path="mapped") as opened:
        opened.gather(np.arange(10))
        yield table, opened


def test_a_table_copied_over_in_place_fails_the_next_gather(watched, fp8_checkpoint, tmp_path):
    from ple_prep.converters import open_source
    from ple_prep.offline.writer import convert

    path, table = watched
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "other.bin")
    with open(tmp_path / "other.bin", "rb") as other, open(path, "r+b") as target:
        target.write(other.read())  # same size, same inode: cp's way
    with pytest.raises(BadInput, match="changed under this reader .*file id changed"):
        table.gather(np.arange(10))


def test_a_table_renamed_over_keeps_serving_its_own_rows(watched, fp8_table, tmp_path):
    path, table = watched
    expected = table.gather(np.arange(FIXTURE_ROWS))
    shutil.copy(fp8_table, tmp_path / "copy.bin")
    os.replace(tmp_path / "copy.bin", path)  # what convert --force and `cp + mv` do
    assert np.array_equal(table.gather(np.arange(FIXTURE_ROWS)), expected)
    assert np.array_equal(table.lookup(np.arange(10)).disk_rows, expected[:10])


def test_a_table_renamed_over_never_lends_its_rows_to_a_later_resident_tier(watched, tmp_path):
    path, table = watched
    expected = table.gather(np.arange(FIXTURE_ROWS))
    other = bytearray(path.read_bytes())
    data = table.header.data_offset
    other[data:] = bytes(255 - byte for byte in other[data:])  # every row's bytes differ
    (tmp_path / "other.bin").write_bytes(other)
    os.replace(tmp_path / "other.bin", path)
    resident = table.resident(64 * table.page_size)
    assert np.array_equal(resident.rows, expected[:resident.num_slots])
    out = np.full((FIXTURE_ROWS, table.row_bytes), 0xA5, dtype=np.uint8)
    table.lookup(np.arange(FIXTURE_ROWS), out=out)
    assert np.array_equal(out, expected)


def test_a_table_rewritten_in_place_with_its_own_bytes_is_still_seen(watched):
    path, table = watched
    data = path.read_bytes()
    time.sleep(0.01)
    path.write_bytes(data)
    with pytest.raises(BadInput, match="rewritten in place"):
        table.values(np.arange(4))


def test_a_truncated_table_fails_the_gather_instead_of_sigbus(watched):
    path, table = watched
    os.truncate(path, 8192)
    with pytest.raises(BadInput, match="its size went from"):
        table.gather(np.arange(16_000, 16_010))


def test_the_check_runs_at_most_once_a_second(fp8_table, monkeypatch):
    calls = []
    with open_table(fp8_table, read_path="mapped") as table:
        monkeypatch.setattr(table._watch, "changed", lambda: calls.append(1))
        table._watch.next_check = time.monotonic() + 1.0
        for _ in range(1000):
            table.gather(np.arange(4))
        assert calls == []
        table._watch.next_check = 0
        table.gather(np.arange(4))
        table.gather(np.arange(4))
        assert calls == [1]


# --- Outputs that clobber inputs ---------------------------------------------------------------------

def test_out_equal_to_a_source_shard_is_refused_even_with_force(checkpoint, runner):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    result = runner.invoke(cli, convert_args(checkpoint, shard, "--force"))
    refused(result, "an input of this conversion")
    assert shard.read_bytes() == before


def test_out_whose_manifest_is_the_checkpoint_config_is_refused_even_with_force(checkpoint, runner):
    before = (checkpoint / "config.json").read_bytes()
    files = sorted(p.name for p in checkpoint.iterdir())
    result = runner.invoke(cli, convert_args(checkpoint, checkpoint / "config", "--force"))
    refused(result, "an input of this conversion")
    assert (checkpoint / "config.json").read_bytes() == before
    assert sorted(p.name for p in checkpoint.iterdir()) == files


def test_a_second_convert_of_one_output_fails_while_the_first_runs(fp8_checkpoint, out_dir, runner):
    out = out_dir / "t.bin"
    with output_lock(out):
        result = runner.invoke(cli, convert_args(fp8_checkpoint, out))
        refused(result, f"another ple-prep process (pid {os.getpid()}) is writing", out_dir, (".t.bin.lock",))
    assert list(out_dir.iterdir()) == []


def test_two_converts_at_once_one_wins_and_the_other_says_so(fp8_checkpoint, out_dir):
    command = [sys.executable, "-m", "ple_prep", *convert_args(fp8_checkpoint, out_dir / "t.bin")]
    env = child_environment()
    processes = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
                 for _ in range(2)]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in processes]
    # The second waits for nothing: it finds the lock (or, started late, the finished table) and says so.
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(stderr for code, stderr in results if code == 2)
    assert "is writing" in loser or "exists; pass --force" in loser, loser
    assert sorted(p.name for p in out_dir.iterdir()) == ["t.bin", "t.bin.json"]


def test_a_profile_never_replaces_one_of_its_inputs(fp8_checkpoint, tmp_path, runner):
    prompt = tmp_path / "doc.txt"
    prompt.write_text("alpha beta gamma delta")
    result = runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt),
                                 "--out", str(prompt), "--force", "--quiet"])
    refused(result, "an input of this command")
    assert prompt.read_text() == "alpha beta gamma delta"
    profile = tmp_path / "p.prof"
    assert runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt),
                               "--out", str(profile), "--quiet"]).exit_code == 0
    before = profile.read_bytes()
    refused(runner.invoke(cli, ["profile", "merge", str(profile), "-o", str(profile), "--force"]),
            "an input of this command")
    assert profile.read_bytes() == before


def test_a_profile_never_replaces_a_checkpoint_file_even_with_force(checkpoint, tmp_path, runner):
    prompt = tmp_path / "doc.txt"
    prompt.write_text("alpha beta gamma delta")
    files = sorted(p.name for p in checkpoint.iterdir())
    before = (checkpoint / "config.json").read_bytes()
    result = runner.invoke(cli, ["profile", "--model", str(checkpoint), "--prompts", str(prompt),
                                 "--out", str(checkpoint / "config.json"), "--force", "--quiet"])
    refused(result, "is a file of the checkpoint folder", checkpoint, tuple(files))
    assert (checkpoint / "config.json").read_bytes() == before
    # A profile kept beside the checkpoint is its own output: --force replaces it.
    profile = checkpoint / "p.prof"
    for force in ([], ["--force"]):
        assert runner.invoke(cli, ["profile", "--model", str(checkpoint), "--prompts", str(prompt),
                                   "--out", str(profile), "--quiet", *force]).exit_code == 0


def test_an_output_that_is_a_fifo_is_never_replaced_even_with_force(fp8_checkpoint, fp8_table, tmp_path, runner):
    prompt, profile, folder = tmp_path / "doc.txt", tmp_path / "p.prof", tmp_path / "out"
    prompt.write_text("alpha beta gamma delta")
    assert runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt),
                               "--out", str(profile), "--quiet"]).exit_code == 0
    folder.mkdir()
    fifo = folder / "x"
    os.mkfifo(fifo)
    for args in (convert_args(fp8_checkpoint, fifo, "--force"),
                 ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt), "--out", str(fifo),
                  "--force", "--quiet"],
                 ["profile", "merge", str(profile), "-o", str(fifo), "--force", "--quiet"]):
        refused(runner.invoke(cli, args), f"{fifo} is a FIFO, not a regular file", folder, ("x",))
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_pagesums_refuses_a_fifo_or_a_folder_in_place_of_its_output(fp8_table, out_dir, runner):
    table = out_dir / "t.bin"
    shutil.copyfile(fp8_table, table)
    shutil.copyfile(manifest_path(fp8_table), manifest_path(table))
    sums = out_dir / "t.bin.pagesums"
    os.mkfifo(sums)
    refused(runner.invoke(cli, ["pagesums", str(table), "-q"]), f"{sums} is a FIFO, not a regular file",
            out_dir, ("t.bin", "t.bin.json", "t.bin.pagesums"))
    assert stat.S_ISFIFO(os.lstat(sums).st_mode)
    sums.unlink()
    sums.mkdir()
    refused(runner.invoke(cli, ["pagesums", str(table), "-q"]), f"{sums} is a folder",
            out_dir, ("t.bin", "t.bin.json", "t.bin.pagesums"))


def test_a_profile_output_that_is_a_folder_is_refused_before_any_work(fp8_checkpoint, tmp_path, runner,
                                                                     monkeypatch):
    from ple_prep.offline import profile as profile_module

    prompt, folder = tmp_path / "doc.txt", tmp_path / "out.prof"
    prompt.write_text("alpha beta gamma delta")
    folder.mkdir()
    assert runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt),
                               "--out", str(tmp_path / "p.prof"), "--quiet"]).exit_code == 0
    monkeypatch.setattr(profile_module, "profile_files", lambda *a, **k: pytest.fail("profiled anyway"))
    monkeypatch.setattr(profile_module, "load_profile", lambda *a, **k: pytest.fail("loaded anyway"))
    for args in (["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompt), "--out", str(folder)],
                 ["profile", "merge", str(tmp_path / "p.prof"), "-o", str(folder)]):
        refused(runner.invoke(cli, [*args, "--force", "--quiet"]), f"{folder} is a folder; give a file name",
                tmp_path, ("doc.txt", "out.prof", "p.prof"))
        assert list(folder.iterdir()) == []
