"""The row order: which table row sits in which slot of the prepared file.

The first `num_placed` slots hold chosen rows (the hot ones) in the order given; every other row
follows in source order. Only the placed rows are stored, so the map costs 12 bytes per placed row
and nothing for the rest: slot = num_placed + row - (placed rows below it).

A lookup must cost the same whatever the map's size (the real table places about 21M rows). A
binary search of `sorted_rows` pays a dozen cache misses per id at that size (and, with int64 keys
on the uint32 map, numpy converts the whole map on every call), so lookups read a rank index built
once: for each 64 rows a 16-byte pair, their bits (placed or not) and the count of placed rows
before them, so one cache line per id (2 bits a row: 80 MB for the real table, a third of its map).
It lies in huge pages, as the copy of `sorted_slots` it reads does (84 MB for the real table), so
the random reads take no TLB misses. The compiled helper (core/native/slots.c) walks it in one loop;
numpy does the same in a dozen passes.
"""
from __future__ import annotations

import functools
import mmap
import threading
from typing import NamedTuple

import numpy as np

from ..core.constants import ORDER_DTYPE
from ..core.errors import BadInput

try:
    from ..core import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

# Placed rows turned into rank-index bits per step while building it (bounds its temporaries).
RANK_BUILD_ROWS = 1 << 20
HUGE_PAGE_BYTES = 1 << 21


class RankIndex(NamedTuple):
    """What a lookup reads, both in huge pages (`_huge_page_array`): `rank_words`, (words, 2)
    uint64, each 64 rows' bits and the placed rows before them; and a copy of `sorted_slots`, whose
    random reads in the file mapping's 4 KiB pages cost a TLB miss each (a third of a large
    lookup's time)."""

    rank_words: np.ndarray
    sorted_slots: np.ndarray


NO_RANK_INDEX = RankIndex(np.zeros((0, 2), dtype=np.uint64), np.zeros(0, dtype=np.uint32))


class RowOrder:
    def __init__(self, num_rows: int, slot_rows: np.ndarray, sorted_rows: np.ndarray,
                 sorted_slots: np.ndarray):
        self.num_rows = num_rows
        self.slot_rows = slot_rows
        self.sorted_rows = sorted_rows
        self.sorted_slots = sorted_slots
        self._rank_index: RankIndex | None = None
        # Lookups run on several threads at once (runtime/device/): one of them builds the index.
        self._rank_lock = threading.Lock()

    @property
    def num_placed(self) -> int:
        return len(self.slot_rows)

    @property
    def is_identity(self) -> bool:
        return bool(np.array_equal(self.slot_rows, np.arange(self.num_placed)))

    @classmethod
    def identity(cls, num_rows: int) -> "RowOrder":
        empty = np.zeros(0, dtype=ORDER_DTYPE)
        return cls(num_rows, empty, empty, empty)

    @classmethod
    def from_placed(cls, placed_rows: np.ndarray, num_rows: int) -> "RowOrder":
        """Rows to put first, in slot order; they must be distinct and inside the table."""
        placed = np.asarray(placed_rows, dtype=np.int64).reshape(-1)
        if len(placed) and (placed.min() < 0 or placed.max() >= num_rows):
            raise BadInput(f"placed row outside the table of {num_rows} rows")
        by_row = np.argsort(placed, kind="stable")
        sorted_rows = placed[by_row]
        if np.any(sorted_rows[1:] == sorted_rows[:-1]):
            raise BadInput("a row is placed twice")
        return cls(num_rows, placed.astype(ORDER_DTYPE), sorted_rows.astype(ORDER_DTYPE),
                   by_row.astype(ORDER_DTYPE))

    def to_bytes(self) -> bytes:
        return self.slot_rows.tobytes() + self.sorted_rows.tobytes() + self.sorted_slots.tobytes()

    @classmethod
    def from_buffer(cls, buffer, num_placed: int, num_rows: int, name: str = "file") -> "RowOrder":
        """Views over a stored map, checked so that no lookup can leave the table."""
        arrays = [np.frombuffer(buffer, dtype=ORDER_DTYPE, count=num_placed, offset=4 * i * num_placed)
                  for i in range(3)]
        slot_rows, sorted_rows, sorted_slots = arrays
        if num_placed:
            if (sorted_rows[-1] >= num_rows or np.any(sorted_rows[1:] <= sorted_rows[:-1])
                    or sorted_slots.max() >= num_placed
                    or not np.array_equal(slot_rows[sorted_slots], sorted_rows)):
                raise BadInput(f"{name}: the row-order map is inconsistent (corrupt file)")
        return cls(num_rows, slot_rows, sorted_rows, sorted_slots)

    def slot_of(self, ids: np.ndarray, first_row: int = 0) -> np.ndarray:
        """File slot of each row id (int64, the shape of `ids`): ids are local rows plus
        `first_row` (a rank file's first row); an id outside them raises IndexError."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rank_words, sorted_slots = self.rank_index
        if _native is not None:
            slots = np.empty(ids.shape, dtype=np.int64)
            _native.slot_of(ids, first_row, self.num_rows, rank_words, sorted_slots, slots)
            return slots
        rows = ids - first_row
        # One pass checks both ends: seen as unsigned, a negative local id is above any row count.
        if rows.size and rows.view(np.uint64).max() >= self.num_rows:
            bad = ids[(rows < 0) | (rows >= self.num_rows)][0]
            raise IndexError(f"row id {bad} is outside this table's rows [{first_row}, {first_row + self.num_rows})")
        if not self.num_placed:
            return rows
        words = rows >> 6
        # Each row's bit moved to the top of its word: it says whether the row is placed, and the
        # bits at and below it count the placed rows up to it.
        to_row = rank_words[words, 0]
        to_row <<= (63 - (rows & 63)).view(np.uint64)
        placed = to_row >> np.uint64(63)
        below_row = rank_words[words, 1] + _popcount(to_row)
        below_row -= placed
        below_row = below_row.view(np.int64)
        slots = self.num_placed + rows - below_row
        placed_slots = sorted_slots[np.minimum(below_row, self.num_placed - 1)]
        return np.where(placed.view(np.int64) != 0, placed_slots, slots)

    @property
    def rank_index(self) -> RankIndex:
        """The lookup's index (RankIndex), built on first use; empty arrays where no row is placed
        (then a slot is the row)."""
        if not self.num_placed:
            return NO_RANK_INDEX
        if self._rank_index is None:
            with self._rank_lock:
                if self._rank_index is None:
                    self._rank_index = self.build_rank_index()
        return self._rank_index

    def build_rank_index(self) -> RankIndex:
        """`rank_index`, computed from `sorted_rows`."""
        bits = np.zeros(-(-self.num_rows // 64), dtype=np.uint64)
        for start in range(0, self.num_placed, RANK_BUILD_ROWS):
            rows = self.sorted_rows[start:start + RANK_BUILD_ROWS].astype(np.int64)
            words = rows >> 6
            # Rows ascend, so the bits of one word are adjacent: OR each run of them together.
            starts = np.flatnonzero(np.diff(words, prepend=-1))
            bits[words[starts]] |= np.bitwise_or.reduceat(np.uint64(1) << (rows & 63).astype(np.uint64), starts)
        rank_words = _huge_page_array((len(bits), 2), np.uint64)
        rank_words[:, 0] = bits
        rank_words[0, 1] = 0
        np.cumsum(_popcount(bits[:-1]), dtype=np.uint64, out=rank_words[1:, 1])
        sorted_slots = _huge_page_array(self.sorted_slots.shape, self.sorted_slots.dtype)
        sorted_slots[:] = self.sorted_slots
        return RankIndex(rank_words, sorted_slots)

    def rows_at(self, start: int, stop: int) -> np.ndarray:
        """Local row ids held by slots [start, stop), int64."""
        slots = np.arange(start, stop, dtype=np.int64)
        rows = np.empty(len(slots), dtype=np.int64)
        head = slots < self.num_placed
        rows[head] = self.slot_rows[slots[head]]
        # The k-th unplaced row is k plus the number of placed rows at or below it.
        rank = slots[~head] - self.num_placed
        rows[~head] = rank + np.searchsorted(self._unplaced_below, rank, side="right")
        return rows

    @functools.cached_property
    def _unplaced_below(self) -> np.ndarray:
        """For each placed row in ascending order, how many unplaced rows come before it."""
        return self.sorted_rows.astype(np.int64) - np.arange(self.num_placed)


def _huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array in private anonymous memory aligned to 2 MiB and marked for huge
    pages: numpy's own allocation of a few MB may land in the heap's 4 KiB pages (a TLB miss per
    random read; a third of the rank pass here), and Python's default anonymous mmap is shared
    memory, which the kernel backs with huge pages only where shmem_enabled allows."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not hasattr(mmap, "MAP_PRIVATE"):  # no private mappings (Windows): numpy's allocation
        return np.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    start = -np.frombuffer(memory, dtype=np.uint8, count=1).ctypes.data % HUGE_PAGE_BYTES
    return np.frombuffer(memory, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=start).reshape(shape)


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (uint8)."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(words)
    return np.unpackbits(words.view(np.uint8)).reshape(-1, 64).sum(axis=1, dtype=np.uint8)
