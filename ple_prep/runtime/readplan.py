"""A request's read-ahead and its plan: which disk rows are read, in which order, for which chunk.

Every distinct row of the request's coming chunks, grouped by the disk block that holds it, each
block read with the first chunk that needs any of its rows, chunk by chunk in order: a block is read
once, the later chunks' rows on it with it. Rows on adjacent blocks go together too (the kernel
merges adjacent reads submitted together into one request; BENCHMARKS.md, "Host cache and
read-ahead"). runtime/readahead.py's CachedDiskTier reads the plan into the host cache.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

_SERIALS = itertools.count(1)


class ReadAhead:
    """One request's read-ahead: `chunks` (arrays of file slots) in the order they will be read.

    `block_of` gives each slot's disk block. The plan: `slots`, every distinct row in the order
    read-ahead reads them (by chunk, then by slot), each block's rows adjacent; `group_ends[k]`, the
    end in `slots` of the rows read for chunk k (on the blocks chunk k is the first to need)."""

    def __init__(self, chunks: list[np.ndarray], block_of):
        self.chunks = [np.asarray(chunk, dtype=np.int64).reshape(-1) for chunk in chunks]
        self.serial = next(_SERIALS)
        self.chunks_done = 0      # chunks whose rows have all been read or found cached
        self.rows_read = 0        # rows this read-ahead read from the disk
        self.rows_found = 0       # rows it found cached already
        self.pages_read = 0       # pages those reads took
        self.done_rows = 0        # rows of `slots` handled so far
        self.error: BaseException | None = None
        self._block_of = block_of
        self._cancelled = False
        self._done = threading.Event()
        self._tier = None  # the CachedDiskTier reading it (runtime/readahead.py)
        count = max(len(self.chunks), 1)
        every = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int64)
        # Each row with the first chunk to need it, from one sort of (slot, chunk) keys (slots are
        # below 2**32: format/order.py's 4-byte ranks).
        keys = np.sort(every * count + np.repeat(np.arange(len(self.chunks)), [len(chunk) for chunk in self.chunks]))
        firsts = np.flatnonzero(np.diff(keys // count, prepend=-1))
        distinct, row_chunk = keys[firsts] // count, keys[firsts] % count
        blocks = block_of(distinct)  # sorted with the slots
        # Rows on adjacent blocks go with the first chunk to need any of them: read together, the
        # kernel merges adjacent blocks into one request, and the disk serves fewer of them.
        group = row_chunk
        if len(distinct):
            starts = np.flatnonzero(np.diff(blocks, prepend=-2) > 1)
            group = np.repeat(np.minimum.reduceat(row_chunk, starts), np.diff(np.append(starts, len(distinct))))
        # By chunk, then by slot (already so within a chunk): a stable sort, a radix one for few chunks.
        order = np.argsort(group.astype(np.uint16) if count <= 1 << 16 else group, kind="stable")
        self.slots = distinct[order]
        self.group_ends = np.searchsorted(group[order], np.arange(len(self.chunks)), side="right")
        self._distinct, self._blocks, self._row_chunk = distinct, blocks, row_chunk
        self._position = np.empty(len(distinct), dtype=np.int64)
        self._position[order] = np.arange(len(distinct))
        self._advance(0)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every chunk was read (or the read-ahead stopped); True if it finished."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop reading ahead and release the pins of this request's rows not yet looked up."""
        self._cancelled = True
        if self._tier is not None:
            self._tier.cancelled(self)

    def _advance(self, done_rows: int) -> None:
        self.done_rows = done_rows
        self.chunks_done = int(np.searchsorted(self.group_ends, done_rows, side="right"))

    def positions(self, slots: np.ndarray) -> np.ndarray | None:
        """Each slot's place in `slots` (the plan's order), or None unless all are in the plan."""
        if not len(self._distinct):
            return None
        index = np.minimum(np.searchsorted(self._distinct, slots), len(self._distinct) - 1)
        if not np.array_equal(self._distinct[index], slots):
            return None
        return self._position[index]

    def coming_rows_on_blocks_of(self, slots: np.ndarray, done_rows: int) -> np.ndarray:
        """The plan's rows on the blocks of `slots` that its read has not reached (at `done_rows`)
        and whose first chunk comes after those of `slots`'s rows in the plan: read with `slots`,
        those blocks are read once."""
        if not len(self._distinct) or not len(slots):
            return np.zeros(0, dtype=np.int64)
        blocks = np.unique(self._block_of(slots))
        low = np.searchsorted(self._blocks, blocks, side="left")
        counts = np.searchsorted(self._blocks, blocks, side="right") - low
        index = np.repeat(low - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        where = np.minimum(np.searchsorted(self._distinct, slots), len(self._distinct) - 1)
        planned = where[self._distinct[where] == slots]
        chunk = int(self._row_chunk[planned].max()) if len(planned) else -1
        keep = (self._position[index] >= done_rows) & (self._row_chunk[index] > chunk)
        return self._distinct[index[keep]]
