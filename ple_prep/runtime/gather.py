"""The gather path: rows by file slot, read in address order with a bounded window of advice.

The mapping carries `MADV_RANDOM`, so a fault reads one page and nothing replaces readahead.
For a request whose pages are not in the page cache, `gather_slots` sorts the rows by address,
reads each distinct row once, and keeps `MADV_WILLNEED` on the next `window_pages` distinct pages
ahead of the copy: the kernel then has that many reads in flight (the disk's queue depth) while
the copy waits only for the page it needs. The window is bounded (pages, and bytes for hosts under
memory pressure) because pages advised far ahead are reclaimed before use there and then fault
back one page at a time. A window of 0 turns advice off.

A request whose pages are already cached (a probe of a few of its pages with mincore) skips the
sort and the advice: from memory, address order buys nothing and advice costs a system call per
page. Its rows are copied by the compiled helper (core/native/module.c: one memcpy per row, straight into
the output, without the GIL) where it was built, else by numpy's fancy index over a view holding
each row as one opaque element. Everything runs inline on the calling thread unless `threads` is
raised; docs/RUNTIME.md gives the measurements.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import math
import mmap

import numpy as np

from ..format.order import NO_RANK_INDEX
from ..format.pages import row_offsets
from .requests import DEFAULT_MAX_REQUEST_ROWS, checked_slots

try:  # built only where a C compiler was there at install (setup.py): both or neither
    from ..core import _native as _core_native
    from . import _native
except ImportError:
    _core_native = _native = None

# The window that reached the disk's random-read ceiling, and a byte cap that keeps advice from
# flooding a small page cache (docs/benchmark-history.md, "The gather path").
DEFAULT_WINDOW_PAGES = 128
DEFAULT_WINDOW_BYTES = 8 << 20
# Pages of a request checked with mincore to tell a cached request from a cold one.
PROBE_PAGES = 4
# With threads > 1, a cached gather is split into parts of at least this many rows; smaller
# requests copy inline (a thread hop costs more than it saves there).
THREAD_MIN_ROWS = 8192
# Rows a cached copy into an existing array moves per step: numpy's fancy index first writes a new
# array, and a step this size keeps that array in the CPU cache instead of faulting in a fresh
# request-sized one.
COPY_STEP_ROWS = 1024
# Distinct pages copied per step of the advice window: a quarter window keeps the disk busy
# while the copy loop stays a small share of the time.
STEPS_PER_WINDOW = 4


def _load_mincore():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    return mincore


_MINCORE = _load_mincore()


def sorted_positions(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values ascending, each one's position in `values`, whether it is the first of its value)
    for a non-empty int64 array of values >= 0: one sort of (value, position) packed in an int64,
    cheaper than an argsort."""
    count = len(values)
    shift = max(1, (count - 1).bit_length())
    keys = values << shift
    keys |= np.arange(count, dtype=np.int64)
    keys.sort()
    first = np.empty(count, dtype=bool)
    first[0] = True
    ordered = keys >> shift
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered, keys & ((1 << shift) - 1), first


def distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ascending distinct values of a non-empty int64 array of values >= 0, and each element's
    index among them."""
    ordered, positions, first = sorted_positions(values)
    rank = np.cumsum(first)
    rank -= 1
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[positions] = rank
    return ordered[first], inverse


class StageJob:
    """A stage running on a thread of the compiled helper (Gatherer.stage_when)."""

    def __init__(self, job, gatherer: "Gatherer"):
        self._job = job
        self._gatherer = gatherer

    def join(self) -> tuple[int, bool, bool]:
        """Wait for it: (number of disk positions, whether their rows were staged, whether the job
        queued their copy to the device); its error if any."""
        try:
            (disk, staged), copied = _native.stage_joined(self._job)
        except OSError as exc:
            raise OSError(exc.errno, f"{self._gatherer.name}: {exc.strerror}") from None
        return (*self._gatherer._staged(disk, staged), copied)

    def cancel(self) -> None:
        """Stop it if it has not begun (else wait for it); its buffers are free after this."""
        _native.stage_joined(self._job, True)

    def flag_checks(self) -> int:
        """How often its thread has read the flags and found them not yet holding its values: a
        read after a write shows that the thread saw that write."""
        return _native.stage_job_checks(self._job)


class Gatherer:
    """Copies rows out of one mapped data region; the Table owns one."""

    def __init__(self, mapping: mmap.mmap, header, window_pages: int = DEFAULT_WINDOW_PAGES,
                 window_bytes: int = DEFAULT_WINDOW_BYTES, direct=None, budget=None, *, name: str = "the table",
                 max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS, order=None):
        self._mapping = mapping
        # The table's row order (format/order.py), for the compiled runtime's view of it.
        self._order = order
        # The file's name in errors, and the most rows one call may ask for.
        self.name = name
        self.max_request_rows = max_request_rows
        self._header = header
        self._data_offset = header.data_offset
        self._page_size = header.page_size
        self._rows_per_page = header.rows_per_page
        self._row_bytes = header.row_bytes
        self._num_slots = header.num_rows
        # Each row as one opaque element of a 1-D view: numpy then copies a row with one memcpy
        # (faster than indexing a (page, position, byte) view). The view's stride is the
        # largest step that lands on every row start; rows are elements `unit_of(slot)`.
        step = math.gcd(header.page_size, header.row_bytes)
        self._units_per_page = header.page_size // step
        self._units_per_row = header.row_bytes // step
        data_bytes = header.num_pages * header.page_size
        self._row_type = np.dtype((np.void, header.row_bytes))
        self._units = np.ndarray(shape=((data_bytes - header.row_bytes) // step + 1,),
                                 dtype=self._row_type, buffer=mapping, offset=header.data_offset,
                                 strides=(step,))
        self._base = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
        # mincore's result byte, passed by ctypes directly (a numpy array's `.ctypes.data` costs
        # more than the system call on this hot path).
        self._probe_result = ctypes.c_ubyte()
        self.window_pages = window_pages
        self.window_bytes = window_bytes
        self.threads = 1
        # The disk tier's reader of runtime/direct.py (O_DIRECT or pread), unless the table reads
        # it through the mapping.
        self.direct = direct
        # The footprint bound of runtime/footprint.py, when the table has one.
        self.budget = budget
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_threads = 0
        # The compiled runtime's view of this table (runtime/native/view.c), built at first use.
        self._view = None

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
            self.direct = None
        # The row order's arrays are views of the mapping, which they would keep open.
        self._units = self._order = self._mapping = self._view = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool, self._pool_threads = None, 0

    @property
    def window(self) -> int:
        """Distinct pages advised ahead of the copy: the page count, capped by the byte cap."""
        if self.window_pages <= 0 or self.window_bytes <= 0:
            return 0
        return max(1, min(self.window_pages, self.window_bytes // self._page_size))

    def gather_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 `(len(slots), row_bytes)`: the rows at these file slots, in request order."""
        slots = checked_slots(slots, self._num_slots, self.max_request_rows)
        count = len(slots)
        if out is not None:
            if out.shape != (count, self._row_bytes) or out.dtype != np.uint8:
                raise ValueError(f"out must be uint8 {(count, self._row_bytes)}, not "
                                 f"{out.dtype} {out.shape}")
            if not out.flags.c_contiguous:
                out[...] = self.gather_slots(slots)
                return out
        if not count:
            return np.empty((0, self._row_bytes), dtype=np.uint8) if out is None else out
        window = self.window
        # Without the compiled copy (which turns a failed page read into an error), rows are never
        # copied through the mapping where a disk reader can read them.
        cold = self.direct is not None and _core_native is None or \
            (self.direct is not None or window) and not self.cached(slots)
        if cold and self.direct is not None:
            # Read past the mapping: nothing is left mapped, so nothing counts against the budget.
            return self.direct.gather_slots(slots, out if out is not None else
                                            np.empty((count, self._row_bytes), dtype=np.uint8))
        if self.budget is not None:
            self.budget.charge(count)
        if cold:
            if out is None:
                out = np.empty((count, self._row_bytes), dtype=np.uint8)
            self._gather_cold(slots, out, window)
            return out
        parts = min(self.threads, count // THREAD_MIN_ROWS)
        if _core_native is None and out is None and parts <= 1:
            # One copy, straight into the array returned.
            return self._units[self._units_of(slots)].view(np.uint8).reshape(count, self._row_bytes)
        if out is None:
            out = np.empty((count, self._row_bytes), dtype=np.uint8)
        if parts <= 1:
            self._copy(slots, out)
        else:
            self._copy_in_parts(slots, out, parts)
        return out

    def _copy(self, slots: np.ndarray, out: np.ndarray) -> None:
        """The rows at `slots` into `out` (C-contiguous), without the GIL where compiled; a page the
        kernel cannot read raises OSError naming the file (core/native/guard.h)."""
        if _core_native is not None:
            try:
                _core_native.copy_rows(self._mapping, slots, out, self._data_offset, self._page_size,
                                       self._rows_per_page, self._row_bytes, self._num_slots)
            except OSError as exc:
                raise OSError(exc.errno, f"{self.name}: {exc.strerror}") from None
            return
        target = self._as_rows(out)
        for start in range(0, len(slots), COPY_STEP_ROWS):
            step = slice(start, start + COPY_STEP_ROWS)
            target[step] = self._units[self._units_of(slots[step])]

    def stage(self, ids: np.ndarray, order, first_row: int, num_resident: int, slots: np.ndarray,
              index: np.ndarray, out: np.ndarray, threads: int) -> tuple[int, bool]:
        """Table.stage, with the table's row order (format/order.py) and first row. The compiled
        helper checks the buffers itself; the numpy loops check them here."""
        if _native is not None:
            try:
                return self._staged(*_native.stage(*self._stage_arguments(ids, order, first_row, num_resident, slots,
                                                                          index, out, threads)))
            except OSError as exc:
                raise OSError(exc.errno, f"{self.name}: {exc.strerror}") from None
        for name, array, dtype in (("slots", slots, np.int64), ("index", index, np.int32)):
            if array.dtype != dtype or array.shape != ids.shape or not array.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous {np.dtype(dtype)} array as long as ids")
        if out.dtype != np.uint8 or out.ndim != 2 or out.shape[1] != self._row_bytes or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8 rows of {self._row_bytes} bytes")
        slots[:] = order.slot_of(ids, first_row)
        resident = slots < num_resident
        index[resident] = slots[resident]
        positions = np.flatnonzero(~resident)
        disk = len(positions)
        # Rows are copied through the mapping only by the compiled copy, or where it is the read path.
        staged = disk == 0 or (self.direct is None or _core_native is not None) and self.cached(slots[positions])
        if disk and staged:
            first = len(out) - disk
            self._copy(slots[positions], out[first:])
            index[positions] = num_resident + first + np.arange(disk)
        return self._staged(disk, staged)

    def stage_when(self, flags: np.ndarray, ids_value: int, free_value: int, ids: np.ndarray, order,
                   first_row: int, num_resident: int, slots: np.ndarray, index: np.ndarray, out: np.ndarray,
                   threads: int, device_copy: tuple | None) -> "StageJob":
        """`stage` on a thread of the compiled helper once flags[0] == ids_value and flags[1] ==
        free_value, then the optional device copy (runtime/native/jobs.c); see Table.stage_when."""
        arguments = self._stage_arguments(ids, order, first_row, num_resident, slots, index, out, threads)
        return StageJob(_native.stage_when(flags, ids_value, free_value, device_copy, *arguments), self)

    def stage_and_launch(self, ids: np.ndarray, order, first_row: int, num_resident: int, slots: np.ndarray,
                         index: np.ndarray, out: np.ndarray, context: int, events: tuple[int, ...], graph: int,
                         stream: int) -> tuple[int, bool, bool]:
        """`stage` after CUDA events, then a CUDA graph's launch if the rows were staged (runtime/native/module.c);
        see Table.stage_and_launch."""
        arguments = self._stage_arguments(ids, order, first_row, num_resident, slots, index, out, 1)
        (disk, staged), launched = _native.stage_and_launch(context, events, graph, stream, *arguments)
        return (*self._staged(disk, staged), launched)

    def _stage_arguments(self, ids, order, first_row, num_resident, slots, index, out, threads) -> tuple:
        """The compiled helper's `stage` arguments (runtime/native/stage.c)."""
        return self.table_view(order, first_row), ids, num_resident, slots, index, out, PROBE_PAGES, threads

    def table_view(self, order=None, first_row: int | None = None):
        """The compiled runtime's TableView of this table: its mapping, geometry and rank index,
        checked once (runtime/native/view.c). `order` (format/order.py) is needed the first time
        (else the identity order)."""
        if self._view is None:
            if self._mapping is None:
                raise ValueError("the table is closed")
            rank_words, packed_slots = order.rank_index if order is not None else NO_RANK_INDEX
            self._view = _native.TableView(self._mapping, rank_words, packed_slots,
                                           self._header.first_row if first_row is None else first_row,
                                           self._num_slots if order is None else order.num_rows, self._data_offset,
                                           self._page_size, self._rows_per_page, self._row_bytes, self._num_slots)
        return self._view

    def _staged(self, disk: int, staged: bool) -> tuple[int, bool]:
        """A stage's outcome, its copies through the mapping counted against the footprint budget."""
        if disk and staged and self.budget is not None:
            self.budget.charge(disk)
        return disk, staged

    def _copy_in_parts(self, slots: np.ndarray, out: np.ndarray, parts: int) -> None:
        """Copy cached rows on `parts` threads (the helper and numpy's copy release the GIL)."""
        if self._pool_threads < parts:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads)
            self._pool_threads = self.threads
        bounds = [len(slots) * part // parts for part in range(parts + 1)]

        def copy(part: int) -> None:
            low, high = bounds[part], bounds[part + 1]
            self._copy(slots[low:high], out[low:high])

        list(self._pool.map(copy, range(parts)))

    def _units_of(self, slots: np.ndarray) -> np.ndarray:
        """Element of `_units` holding each slot's row (in place, few temporaries: hot path)."""
        pages = slots // self._rows_per_page
        units = slots * self._units_per_row
        pages *= self._units_per_page - self._rows_per_page * self._units_per_row
        units += pages
        return units

    def _as_rows(self, out: np.ndarray) -> np.ndarray:
        """`out` (C-contiguous) seen as one opaque element per row: the copies' target."""
        return out.view(self._row_type).reshape(len(out))

    def _gather_cold(self, slots: np.ndarray, out: np.ndarray, window: int) -> None:
        count = len(slots)
        sorted_slots, requests, first = sorted_positions(slots)
        distinct_starts = np.append(np.flatnonzero(first), count)  # sorted index of each distinct row
        ranks = np.cumsum(first) - 1                                # distinct row of each sorted entry
        distinct_slots = sorted_slots[first]
        row_pages = distinct_slots // self._rows_per_page
        page_starts = np.append(np.flatnonzero(np.diff(row_pages, prepend=-1)), len(row_pages))
        distinct_pages = row_pages[page_starts[:-1]]
        num_pages = len(distinct_pages)
        step = max(1, window // STEPS_PER_WINDOW)
        target = self._as_rows(out)
        advised = 0
        for page in range(0, num_pages, step):
            ahead = min(num_pages, page + window)
            if advised < ahead:
                self._advise(distinct_pages[advised:ahead])
                advised = ahead
            low, high = page_starts[page], page_starts[min(page + step, num_pages)]
            rows = self._rows_at(distinct_slots[low:high])
            begin, end = distinct_starts[low], distinct_starts[high]
            target[requests[begin:end]] = rows[ranks[begin:end] - low]

    def _rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows at `slots`, one opaque element each: through the compiled copy where it was
        built (the page faults of a cold read then wait without the GIL, and a failed one raises)."""
        if _core_native is None:
            return self._units[self._units_of(slots)]
        rows = np.empty((len(slots), self._row_bytes), dtype=np.uint8)
        self._copy(slots, rows)
        return self._as_rows(rows)

    def cached(self, slots: np.ndarray) -> bool:
        """Whether the memory pages of a few rows spread over the request are all in the page cache."""
        if _native is not None:
            return _native.cached(self.table_view(self._order), slots, PROBE_PAGES)
        if _MINCORE is None:
            return False
        last = len(slots) - 1
        offsets = row_offsets(self._header, slots[[last * k // (PROBE_PAGES - 1) for k in range(PROBE_PAGES)]])
        result = ctypes.byref(self._probe_result)
        for offset in set((offsets - offsets % mmap.PAGESIZE).tolist()):
            # One memory page (the one holding the row's first byte): one result byte.
            if _MINCORE(self._base + offset, 1, result) != 0 or not self._probe_result.value & 1:
                return False
        return True

    def _span(self, page: int, count: int) -> tuple[int, int]:
        """Byte range of `count` table pages from `page`, widened to whole system pages."""
        start = self._data_offset + page * self._page_size
        aligned = start - start % mmap.PAGESIZE
        return aligned, start + count * self._page_size - aligned

    def _advise(self, pages: np.ndarray) -> None:
        # Consecutive pages share one call.
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        starts = np.concatenate([[0], breaks]).tolist()
        ends = np.concatenate([breaks, [len(pages)]]).tolist()
        first_pages = pages[starts].tolist()
        for page, start, end in zip(first_pages, starts, ends):
            offset, length = self._span(page, end - start)
            self._mapping.madvise(mmap.MADV_WILLNEED, offset, length)
