"""Writes that bypass the page cache where the filesystem allows (O_DIRECT), for the table writers.

A table the size of RAM written through the page cache would push everything else out of it, and
copying it through the cache costs as much CPU as hashing it. O_DIRECT needs buffers, offsets and
lengths aligned to the device's logical block: 4 KiB covers every common device, and pages that
size or larger keep every write aligned. Where a write is refused, the descriptor goes back to the
page cache and the write is retried.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import mmap
import os

import numpy as np

from ..converters.base import TableSource
from ..core.errors import BadInput
from ..core.fileio import open_regular

DIRECT_IO_ALIGNMENT = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_zeros(nbytes: int) -> np.ndarray:
    """Zeroed bytes at a page-aligned address (anonymous memory), as O_DIRECT needs, in huge pages
    where the kernel gives them: a disk request holds at most max_segments pieces of contiguous
    memory (254 on a virtio disk: 1 MiB of 4 KiB pages), so 4 KiB pages split the convert's I/O into
    small requests the disk moved at half the rate (docs/benchmark-history.md, "What moved the
    convert, 2026-12-03")."""
    # Private: a shared anonymous mapping is shmem, which this kernel's settings keep in 4 KiB pages.
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint8)


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


def preallocate(descriptor: int, nbytes: int) -> None:
    """Give the file its first `nbytes` of blocks up front (Linux fallocate, mode 0) where the
    filesystem can: O_DIRECT writes into a hole allocate as they go, several times slower beside
    the source's reads (docs/benchmark-history.md, "What moved the convert, 2026-12-03"). A full
    disk raises; elsewhere nothing is done (no zeros are written, as posix_fallocate's fallback
    would)."""
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(descriptor, 0, 0, nbytes) != 0:
        error = ctypes.get_errno()
        if error in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(error, os.strerror(error))


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


class DirectRows:
    """Rows of a source table read with O_DIRECT into page-aligned buffers, as views of them.

    Reading through the page cache costs the kernel more CPU than hashing the bytes on a virtio
    disk (BENCHMARKS.md, "Convert speed and memory"), and a source larger than RAM only churns the
    cache. A read covers its rows' bytes widened to DIRECT_IO_ALIGNMENT at both ends, so the rows
    start a little into the buffer. Rows that one file does not hold in one run (split-head
    tables, a read across two segments, rows no file holds), files that refuse O_DIRECT and every
    read of a source with reads of its own (a subclass's `read_rows`) are read by the source itself.
    """

    def __init__(self, source: TableSource):
        self.source = source
        self.row_bytes = source.row_bytes
        own_reads = type(source).read_rows is not TableSource.read_rows
        self.segments = list(source.parts[0]) if len(source.parts) == 1 and not own_reads else []
        self.direct = bool(O_DIRECT) and bool(self.segments)
        self._starts = [segment.first_row for segment in self.segments]
        self._descriptors: dict = {}

    def __enter__(self) -> "DirectRows":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def buffer(self, rows: int) -> np.ndarray:
        """A buffer that `read` can fill with up to `rows` rows."""
        return aligned_zeros(rows * self.row_bytes + 2 * DIRECT_IO_ALIGNMENT)

    def read(self, start: int, stop: int, buffer: np.ndarray) -> np.ndarray:
        """Rows [start, stop) in source order, uint8 `(stop - start, row_bytes)`, a view of `buffer`."""
        count = stop - start
        if self.direct and count:
            segment = self.segments[bisect.bisect_right(self._starts, start) - 1]
            if segment.path is not None and stop <= segment.first_row + segment.num_rows:
                rows = self._read_direct(segment, start, count, buffer)
                if rows is not None:
                    return rows
        out = buffer[:count * self.row_bytes].reshape(count, self.row_bytes)
        return self.source.read_rows(start, stop, out=out)

    def _read_direct(self, segment, start: int, count: int, buffer: np.ndarray) -> np.ndarray | None:
        offset = segment.offset + (start - segment.first_row) * self.row_bytes
        skew = offset % DIRECT_IO_ALIGNMENT
        needed = skew + count * self.row_bytes
        view = memoryview(buffer)[:-(-needed // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT]
        descriptor = self._descriptor(segment.path)
        got = 0
        while got < needed:
            try:
                read = os.preadv(descriptor, [view[got:]], offset - skew + got)
            except OSError as exc:
                # A file system that takes the flag but not the read: the page cache from here on.
                if exc.errno == errno.EINVAL:
                    self.direct = False
                    return None
                raise
            if read <= 0:
                raise BadInput(f"{segment.path.name} ended early at byte {offset - skew + got}: "
                               f"the file was truncated")
            got += read
        return buffer[skew:needed].reshape(count, self.row_bytes)

    def _descriptor(self, path) -> int:
        if path not in self._descriptors:
            descriptor = open_regular(path, "source file")
            if not set_direct(descriptor, True):
                self.direct = False
            self._descriptors[path] = descriptor
        return self._descriptors[path]
