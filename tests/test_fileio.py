"""Positioned reads that must fill their buffer."""
from __future__ import annotations

import os

import pytest

from ple_prep.core.errors import BadInput
from ple_prep.core.fileio import read_exactly


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
