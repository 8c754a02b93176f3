"""The disk tier read with `preadv` on threads: the read path where O_DIRECT or native AIO is
refused, or where O_DIRECT reads complete inside io_submit (one at a time, out of the timeout's
reach: FUSE, some network file systems). Reads pass through the page cache but never fault, so an
I/O error or a short read raises naming the file, and a stalled read fails its request after the
reader's timeout instead of holding it (docs/RELIABILITY.md, "Serving under a failing disk").
"""
from __future__ import annotations

import concurrent.futures
import errno
import math
import os
import threading

import numpy as np

from ..format.pages import row_offsets
from .readcheck import (
    DEFAULT_READ_TIMEOUT,
    MAX_BUFFER_BYTES,
    MIN_BLOCK,
    PageCheck,
    ReadTimeout,
    check_timeout,
    read_error,
)

# Threads reading at once: the reads in flight.
PREAD_THREADS = 32


class PreadReader:
    """Rows of one table file by slot with `preadv` on `threads` threads: the disk tier where O_DIRECT
    or native AIO is refused. Reads are buffered (they pass through the page cache) but never fault:
    an I/O error or a short read raises, naming `name`. A batch whose reads have not all completed
    within `timeout` seconds raises ReadTimeout; its threads are left to the stuck reads (their
    buffer with them) and the next request gets new ones.
    """

    kind = "pread"

    def __init__(self, descriptor: int, header, threads: int = PREAD_THREADS, *, name: str,
                 timeout: float = DEFAULT_READ_TIMEOUT, page_sums: np.ndarray | None = None):
        self.name = name
        self.timeout = check_timeout(timeout)
        self.queue_depth = max(1, int(threads))
        self._header = header
        self._row_bytes = header.row_bytes
        self._block = max(header.page_size, MIN_BLOCK)
        self._file_end = header.data_offset + header.num_pages * header.page_size
        self._step = math.gcd(header.page_size, header.row_bytes)
        self._row_type = np.dtype((np.void, header.row_bytes))
        # Blocks read per batch: each thread a few, a bounded buffer.
        self._batch = max(1, min(self.queue_depth * 8, MAX_BUFFER_BYTES // self._block))
        self.page_check = None if page_sums is None else PageCheck(page_sums, header, self._block, name)
        self._descriptor = os.dup(descriptor)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        # After the request in flight (if any, at most a read timeout): its threads read the
        # descriptor, which another open could otherwise take over.
        held = self._lock.acquire(timeout=self.timeout)
        try:
            if self._descriptor >= 0:
                os.close(self._descriptor)
                self._descriptor = -1
        finally:
            if held:
                self._lock.release()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        # A fork's child has none of its parent's threads: it starts its own pool.
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = concurrent.futures.ThreadPoolExecutor(self.queue_depth, thread_name_prefix="ple-prep-pread")
            self._pool_pid = os.getpid()
        return self._pool

    def gather_slots(self, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill `out` (uint8 `(len(slots), row_bytes)`, C-contiguous) with the rows at `slots`."""
        if self._descriptor < 0:
            raise ValueError("the table is closed")
        if not len(slots):
            return out
        offsets = row_offsets(self._header, slots)
        distinct, block_of = np.unique(offsets // self._block, return_inverse=True)
        block_of = block_of.reshape(-1)
        units = (offsets % self._block) // self._step
        order = np.argsort(block_of, kind="stable")
        target = out.view(self._row_type).reshape(-1)
        units_per_block = self._block // self._step
        with self._lock:
            for low in range(0, len(distinct), self._batch):
                high = min(low + self._batch, len(distinct))
                buffer = self._read_blocks(distinct[low:high] * self._block)
                view = np.ndarray(shape=((buffer.nbytes - self._row_bytes) // self._step + 1,), dtype=self._row_type,
                                  buffer=buffer, strides=(self._step,))
                first, last = np.searchsorted(block_of[order], [low, high])
                positions = order[first:last]
                target[positions] = view[(block_of[positions] - low) * units_per_block + units[positions]]
        return out

    def _read_blocks(self, block_offsets: np.ndarray) -> np.ndarray:
        """The blocks at these file offsets, read on the pool's threads (each a share in turn)."""
        buffer = np.empty((len(block_offsets), self._block), dtype=np.uint8)
        offsets = block_offsets.tolist()
        shares = min(self.queue_depth, len(offsets))
        pool = self._threads()
        stop = threading.Event()
        futures = [pool.submit(self._read_share, buffer, offsets, share, shares, stop) for share in range(shares)]
        done, waiting = concurrent.futures.wait(futures, timeout=self.timeout)
        if waiting:
            stop.set()
            # The stuck threads keep `buffer` alive through their arguments until their reads return.
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            raise ReadTimeout(errno.ETIMEDOUT, f"{self.name}: {len(waiting)} of {shares} read threads got no answer "
                                               f"in {self.timeout:g} s: the disk stalled; this request failed and "
                                               f"the next one reads again")
        for future in futures:
            future.result()
        if self.page_check is not None:
            self.page_check.check(buffer, block_offsets)
        return buffer

    def _read_share(self, buffer: np.ndarray, offsets: list[int], share: int, shares: int,
                    stop: threading.Event) -> None:
        for index in range(share, len(offsets), shares):
            if stop.is_set():  # the request timed out: read nothing more for it
                return
            offset = offsets[index]
            try:
                got = os.preadv(self._descriptor, [buffer[index]], offset)
            except OSError as exc:
                raise read_error(self.name, exc.errno, f"read of {self._block} bytes at byte {offset}") from None
            if got < self._block and offset + got < self._file_end:
                raise OSError(errno.EIO, f"{self.name}: short read at byte {offset} ({got} of {self._block} "
                                         f"bytes): the file shrank or the disk failed")
