"""The file system a test's files are on, for tests of behaviour that depends on it."""
from __future__ import annotations

import os

import pytest

from ple_prep.core import fileio


def skip_unless_on_a_block_file_system(path) -> None:
    """Skip unless `path` is on ext4, xfs, btrfs or f2fs (native AIO asynchronous however fast the disk)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        kind = fileio.file_system_type(descriptor)
    finally:
        os.close(descriptor)
    if kind not in fileio.BLOCK_FILE_SYSTEMS:
        pytest.skip(f"the test folder is on file system type {kind!r}, not a block device's")
