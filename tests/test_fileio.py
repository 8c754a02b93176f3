"""Positioned reads that must fill their buffer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ple_prep.core.errors import BadInput
from ple_prep.core.fileio import (
    atomic_output,
    check_json_depth,
    create_exclusive,
    load_json,
    lock_path,
    open_regular,
    output_lock,
    partial_owner,
    partial_path,
    read_bounded,
    read_exactly,
    write_atomic,
)


def test_read_exactly_fills_the_buffer_from_the_offset(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(100)))
    buffer = bytearray(10)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        read_exactly(descriptor, memoryview(buffer), 40, path.name)
    finally:
        os.close(descriptor)
    assert bytes(buffer) == bytes(range(40, 50))


def test_read_exactly_past_the_end_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BadInput, match="short.bin ended early at byte 100"):
            read_exactly(descriptor, memoryview(bytearray(10)), 95, path.name)
    finally:
        os.close(descriptor)


# --- Bounded inputs ----------------------------------------------------------------------------------

def test_a_fifo_is_refused_at_once_never_read(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="is a FIFO, not a regular file"):
        load_json(fifo, "config")


def test_a_symlink_to_a_character_device_is_refused(tmp_path):
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(BadInput, match="is a character device, not a regular file"):
        read_bounded(link, 1 << 20, "config")


def test_a_socket_is_refused(tmp_path):
    import socket

    path = tmp_path / "s"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    try:
        with pytest.raises(BadInput, match="socket"):
            open_regular(path, "shard")
    finally:
        server.close()


def test_a_symlink_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "real.json").write_text('{"a": [1, {"b": 2}]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert load_json(tmp_path / "link.json") == {"a": [1, {"b": 2}]}


def test_a_file_over_the_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as handle:
        handle.truncate(3 << 20)
    with pytest.raises(BadInput, match="over the 1 MiB limit"):
        load_json(path, "config", limit=1 << 20)


@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a":', "}")])
def test_deep_nesting_is_refused_before_parsing(tmp_path, opening, closing):
    path = tmp_path / "deep.json"
    path.write_text(opening * 100_000 + "1" + closing * 100_000)
    with pytest.raises(BadInput, match="nests deeper than 64 levels"):
        load_json(path, "config")


def test_nesting_up_to_the_cap_parses_and_brackets_in_strings_do_not_count(tmp_path):
    data = ("[" * 64 + '"[[[[{{{{\\"]]"' + "]" * 64).encode()
    assert check_json_depth(data, 64, "x") is None
    with pytest.raises(BadInput, match="nests deeper than 63"):
        check_json_depth(data, 63, "x")


def test_unbalanced_brackets_are_refused(tmp_path):
    with pytest.raises(BadInput, match="brackets do not match"):
        check_json_depth(b"[" * 1000, 64, "x")


# --- Atomic outputs ----------------------------------------------------------------------------------

def test_atomic_output_appears_complete_with_the_documented_mode(tmp_path):
    final = tmp_path / "out.json"
    old_umask = os.umask(0o022)
    try:
        write_atomic(final, b"data")
    finally:
        os.umask(old_umask)
    assert final.read_bytes() == b"data"
    assert final.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_symlink_at_the_final_name_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "out").mkdir()
    final = tmp_path / "out" / "t.json"
    final.symlink_to(victim)
    write_atomic(final, b"new")
    assert victim.read_bytes() == b"precious"
    assert not final.is_symlink() and final.read_bytes() == b"new"


def test_temporary_names_are_unpredictable_and_created_exclusively(tmp_path):
    final = tmp_path / "t.bin"
    names = {partial_path(final).name for _ in range(50)}
    assert len(names) == 50
    assert all(partial_owner(final, Path(name)) == os.getpid() for name in names)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = partial_path(final, "fixed")
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_exclusive(planted)
    assert victim.read_bytes() == b"precious"


def test_a_failed_write_leaves_nothing(tmp_path):
    final = tmp_path / "t.json"
    with pytest.raises(RuntimeError), atomic_output(final) as handle:
        handle.write(b"half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_second_writer_of_one_output_fails_and_the_lock_goes_with_the_first(tmp_path):
    final = tmp_path / "t.bin"
    busy = rf"another ple-prep process \(pid {os.getpid()}\) is writing"
    with output_lock(final), pytest.raises(BadInput, match=busy), output_lock(final):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_left_by_a_dead_writer_is_taken_over(tmp_path):
    final = tmp_path / "t.bin"
    lock_path(final).write_text("999999999\n")
    with output_lock(final):
        assert lock_path(final).read_text() == f"{os.getpid()}\n"
    assert not lock_path(final).exists()
