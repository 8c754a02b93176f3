"""What the disk tier's readers (runtime/direct.py, runtime/pread.py, the compiled step service's)
share: the bound of their buffers, and about failing reads the timeout, its error, errors that name
the file, and the optional check of what was read against the table's page sums (format/pagesums.py)."""
from __future__ import annotations

import errno
import os

import numpy as np

from ..format.pagesums import page_sums

# Bytes of blocks in flight per reader at most: large pages make large blocks, so a shallower queue.
MAX_BUFFER_BYTES = 8 << 20
# The smallest O_DIRECT unit that suits every common device (logical blocks of 512 or 4096 bytes).
MIN_BLOCK = 4096
# Seconds a request waits for any of its reads to complete before it fails: generous, so that only a
# stalled disk (or a hung network or FUSE file system) trips it, never a busy one.
DEFAULT_READ_TIMEOUT = 30.0


class ReadTimeout(TimeoutError):
    """No read of a request completed within the reader's timeout: the disk stalled."""


def read_error(name: str, code: int, what: str) -> OSError:
    return OSError(code, f"{name}: {what}: {os.strerror(code)}")


def bad_sum_error(name: str, offset: int) -> OSError:
    """A compiled reader's block whose page at file byte `offset` failed its page sum (BAD_SUM,
    runtime/native/disk_reads.h)."""
    return OSError(errno.EIO, f"{name}: the page at byte {offset} read back other bytes than were written (its "
                              "page sum differs): the disk returned corrupted data")


def check_timeout(timeout: float) -> float:
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"read_timeout must be a positive number of seconds, not {timeout!r}")
    return timeout




class PageCheck:
    """The blocks a reader read, checked against the table's page sums (format/pagesums.py): a disk
    that returns other bytes than were written (zeros, another block's, flipped bits) fails the
    request with OSError EIO naming the file and the page, instead of serving them."""

    def __init__(self, sums: np.ndarray, header, block: int, name: str):
        self.sums = sums
        self.name = name
        self.page_size = header.page_size
        self.data_offset = header.data_offset
        self.pages_per_block = block // header.page_size
        self.num_pages = len(sums)

    def check(self, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """`blocks` (uint8 `(n, block)`) as read from file offsets `offsets` (n)."""
        pages = blocks.reshape(-1, self.page_size)
        index = ((offsets.astype(np.int64) - self.data_offset) // self.page_size)[:, None] \
            + np.arange(self.pages_per_block)
        index = index.reshape(-1)
        # A block may start in the header (pages smaller than a block) or run past the last page.
        inside = (index >= 0) & (index < self.num_pages)
        if not inside.all():
            pages, index = pages[inside], index[inside]
        wrong = np.flatnonzero(page_sums(np.ascontiguousarray(pages)) != self.sums[index])
        if len(wrong):
            page = int(index[wrong[0]])
            raise OSError(errno.EIO, f"{self.name}: page {page} (byte {self.data_offset + page * self.page_size}) "
                                     f"read back other bytes than were written (its page sum differs; {len(wrong)} "
                                     f"such pages in this read): the disk returned corrupted data")


def capped_depth(depth: int, page_size: int) -> int:
    """`depth` reads in flight, fewer where their blocks of `page_size` pages pass MAX_BUFFER_BYTES."""
    return max(1, min(int(depth), MAX_BUFFER_BYTES // max(page_size, MIN_BLOCK)))
