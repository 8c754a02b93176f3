"""The row order: which table row sits in which slot of the prepared file.

The first `num_placed` slots hold chosen rows (the hot ones) in the order given; every other row
follows in source order. Only the placed rows are stored, one u32 a slot (`slot_rows`, 4 bytes a
placed row; format v1 stored two more arrays derived from it, 12 bytes): a slot of an unplaced row
is num_placed + row - (placed rows below it).

A lookup must cost the same whatever the map's size (the real table places tens of millions of
rows), so lookups read a rank index built once from `slot_rows`: for each 64 rows a 16-byte pair,
their bits (placed or not) and the count of placed rows before them, so one cache line per id
(2 bits a row: 80 MB for the real table), and `packed_slots`, the slot of each placed row in row
order in just the bits the slots need (ceil(log2(placed rows)): 25 bits for 21-33M placed rows, not
32). Both lie in huge pages, so the random reads take no TLB misses. The compiled helper
(core/native/slots.c, the layout in core/native/rows.h) walks them in one loop; numpy does the same
in a dozen passes.
Building them takes two passes over `slot_rows` (no sort of it; core/native/rankindex.c, or numpy's
passes over pieces of it); a table builds them when it opens (runtime/table.py), so no request pays
for it.
"""
from __future__ import annotations

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

# Placed rows handled per step while building the index (bounds its temporaries to tens of MB).
RANK_BUILD_ROWS = 1 << 20
HUGE_PAGE_BYTES = 1 << 21


class RankIndex(NamedTuple):
    """What a lookup reads, both in huge pages (`_huge_page_array`): `rank_words`, (words, 2)
    uint64, each 64 rows' bits and the placed rows before them; and `packed_slots`, uint8, the slot
    of each placed row in ascending row order, `slot_bits` bits each, then 8 zero bytes."""

    rank_words: np.ndarray
    packed_slots: np.ndarray


NO_RANK_INDEX = RankIndex(np.zeros((0, 2), dtype=np.uint64), np.zeros(0, dtype=np.uint8))


def slot_bits(num_placed: int) -> int:
    """Bits a packed slot takes: enough for num_placed - 1, at least 1."""
    return max(1, (num_placed - 1).bit_length())


def packed_slots_bytes(num_placed: int) -> int:
    """The packed slots' bytes: whole 8-byte words, then one more (a read loads 8 bytes)."""
    return 8 * -(-num_placed * slot_bits(num_placed) // 64) + 8 if num_placed else 0


def lookup_index_bytes(num_rows: int, num_placed: int) -> int:
    """Memory a table's lookups hold for its order map (`RankIndex`): what a server spends on it."""
    return 16 * -(-num_rows // 64) + packed_slots_bytes(num_placed) if num_placed else 0


class RowOrder:
    def __init__(self, num_rows: int, slot_rows: np.ndarray, name: str = "row order"):
        self.num_rows = num_rows
        self.slot_rows = slot_rows
        self._name = name
        self._rank_words: np.ndarray | None = None
        self._rank_index: RankIndex | None = None
        # Lookups run on several threads at once (runtime/device/): one of them builds the index.
        self._rank_lock = threading.RLock()

    @property
    def num_placed(self) -> int:
        return len(self.slot_rows)

    @classmethod
    def identity(cls, num_rows: int) -> "RowOrder":
        return cls(num_rows, np.zeros(0, dtype=ORDER_DTYPE))

    @classmethod
    def from_placed(cls, placed_rows: np.ndarray, num_rows: int) -> "RowOrder":
        """Rows to put first, in slot order; they must be distinct and inside the table."""
        placed = np.asarray(placed_rows).reshape(-1)
        if len(placed) and (placed.min() < 0 or placed.max() >= num_rows):
            raise BadInput(f"placed row outside the table of {num_rows} rows")
        order = cls(num_rows, placed.astype(ORDER_DTYPE, copy=False))
        order.rank_words  # noqa: B018 (the property checks that no row is placed twice)
        return order

    def map_bytes(self) -> np.ndarray:
        """The map as format v2 stores it, as uint8 (a view of `slot_rows` where it is stored so
        already: the map may be hundreds of MB)."""
        return np.ascontiguousarray(self.slot_rows, dtype=ORDER_DTYPE).view(np.uint8)

    @classmethod
    def from_buffer(cls, buffer, num_placed: int, num_rows: int, name: str = "file",
                    version: int = 2) -> "RowOrder":
        """The map stored in a file of format `version`, over `buffer` (not copied). A v2 map is
        checked when its index is built (`rank_words`); a v1 map's three arrays are checked here."""
        slot_rows = np.frombuffer(buffer, dtype=ORDER_DTYPE, count=num_placed)
        if version == 1 and num_placed:
            sorted_rows, sorted_slots = (np.frombuffer(buffer, dtype=ORDER_DTYPE, count=num_placed,
                                                       offset=4 * i * num_placed) for i in (1, 2))
            if (sorted_rows[-1] >= num_rows or np.any(sorted_rows[1:] <= sorted_rows[:-1])
                    or sorted_slots.max() >= num_placed
                    or not np.array_equal(slot_rows[sorted_slots], sorted_rows)):
                raise BadInput(f"{name}: the row-order map is inconsistent (corrupt file)")
        return cls(num_rows, slot_rows, name)

    @classmethod
    def for_table(cls, mapping: mmap.mmap, header, name: str) -> "RowOrder":
        """The row order of an opened table file (`header` its Header), its lookup index built
        now so that no request pays for it; the map's pages are then dropped from the mapping
        (the index holds what lookups read)."""
        if not header.num_placed:
            return cls.identity(header.num_rows)
        # The map starts at order_offset, not at the file's first byte.
        order = cls.from_buffer(memoryview(mapping)[header.order_offset:header.data_offset],
                                header.num_placed, header.num_rows, name, header.version)
        order.rank_index  # noqa: B018 (the property builds it; BadInput for a corrupt map)
        if hasattr(mmap, "MADV_DONTNEED"):
            # Private and never written: dropped pages read back from the file if touched again.
            mapping.madvise(mmap.MADV_DONTNEED, 0, header.data_offset)
        return order

    # --- The lookup ------------------------------------------------------------------------------

    def slot_of(self, ids: np.ndarray, first_row: int = 0) -> np.ndarray:
        """File slot of each row id (int64, the shape of `ids`): ids are local rows plus
        `first_row` (a rank file's first row); an id outside them raises IndexError."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rank_words, packed_slots = self.rank_index
        if _native is not None:
            slots = np.empty(ids.shape, dtype=np.int64)
            _native.slot_of(ids, first_row, self.num_rows, rank_words, packed_slots, slots)
            return slots
        rows = ids - first_row
        # One pass checks both ends: seen as unsigned, a negative local id is above any row count.
        if rows.size and rows.view(np.uint64).max() >= self.num_rows:
            bad = ids[(rows < 0) | (rows >= self.num_rows)][0]
            raise IndexError(f"row id {bad} is outside this table's rows [{first_row}, {first_row + self.num_rows})")
        if not self.num_placed:
            return rows
        placed, below_row = _rank(rank_words, rows)
        slots = self.num_placed + rows - below_row
        placed_slots = _unpack(packed_slots, np.minimum(below_row, self.num_placed - 1), slot_bits(self.num_placed))
        return np.where(placed, placed_slots.view(np.int64), slots)

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

    @property
    def rank_words(self) -> np.ndarray:
        """The index's bits and counts alone (what offline tools need: no `packed_slots`); raises
        BadInput where the map places a row twice or one outside the table."""
        if self._rank_words is None:
            with self._rank_lock:
                if self._rank_words is None:
                    self._rank_words = self._build_rank_words()
        return self._rank_words

    def build_rank_index(self) -> RankIndex:
        """`rank_index`, computed from `slot_rows`: each placed row's slot goes to its rank (4 bytes
        a placed row), then the slots are packed in place and the memory past them given back, so
        opening a table holds no more than its index and one array of slots."""
        if not self.num_placed:
            return NO_RANK_INDEX
        packed_bytes = packed_slots_bytes(self.num_placed)
        area = _huge_page_array((max(4 * self.num_placed, packed_bytes),), np.uint8)
        self.chunks_by_rank(1, area[:4 * self.num_placed].view(np.uint32))
        (_native.pack_slots if _native is not None else _pack_slots)(area, self.num_placed)
        _give_back_after(area, packed_bytes)
        return RankIndex(self.rank_words, area[:packed_bytes])

    def chunks_by_rank(self, chunk_slots: int, out: np.ndarray | None = None) -> np.ndarray:
        """For each placed row, rows ascending, the chunk of `chunk_slots` slots holding it (slot //
        chunk_slots), into `out` or an array of the smallest unsigned type that holds them."""
        if out is None:
            chunks = -(-self.num_placed // chunk_slots)
            out = np.empty(self.num_placed, dtype=np.uint8 if chunks <= 1 << 8 else np.uint16 if chunks <= 1 << 16
                           else np.uint32)
        rank_words = self.rank_words
        if _native is not None:
            _native.slots_by_rank(np.ascontiguousarray(self.slot_rows), rank_words, out, chunk_slots, out.itemsize)
            return out
        for start in range(0, self.num_placed, RANK_BUILD_ROWS):
            rows = self.slot_rows[start:start + RANK_BUILD_ROWS].astype(np.int64)
            _, rank = _rank(rank_words, rows)
            out[rank] = np.arange(start, start + len(rows), dtype=np.int64) // chunk_slots
        return out

    def _build_rank_words(self) -> np.ndarray:
        if _native is not None:
            rank_words = _huge_page_array((-(-self.num_rows // 64), 2), np.uint64)
            counted = _native.rank_bits(np.ascontiguousarray(self.slot_rows), self.num_rows, rank_words)
            if counted < 0:
                raise BadInput(f"{self._name}: the row-order map places row {-1 - counted} of a "
                               f"{self.num_rows}-row table (corrupt file)")
            if counted != self.num_placed:
                raise BadInput(f"{self._name}: the row-order map places a row twice (corrupt file)")
            return rank_words
        bits = np.zeros(-(-self.num_rows // 64), dtype=np.uint64)
        for start in range(0, self.num_placed, RANK_BUILD_ROWS):
            rows = np.sort(self.slot_rows[start:start + RANK_BUILD_ROWS]).astype(np.int64)
            if rows[-1] >= self.num_rows:
                raise BadInput(f"{self._name}: the row-order map places row {rows[-1]} of a "
                               f"{self.num_rows}-row table (corrupt file)")
            words = rows >> 6
            # Rows ascend, so the bits of one word are adjacent: OR each run of them together.
            starts = np.flatnonzero(np.diff(words, prepend=-1))
            bits[words[starts]] |= np.bitwise_or.reduceat(np.uint64(1) << (rows & 63).astype(np.uint64), starts)
        rank_words = _huge_page_array((len(bits), 2), np.uint64)
        rank_words[:, 0] = bits
        rank_words[0, 1] = 0
        np.cumsum(_popcount(bits[:-1]), dtype=np.uint64, out=rank_words[1:, 1])
        if len(bits) and int(rank_words[-1, 1]) + int(_popcount(bits[-1:])[0]) != self.num_placed:
            raise BadInput(f"{self._name}: the row-order map places a row twice (corrupt file)")
        return rank_words

    # --- What the writer and verify read ---------------------------------------------------------

    def placed_mask(self, start: int, stop: int) -> np.ndarray:
        """bool per local row in [start, stop): placed or not."""
        if not self.num_placed:
            return np.zeros(stop - start, dtype=bool)
        first, last = start >> 6, -(-stop // 64)
        bits = np.ascontiguousarray(self.rank_words[first:last, 0])
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little").view(bool)
        return unpacked[start - 64 * first:stop - 64 * first]

    def rows_at(self, start: int, stop: int) -> np.ndarray:
        """Local row ids held by slots [start, stop), int64."""
        head = np.asarray(self.slot_rows[start:min(stop, self.num_placed)], dtype=np.int64)
        first = max(start, self.num_placed) - self.num_placed
        count = stop - max(start, self.num_placed)
        if count <= 0:
            return head
        if not self.num_placed:
            return np.concatenate([head, np.arange(first, first + count, dtype=np.int64)])
        # The k-th unplaced row: find the word holding it by the unplaced count before each word,
        # then take unplaced rows from there on.
        counts = self.rank_words[:, 1].astype(np.int64)
        unplaced_before = 64 * np.arange(len(counts), dtype=np.int64) - counts
        word = int(np.searchsorted(unplaced_before, first, side="right")) - 1
        tail, row = [], 64 * word
        skip, needed = first - int(unplaced_before[word]), count
        while needed:
            span = min(self.num_rows - row, 2 * (needed + skip) + 4096)
            if span <= 0:
                raise ValueError(f"slots [{start}, {stop}) are outside the table's {self.num_rows}")
            free = np.flatnonzero(~self.placed_mask(row, row + span)) + row
            taken = free[skip:skip + needed]
            skip = max(0, skip - len(free))
            tail.append(taken)
            needed -= len(taken)
            row += span
        return np.concatenate([head, *tail])

    @property
    def sorted_rows(self) -> np.ndarray:
        """The placed rows in ascending order (uint32), from the index's bits."""
        if not self.num_placed:
            return np.zeros(0, dtype=ORDER_DTYPE)
        return np.flatnonzero(self.placed_mask(0, self.num_rows)).astype(ORDER_DTYPE)

    @property
    def sorted_slots(self) -> np.ndarray:
        """The slot of each placed row, rows ascending (uint32), unpacked from the index."""
        slots = np.empty(self.num_placed, dtype=np.uint32)
        packed, bits = self.rank_index.packed_slots, slot_bits(self.num_placed)
        for start in range(0, self.num_placed, RANK_BUILD_ROWS):
            index = np.arange(start, min(start + RANK_BUILD_ROWS, self.num_placed), dtype=np.int64)
            slots[start:start + len(index)] = _unpack(packed, index, bits)
        return slots

    def drop_slots(self) -> None:
        """Free the index's `packed_slots` once an offline tool has looked up what it needed; the
        rank bits stay (the writer reads them)."""
        with self._rank_lock:
            self._rank_index = None


def _rank(rank_words: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(placed, placed rows below) for each local row (bool, int64), from the rank words."""
    words = rows >> 6
    # Each row's bit moved to the top of its word: it says whether the row is placed, and the
    # bits at and below it count the placed rows up to it.
    to_row = rank_words[words, 0]
    to_row <<= (63 - (rows & 63)).view(np.uint64)
    placed = to_row >> np.uint64(63)
    below_row = rank_words[words, 1] + _popcount(to_row)
    below_row -= placed
    return placed.view(np.int64) != 0, below_row.view(np.int64)


def _pack_slots(area: np.ndarray, count: int) -> None:
    """numpy's core/native/rankindex.c pack_slots: the `count` uint32 slots at the start of `area`
    packed there, in place, `slot_bits(count)` bits each, then zeros to `packed_slots_bytes(count)`."""
    bits = slot_bits(count)
    # Pieces of RANK_BUILD_ROWS (a power of two) values start on whole bytes, and each piece's
    # packing ends before the next piece's values begin.
    for start in range(0, count, RANK_BUILD_ROWS):
        values = area[4 * start:4 * min(start + RANK_BUILD_ROWS, count)].view(np.uint32)
        spread = (values[:, None] >> np.arange(bits, dtype=np.uint32)) & np.uint32(1)
        piece = np.packbits(spread.astype(np.uint8).reshape(-1), bitorder="little")
        area[start * bits // 8:start * bits // 8 + len(piece)] = piece
    area[-(-count * bits // 8):packed_slots_bytes(count)] = 0


def _unpack(packed: np.ndarray, index: np.ndarray, bits: int) -> np.ndarray:
    """uint64 values at `index` (int64) of `bits`-bit values packed little-endian: each read as the
    8 bytes from its first byte, as core/native/rows.h reads it (a view with a uint64 at every byte)."""
    at_every_byte = np.ndarray((len(packed) - 7,), dtype="<u8", buffer=packed, strides=(1,))
    bit = index * bits
    return (at_every_byte[bit >> 3] >> (bit & 7).view(np.uint64)) & np.uint64((1 << bits) - 1)


def _give_back_after(array: np.ndarray, keep: int) -> None:
    """Return to the system the whole pages of `array` (one of `_huge_page_array`'s) past its first
    `keep` bytes: they are never read again."""
    memory = array.base
    while memory is not None and not isinstance(memory, mmap.mmap):
        memory = memory.obj if isinstance(memory, memoryview) else getattr(memory, "base", None)
    if memory is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    offset = array.ctypes.data - np.frombuffer(memory, dtype=np.uint8, count=1).ctypes.data
    first = -(-(offset + keep) // mmap.PAGESIZE) * mmap.PAGESIZE
    if first < len(memory):
        memory.madvise(mmap.MADV_DONTNEED, first, len(memory) - first)


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
