"""The host cache: disk-tier rows kept in RAM under a byte budget, in front of the table's read path.

The direct read path keeps nothing in memory, so a row read twice is read from the disk twice.
`HostCache` keeps rows the disk tier has read (by file slot) in anonymous memory. It caches rows,
not pages: away from the file's hot leading region a page's other rows are rarely read with the
one asked for, so a budget holds many more useful rows than pages (bench/host_cache_policy_bench.py
compares both, and the policies, on held-out real text; BENCHMARKS.md, "Host cache and read-ahead").

Layout: `ways`-way set-associative. A slot's set is a multiplicative hash of it; each entry has a
64-bit word (the slot + 1, and flags in its top byte; 0 when empty) and the row's bytes.
Eviction is a clock per set: a hit
marks its entry referenced; admission moves the set's hand past pinned entries, clears the mark of
referenced ones, and takes the first entry with neither. New rows enter unmarked, so a row read
once leaves before one read again (the scan resistance S3-FIFO gets from its small queue).
Read-ahead (runtime/readahead.py) pins the rows it reads until a lookup takes them: pinned rows
are never evicted, so rows read for a coming chunk stay until that chunk reads them.

Memory: the budget covers the rows, their words and the sets' hands (`entry_bytes` per entry, and
a byte per set); nothing else grows with it. A thread faults the whole budget in when the cache is
made (`_populate`), so the process holds its budget from then on and no request pays for it.

Exactness: every lookup and admission runs under one lock, so no entry changes while its row is
copied out; a lookup copies a row only if its tag names the slot asked for. With the compiled
helper that lock is runtime/native/hostcache.c's own mutex, not the GIL: the step service's thread
(runtime/device/steps.py), which never takes the GIL, looks rows up and admits the rows it reads
under it too, and the counts (hits, misses, pins) live beside it. The numpy fallback (no compiled
helper, hence no step service) uses a Python lock.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np

from .requests import check_slot_range

try:
    from . import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

# Entries per set: enough that a set rarely holds only pinned rows while read-ahead pins up to
# half the cache, few enough that a lookup reads one or two cache lines of tags.
WAYS = 8
# The default budget: this much, at most an eighth of the memory this process may use (the host's,
# or its memory cgroup's limit) and at most the table's disk tier (docs/RUNTIME.md, "Host cache and read-ahead").
DEFAULT_HOST_CACHE_BYTES = 1 << 30
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
# An entry's word: the slot + 1 in the low 56 bits, these flags above it, 0 when empty
# (runtime/native/hostcache.c).
_SLOT_MASK = np.uint64((1 << 56) - 1)
_REFERENCED, _PINNED = np.uint64(1 << 56), np.uint64(2 << 56)
_ONE = np.uint64(1)
# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): fault pages in without writing them.
_MADV_POPULATE_WRITE = 23
# Bytes the populating thread faults in per call: one huge page, so that it holds the process's
# memory-map lock (which other threads' mmap and munmap wait for) briefly at a time.
_POPULATE_STEP = 2 << 20


def _anonymous(size: int) -> np.ndarray:
    """`size` zero bytes of private anonymous memory, in transparent huge pages where the kernel
    gives them: a lookup's rows are spread over the whole cache, and huge pages keep its TLB misses
    few (BENCHMARKS.md, "Host cache and read-ahead")."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    return np.frombuffer(buffer, dtype=np.uint8)


def _load_madvise():
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _load_madvise()


def _populate(arrays: tuple[np.ndarray, ...]) -> None:
    """Fault the cache's memory in, off the request path (ctypes calls release the GIL): a fresh
    huge page costs its zeroing, which admission would otherwise pay for inside a request (a
    first cold request's rows land all over the cache). Where the kernel lacks
    MADV_POPULATE_WRITE, admission faults pages in as before."""
    if _MADVISE is None:
        return
    for array in arrays:
        address, size = array.ctypes.data, array.nbytes
        for offset in range(0, size, _POPULATE_STEP):
            if _MADVISE(address + offset, min(_POPULATE_STEP, size - offset), _MADV_POPULATE_WRITE) != 0:
                return


def memory_limit() -> int:
    """Bytes this process may use: the host's memory, or its memory cgroup's limit if lower."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        limit = 1 << 62
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            candidate = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        elif controllers == "":  # cgroup v2
            candidate = f"/sys/fs/cgroup{path}/memory.max"
        else:
            continue
        try:
            with open(candidate) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def default_budget(table_bytes: int) -> int:
    """The host cache's default budget for a disk tier of `table_bytes` in this process:
    DEFAULT_HOST_CACHE_BYTES, at most an eighth of `memory_limit()` and at most the table."""
    return int(min(DEFAULT_HOST_CACHE_BYTES, memory_limit() // 8, table_bytes))


class HostCache:
    """Rows of one table by file slot, within `budget_bytes` (rows, words and hands)."""

    def __init__(self, header, budget_bytes: int, ways: int = WAYS):
        if budget_bytes < 0:
            raise ValueError("the host cache's budget must be >= 0 bytes")
        self.row_bytes = header.row_bytes
        self.num_slots = header.num_rows
        self.ways = ways
        self.entry_bytes = self.row_bytes + 8
        self.sets = min(int(budget_bytes) // (self.entry_bytes * ways + 1), (1 << 32) - 1)
        self.entries = self.sets * ways
        self.budget_bytes = int(budget_bytes)
        count = max(self.entries, 1)
        self._words = _anonymous(count * 8).view(np.uint64)
        self._data = _anonymous(count * self.row_bytes)
        self._hands = _anonymous(max(self.sets, 1))
        # The thread faulting the budget in (join it to wait for it: a request admitting rows
        # meanwhile faults in the pages they land on itself); None without entries.
        self.populating: threading.Thread | None = None
        if self.entries:
            self.populating = threading.Thread(target=_populate, args=((self._words, self._data),),
                                               name="ple-prep-host-cache", daemon=True)
            self.populating.start()
        self._rows = self._data.reshape(count, self.row_bytes)
        # The compiled cache (its own lock and counts), which the step service shares; None: numpy's.
        self.handle = None if _native is None or not self.entries else \
            _native.hostcache_new(self._words, self._data, self._hands, self.ways, self.row_bytes, self.num_slots)
        self.lock = threading.Lock()
        self._pinned = 0
        self._hits = self._misses = self._dropped = self._read_ahead_hits = 0

    def counts(self) -> dict[str, int]:
        """Since the cache was made: lookups' `hits` and `misses` (the step service's included),
        `read_ahead_hits` (hits on pinned entries: rows read ahead, then asked for), entries
        `pinned` now, rows `dropped` (their set held only pinned entries)."""
        if self.handle is not None:
            values = _native.hostcache_counts(self.handle)
        else:
            values = (self._hits, self._misses, self._read_ahead_hits, self._pinned, self._dropped)
        return dict(zip(("hits", "misses", "read_ahead_hits", "pinned", "dropped"), values))

    @property
    def hits(self) -> int:
        return self.counts()["hits"]

    @property
    def misses(self) -> int:
        return self.counts()["misses"]

    @property
    def read_ahead_hits(self) -> int:
        return self.counts()["read_ahead_hits"]

    @property
    def pinned(self) -> int:
        """Entries pinned now."""
        return self.counts()["pinned"]

    @property
    def dropped(self) -> int:
        return self.counts()["dropped"]

    @property
    def bytes(self) -> int:
        """Bytes the cache holds at most (within the budget)."""
        return self.entries * self.entry_bytes + self.sets

    @property
    def enabled(self) -> bool:
        return self.entries > 0

    def lookup(self, slots: np.ndarray, out: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Copy the row of each cached slot to `out[positions[i]]` (`out[i]` without positions);
        return the indexes of the slots not cached (int64). IndexError for a slot outside the
        table, before anything is copied: a negative one would match an empty entry's word."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if self.handle is not None:
            misses = np.empty(len(slots), dtype=np.int64)
            missed, _ = _native.hostcache_lookup(self.handle, slots, out, positions, misses)
            return misses[:missed]
        check_slot_range(slots, self.num_slots)
        if not self.enabled:
            return np.arange(len(slots), dtype=np.int64)
        with self.lock:
            misses, unpinned = self._lookup(slots, out, positions)
            self._pinned -= unpinned
            self._read_ahead_hits += unpinned
            self._hits += len(slots) - len(misses)
            self._misses += len(misses)
        return misses

    def probe(self, slots: np.ndarray) -> np.ndarray:
        """Mark each cached slot referenced (read-ahead found it: it is kept a turn longer);
        return the indexes of the others."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if not self.enabled:
            return np.arange(len(slots), dtype=np.int64)
        if self.handle is not None:
            misses = np.empty(len(slots), dtype=np.int64)
            return misses[:_native.hostcache_probe(self.handle, slots, misses)]
        with self.lock:
            entries = self._find(slots)
            self._words[entries[entries >= 0]] |= _REFERENCED
            return np.flatnonzero(entries < 0)

    def admit(self, slots: np.ndarray, rows: np.ndarray, pin: bool = False) -> None:
        """Add rows (uint8 `(len(slots), row_bytes)`) for slots not cached; with `pin`, pin them
        (and those already cached) until a lookup takes them. Rows whose set is all pinned are
        not admitted (`dropped`)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if not self.enabled or not len(slots):
            return
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        if self.handle is not None:
            _native.hostcache_admit(self.handle, slots, rows, pin)
            return
        with self.lock:
            pinned, dropped = self._admit(slots, rows, pin)
            self._pinned += pinned
            self._dropped += dropped

    def unpin_all(self) -> None:
        """Release every pin (a read-ahead cancelled, or its rows never asked for)."""
        if self.handle is not None:
            _native.hostcache_reset(self.handle, False)
            return
        with self.lock:
            self._words &= ~_PINNED
            self._pinned = 0

    def clear(self) -> None:
        """Forget every row (the memory stays the cache's)."""
        if self.handle is not None:
            _native.hostcache_reset(self.handle, True)
            return
        with self.lock:
            self._words.fill(0)
            self._pinned = 0

    # --- the numpy fallback: the same results as runtime/native/hostcache.c --------------------------

    def _sets_of(self, slots: np.ndarray) -> np.ndarray:
        hashed = slots.astype(np.uint64) * _MULTIPLIER
        return (((hashed >> np.uint64(32)) * np.uint64(self.sets)) >> np.uint64(32)).astype(np.int64)

    def _find(self, slots: np.ndarray) -> np.ndarray:
        """The entry holding each slot, or -1 (for a negative slot too: slot + 1 would be an empty entry's word)."""
        first = self._sets_of(slots) * self.ways
        words = self._words[first[:, None] + np.arange(self.ways)]
        match = (words & _SLOT_MASK) == slots.astype(np.uint64)[:, None] + _ONE
        return np.where(match.any(axis=1) & (slots >= 0), first + match.argmax(axis=1), -1)

    def _lookup(self, slots: np.ndarray, out: np.ndarray, positions: np.ndarray | None) -> tuple[np.ndarray, int]:
        if positions is not None and len(positions) and (positions.min() < 0 or positions.max() >= len(out)):
            raise IndexError("lookup: a position lies outside out")
        entries = self._find(slots)
        found = np.flatnonzero(entries >= 0)
        hit = entries[found]
        out[found if positions is None else positions[found]] = self._rows[hit]
        unpinned = len(np.unique(hit[(self._words[hit] & _PINNED) != 0]))
        self._words[hit] = (self._words[hit] & _SLOT_MASK) | _REFERENCED
        return np.flatnonzero(entries < 0), unpinned

    def _admit(self, slots: np.ndarray, rows: np.ndarray, pin: bool) -> tuple[int, int]:
        if len(slots) and (slots.min() < 0 or slots.max() >= int(_SLOT_MASK)):
            raise ValueError("admit: slots must lie in [0, 2**56 - 1)")
        pinned = dropped = 0
        words, hands, ways = self._words, self._hands, self.ways
        for index, (slot, set_number) in enumerate(zip(slots.tolist(), self._sets_of(slots).tolist())):
            first = set_number * ways
            entry = int(self._find(slots[index:index + 1])[0])
            if entry >= 0:
                if pin and not words[entry] & _PINNED:
                    words[entry] |= _PINNED
                    pinned += 1
                continue
            for _ in range(2 * ways):
                candidate = first + int(hands[set_number])
                hands[set_number] = (hands[set_number] + 1) % ways
                value = words[candidate]
                if value == 0:
                    entry = candidate
                    break
                if value & _PINNED:
                    continue
                if value & _REFERENCED:
                    words[candidate] = value & ~_REFERENCED
                    continue
                entry = candidate
                break
            if entry < 0:
                dropped += 1
                continue
            words[entry] = np.uint64(slot + 1) | (_PINNED if pin else np.uint64(0))
            self._rows[entry] = rows[index]
            pinned += pin
        return pinned, dropped
