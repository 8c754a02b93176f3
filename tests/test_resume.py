"""`convert --resume`: a killed run's verified blocks are kept, bad or foreign progress is not.

A real convert subprocess (64 KiB checksum blocks, so the 2.7 MB fixture has 43) is killed once
its progress journal lists some blocks; the resumed run must keep that run's file id (it continued
the same file) and the result must equal the source byte for byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.killing import kill, start_cli, wait_until

from ple_prep.cli import cli
from ple_prep.format.manifest import load_manifest, manifest_path
from ple_prep.offline import writer
from ple_prep.offline.verify import verify
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint

BLOCK_BYTES = 64 << 10
SMALL_BLOCKS = f"from ple_prep.offline import writer\nwriter.CHECKSUM_BLOCK_BYTES = {BLOCK_BYTES}"


@pytest.fixture(autouse=True)
def kept_blocks(monkeypatch) -> list[int]:
    """Small blocks as in the child; records how many blocks each resume re-verified and kept."""
    monkeypatch.setattr(writer, "CHECKSUM_BLOCK_BYTES", BLOCK_BYTES)
    kept: list[int] = []
    verify_prefix = writer.verify_prefix

    def recording(*args, **kwargs):
        result = verify_prefix(*args, **kwargs)
        kept.append(result[0])
        return result

    monkeypatch.setattr(writer, "verify_prefix", recording)
    return kept


def _kill_after_blocks(model: Path, out: Path, blocks: int, *extra: str) -> tuple[Path, Path, str]:
    """Start a convert, SIGKILL it once its journal lists `blocks` blocks; its partial, journal, file id."""
    process = start_cli(["convert", "--model", str(model), "--out", str(out), "-q", *extra], setup=SMALL_BLOCKS)
    journal_out = out if not extra else out.with_name(f"{out.stem}.tp{extra[3]}of{extra[1]}{out.suffix}")
    wait_until(lambda: _journal_lines(_journal_of(journal_out, process.pid)) >= blocks + 1,
               timeout=60, process=process)
    assert kill(process) == -9, "the convert finished before it could be killed"
    journal = _journal_of(journal_out, process.pid)
    data = journal_out.with_name(journal.name.replace(".progress.", ".", 1))
    file_id = json.loads(journal.read_bytes().split(b"\n")[0])["file_id"]
    return data, journal, file_id


def _journal_of(out: Path, pid: int) -> Path | None:
    """The journal of `pid`'s convert of `out` (its name ends in a random token), once it exists."""
    found = list(out.parent.glob(f".{out.name}.progress.{pid}-*.partial"))
    return found[0] if found else None


def _journal_lines(journal: Path | None) -> int:
    """Lines in a journal; 0 before it exists or after a finished run removed it."""
    try:
        return journal.read_bytes().count(b"\n") if journal is not None else 0
    except FileNotFoundError:
        return 0


def _resume(runner, model: Path, out: Path, *extra: str) -> dict:
    result = runner.invoke(cli, ["convert", "--model", str(model), "--out", str(out), "--resume",
                                 "-q", *extra])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, manifest_path(out).name]
    report = verify(out, model)
    assert report.ok and report.rows_compared == FIXTURE_ROWS and report.mismatched_rows == 0
    return load_manifest(manifest_path(out))


@pytest.mark.parametrize("blocks", [1, 30])
def test_convert_resume_continues_killed_run(fp8_checkpoint, tmp_path, runner, kept_blocks, blocks):
    out = tmp_path / "t.bin"
    data, journal, file_id = _kill_after_blocks(fp8_checkpoint, out, blocks)
    journaled = journal.read_bytes().count(b"\n") - 1
    inode = data.stat().st_ino
    assert _resume(runner, fp8_checkpoint, out)["file_id"] == file_id
    assert kept_blocks == [journaled] and journaled >= blocks
    assert out.stat().st_ino == inode  # the killed run's file, continued


@pytest.mark.parametrize("position, kept", [(4096 + 7 * BLOCK_BYTES + 123, 7), (20, 0)])
def test_convert_resume_rewrites_blocks_damaged_after_the_kill(fp8_checkpoint, tmp_path, runner,
                                                               kept_blocks, position, kept):
    out = tmp_path / "t.bin"
    data, _, file_id = _kill_after_blocks(fp8_checkpoint, out, 20)
    with open(data, "r+b") as handle:  # one bit of block 7, or of the header
        handle.seek(position)
        byte = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([byte ^ 0x10]))
    assert _resume(runner, fp8_checkpoint, out)["file_id"] == file_id
    assert kept_blocks == [kept]


def test_convert_resume_of_torn_journal_keeps_whole_lines(fp8_checkpoint, tmp_path, runner,
                                                          kept_blocks):
    out = tmp_path / "t.bin"
    _, journal, file_id = _kill_after_blocks(fp8_checkpoint, out, 10)
    journaled = journal.read_bytes().count(b"\n") - 1
    with open(journal, "ab") as handle:
        handle.write(b'{"block": 99, "crc3')
    assert _resume(runner, fp8_checkpoint, out)["file_id"] == file_id
    assert kept_blocks == [journaled]


def test_convert_resume_with_other_source_starts_afresh(fp8_checkpoint, tmp_path, runner,
                                                        kept_blocks):
    other = make_checkpoint(tmp_path / "other", "fp8", seed=9)  # same sizes, other rows
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "t.bin"
    _, _, file_id = _kill_after_blocks(other, out, 10)
    assert _resume(runner, fp8_checkpoint, out)["file_id"] != file_id
    assert kept_blocks == []


def test_convert_resume_without_killed_run_converts(fp8_checkpoint, tmp_path, runner):
    _resume(runner, fp8_checkpoint, tmp_path / "t.bin")


def test_convert_without_resume_removes_killed_run(fp8_checkpoint, tmp_path, runner):
    out = tmp_path / "t.bin"
    _, _, file_id = _kill_after_blocks(fp8_checkpoint, out, 10)
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(out), "-q"])
    assert result.exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]
    assert load_manifest(manifest_path(out))["file_id"] != file_id


def test_convert_resume_tp_rank(fp8_checkpoint, tmp_path, runner):
    out = tmp_path / "t.bin"
    rank_file = tmp_path / "t.tp1of2.bin"
    _, _, file_id = _kill_after_blocks(fp8_checkpoint, out, 5, "--tp-size", "2", "--tp-rank", "1")
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(out),
                                 "--tp-size", "2", "--tp-rank", "1", "--resume", "-q"])
    assert result.exit_code == 0, result.output
    assert load_manifest(manifest_path(rank_file))["file_id"] == file_id
    report = verify(rank_file, fp8_checkpoint)
    assert report.ok and report.rows_compared == FIXTURE_ROWS // 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tp1of2.bin", "t.tp1of2.bin.json"]
