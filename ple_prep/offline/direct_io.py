"""Writes that bypass the page cache where the filesystem allows (O_DIRECT), for the table writers.

A table the size of RAM written through the page cache would push everything else out of it, and
copying it through the cache costs as much CPU as hashing it. O_DIRECT needs buffers, offsets and
lengths aligned to the device's logical block: 4 KiB covers every common device, and pages that
size or larger keep every write aligned. Where a write is refused, the descriptor goes back to the
page cache and the write is retried.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np

DIRECT_IO_ALIGNMENT = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_zeros(nbytes: int) -> np.ndarray:
    """Zeroed bytes at a page-aligned address (anonymous memory), as O_DIRECT needs."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def set_direct(descriptor: int, direct: bool) -> bool:
    """Turn O_DIRECT on or off; False when the filesystem refuses or nothing changed."""
    flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
    wanted = flags | O_DIRECT if direct else flags & ~O_DIRECT
    if not O_DIRECT or wanted == flags:
        return False
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETFL, wanted)
    except OSError:
        return False
    return True


def write_all(descriptor: int, pages: np.ndarray) -> None:
    """All of `pages` at the descriptor's position."""
    view = memoryview(pages).cast("B")
    while len(view):
        try:
            written = os.write(descriptor, view)
        except OSError as exc:
            # O_DIRECT refused this write (alignment the device wants, or a filesystem that accepts
            # the flag but not the I/O): carry on through the page cache.
            if exc.errno == errno.EINVAL and set_direct(descriptor, False):
                continue
            raise
        view = view[written:]


def pwrite_all(descriptor: int, data: np.ndarray, offset: int) -> None:
    """All of `data` at `offset`, as `write_all` does at the position."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    while len(view):
        try:
            written = os.pwrite(descriptor, view, offset)
        except OSError as exc:
            if exc.errno == errno.EINVAL and set_direct(descriptor, False):
                continue
            raise
        view, offset = view[written:], offset + written
