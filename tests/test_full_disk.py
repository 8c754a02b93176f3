"""Full disk: a convert that runs out of space says so in one line and leaves no partial file.

The disk is a small tmpfs the test mounts (`small_disk` in conftest.py: root only; otherwise the
tests skip and say why). The
free-space pre-check would refuse up front, so it is bypassed (monkeypatched) for the ENOSPC tests:
they exercise the writer's own handling of a disk that fills after the check.
"""
from __future__ import annotations

import pytest

from ple_prep.cli import cli
from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.offline import writer
from ple_prep.offline.ranks import convert_ranks


def _table_size(checkpoint) -> int:
    with open_source(checkpoint) as source:
        return writer.Header.for_table(page_size=4096, row_bytes=source.row_bytes,
                                       encoding=source.encoding, values_per_row=source.values_per_row,
                                       num_rows=source.num_rows, first_row=0, num_placed=0,
                                       file_id=bytes(16)).file_size


@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)
def test_convert_disk_full_during_data_is_one_line_and_leaves_nothing(
        small_disk, fp8_checkpoint, runner, monkeypatch):
    monkeypatch.setattr(writer, "check_free_space", lambda folder, needed: None)
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out",
                                 str(small_disk / "t.bin")])
    assert result.exit_code == 2
    assert result.output == (f"error: the disk holding {small_disk} filled up while writing; "
                             f"partial files removed\n")
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("small_disk", ["2781184"], indirect=True)
def test_convert_disk_full_at_manifest_leaves_nothing(small_disk, fp8_checkpoint, monkeypatch):
    # The disk holds the data file, the one-page progress journal and the one-page lock file to
    # the byte, nothing more: the manifest write fails.
    assert _table_size(fp8_checkpoint) == 2772992
    monkeypatch.setattr(writer, "check_free_space", lambda folder, needed: None)
    manifests_started = []
    write_manifest = writer.write_manifest

    def recording_write_manifest(manifest, path):
        manifests_started.append(path)
        return write_manifest(manifest, path)

    monkeypatch.setattr(writer, "write_manifest", recording_write_manifest)
    with open_source(fp8_checkpoint) as source:
        with pytest.raises(BadInput, match="filled up while writing; partial files removed"):
            writer.convert(source, small_disk / "t.bin")
    assert len(manifests_started) == 1  # the data file was whole; the manifest hit the full disk
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)
def test_convert_free_space_check_refuses_before_writing(small_disk, fp8_checkpoint, runner):
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out",
                                 str(small_disk / "t.bin")])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: not enough free space in {small_disk}: the table needs")
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("small_disk", ["4m"], indirect=True)
def test_convert_ranks_check_space_for_all_ranks_first(small_disk, fp8_checkpoint):
    # Each of the 2 rank files fits alone; both together do not: refused before the first.
    with open_source(fp8_checkpoint) as source:
        with pytest.raises(BadInput, match="not enough free space"):
            convert_ranks(source, small_disk / "t.bin", 2)
    assert list(small_disk.iterdir()) == []
