"""The disk tier read with O_DIRECT: the distinct blocks of a request at a fixed queue depth.

`DirectReader` reads with Linux native AIO on a file descriptor opened with `O_DIRECT`: one
`io_submit` puts `queue_depth` block reads in flight into an aligned anonymous buffer, and each
`io_getevents` batch has its rows copied out and its slots refilled with the next blocks, so the
disk sees `queue_depth` reads at every moment and nothing enters the page cache (docs/RUNTIME.md:
why not the mapping's buffered reads). The system calls go through `syscall(2)` with ctypes and
`struct iocb` arrays built in numpy: no compiler, no extra package.

A block is `max(page_size, 4096)` bytes, aligned to its size: O_DIRECT needs the offset, length and
buffer aligned to the device's logical block (512 or 4096 bytes), and a table page never straddles
a block (page_size is a power of two and the data region starts on a page boundary).

Where O_DIRECT or native AIO is refused, runtime/pread.py reads the same blocks with `preadv` on
threads. Both readers release the GIL around every wait on the disk, fail a request whose reads make
no progress for `timeout` seconds with `ReadTimeout`, and name the file and the cause in every error
(docs/RELIABILITY.md, "Serving under a failing disk").
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import platform
import threading
import weakref

import numpy as np

from ..core.fileio import on_block_file_system
from ..format.pages import row_offsets
from .readcheck import DEFAULT_READ_TIMEOUT, MIN_BLOCK, PageCheck, ReadTimeout, capped_depth, check_timeout, read_error

# Reads kept in flight. Deeper than fio's reference depth of 64 on purpose: completions come in
# bursts and a busy host deschedules the refilling thread for milliseconds, so the queue must hold
# that long of work; 512 was the steadiest depth (BENCHMARKS.md, "Cold rows against fio").
DEFAULT_QUEUE_DEPTH = 512
# The shared context's size (events reserved against fs.aio-max-nr) and so the deepest queue.
MAX_QUEUE_DEPTH = 1024

# io_setup, io_destroy, io_submit, io_getevents.
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_IOCB_CMD_PREAD = 0
# struct iocb and struct io_event of linux/aio_abi.h on a little-endian 64-bit host.
_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"),
                  ("reqprio", "<i2"), ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                  ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])


class DirectUnavailable(OSError):
    """This host or file system cannot serve the disk tier with O_DIRECT and native AIO."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _timespec(seconds: float) -> _Timespec:
    whole = int(seconds)
    return _Timespec(whole, int((seconds - whole) * 1e9))


def _load_syscall():
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not hasattr(os, "O_DIRECT") or _IOCB.itemsize != 64:
        return None, None
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None, None
    function.restype = ctypes.c_long
    return function, numbers


_SYSCALL, _NUMBERS = _load_syscall()


def _call(number: int, *args) -> int:
    """One system call; OSError on failure, retried when a signal interrupts it."""
    while True:
        result = _SYSCALL(ctypes.c_long(number), *args)
        if result >= 0:
            return result
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


def _destroy(handle: int, pid: int) -> None:
    if os.getpid() == pid:
        _call(_NUMBERS[1], ctypes.c_ulong(handle))


class _Context:
    """The process's one native AIO context, shared by every table's reader.

    Contexts count against the host-wide `fs.aio-max-nr` (65,536 events by default), so a context
    per table would run out with a few hundred tables open across the host's processes. A fork's
    child cannot use its parent's context (contexts belong to an address space): it makes its own.
    Requests from all tables take turns on its lock.

    A request that times out leaves reads in flight that nothing can cancel (io_cancel does not
    apply to file reads, and io_destroy would wait for them): its context and buffer are
    `abandoned`, kept alive in `_ABANDONED` so the kernel never completes a read into freed
    memory, and the next request makes a new context.
    """

    def __init__(self):
        self.pid = os.getpid()
        handle = ctypes.c_ulong(0)
        _call(_NUMBERS[0], ctypes.c_long(MAX_QUEUE_DEPTH), ctypes.byref(handle))
        self.handle = handle.value
        self.events = np.zeros(MAX_QUEUE_DEPTH, dtype=_EVENT)
        self.in_flight = 0
        self.abandoned = False
        self.lock = threading.Lock()
        weakref.finalize(self, _destroy, self.handle, self.pid)


# Contexts and buffers with reads still in flight after a timeout (see _Context).
_ABANDONED: list = []


_SHARED: _Context | None = None
_SHARED_LOCK = threading.Lock()


def _shared_context() -> _Context:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED.pid != os.getpid() or _SHARED.abandoned:
            _SHARED = _Context()
        return _SHARED


class DirectReader:
    """Rows of one table file by slot, read with O_DIRECT at `queue_depth` reads in flight.

    Raises DirectUnavailable when the file system refuses O_DIRECT (EINVAL) or the kernel refuses
    native AIO (no syscall, ENOSYS, or the host's aio-max-nr reached). One request at a time per
    process: readers share one AIO context (`_Context`) and take turns on its lock. `name` is the
    file's name in errors; a wait of `timeout` seconds with no read completing raises ReadTimeout.
    """

    kind = "direct"

    def __init__(self, path, header, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, name: str | None = None,
                 timeout: float = DEFAULT_READ_TIMEOUT, page_sums: np.ndarray | None = None):
        if _SYSCALL is None:
            raise DirectUnavailable(errno.ENOSYS, f"no native AIO on {platform.machine()} here")
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be from 1 to {MAX_QUEUE_DEPTH}")
        self.name = name or str(path)
        timeout = check_timeout(timeout)
        self.timeout = DEFAULT_READ_TIMEOUT
        self._header = header
        self._row_bytes = header.row_bytes
        self._block = max(header.page_size, MIN_BLOCK)
        self.queue_depth = capped_depth(queue_depth, header.page_size)
        self._file_end = header.data_offset + header.num_pages * header.page_size
        self._descriptor = -1
        self._buffer = None
        try:
            self._descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                raise DirectUnavailable(exc.errno, f"{self.name} refuses O_DIRECT ({exc.strerror})") from None
            raise
        try:
            self._context = _shared_context()
        except OSError as exc:
            os.close(self._descriptor)
            self._descriptor = -1
            raise DirectUnavailable(exc.errno, f"native AIO refused: {exc.strerror}") from None
        # Rows as opaque elements of a strided view of the buffer, as Gatherer does over the mapping.
        self._step = math.gcd(header.page_size, header.row_bytes)
        self._row_type = np.dtype((np.void, header.row_bytes))
        self._new_buffer()
        self.page_check = None if page_sums is None else PageCheck(page_sums, header, self._block, self.name)
        try:  # no probe where the file system's AIO is known to be asynchronous (core/fileio.py)
            self.synchronous = not on_block_file_system(self._descriptor) and self._completes_inside_submit()
        except OSError as exc:  # a file system that opens with O_DIRECT but cannot read with it
            self.close()
            raise DirectUnavailable(exc.errno or errno.EIO, f"O_DIRECT read refused: {exc.strerror}") from None
        self.timeout = timeout

    def _completes_inside_submit(self) -> bool:
        """Whether O_DIRECT reads complete inside io_submit here (FUSE, some network file systems: one at a
        time, a hung one out of the timeout's reach): two reads of the first block done as io_submit returns."""
        with self._locked_context():
            context = self._context
            self._iocbs["offset"][0] = 0
            for _ in range(2):
                self._submit(self._pointers[:1])
                got = _call(_NUMBERS[3], ctypes.c_ulong(context.handle), ctypes.c_long(0), ctypes.c_long(1),
                            ctypes.c_void_p(context.events.ctypes.data), ctypes.byref(_timespec(0)))
                context.in_flight -= got
                self._drain()
                if not got:
                    return False
            return True

    def _new_buffer(self) -> None:
        # Private anonymous memory from mmap is page aligned, as O_DIRECT needs (and, unlike
        # mmap's shared default, not shmem that a memory cgroup counts as page cache).
        self._buffer = mmap.mmap(-1, self.queue_depth * self._block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self._buffer, dtype=np.uint8, count=1).ctypes.data
        self._iocbs = np.zeros(self.queue_depth, dtype=_IOCB)
        self._iocbs["data"] = np.arange(self.queue_depth)
        self._iocbs["opcode"] = _IOCB_CMD_PREAD
        self._iocbs["fildes"] = self._descriptor
        self._iocbs["buf"] = base + np.arange(self.queue_depth, dtype=np.uint64) * self._block
        self._iocbs["nbytes"] = self._block
        self._pointers = self._iocbs.ctypes.data + np.arange(self.queue_depth, dtype=np.uint64) * _IOCB.itemsize
        self._units = np.ndarray(shape=((len(self._buffer) - self._row_bytes) // self._step + 1,),
                                 dtype=self._row_type, buffer=self._buffer, strides=(self._step,))
        self._blocks = np.frombuffer(self._buffer, dtype=np.uint8).reshape(self.queue_depth, self._block)

    def close(self) -> None:
        # After the request in flight (if any, at most a read timeout): its reads name the descriptor,
        # which another open could otherwise take over.
        held = self._context.lock.acquire(timeout=self.timeout)
        try:
            if self._descriptor >= 0:
                os.close(self._descriptor)
                self._descriptor = -1
        finally:
            if held:
                self._context.lock.release()
        self._units = None
        if self._buffer is not None:
            try:
                self._buffer.close()
            except BufferError:
                pass
            self._buffer = None

    def gather_slots(self, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill `out` (uint8 `(len(slots), row_bytes)`, C-contiguous) with the rows at `slots`."""
        if self._descriptor < 0:
            raise ValueError("the table is closed")
        if not len(slots):
            return out
        if len(slots) <= self.queue_depth:
            return self._gather_few(slots, out)
        distinct, inverse = np.unique(slots, return_inverse=True)
        offsets = row_offsets(self._header, distinct)
        blocks = offsets // self._block
        # Distinct rows are sorted, so each distinct block's rows are one run.
        starts = np.flatnonzero(np.diff(blocks, prepend=-1))
        block_rows = np.diff(np.append(starts, len(blocks)))
        # Element of `_units` for each row, counted from its block's buffer slot (slot added later).
        within = (offsets % self._block) // self._step
        rows = np.empty((len(distinct), self._row_bytes), dtype=np.uint8)
        with self._locked_context():
            self._read(blocks[starts] * self._block, starts, block_rows, within,
                       rows.view(self._row_type).reshape(-1))
        # Straight into `out`: a fancy index, or take's default mode, fills a request-sized temporary.
        np.take(rows, inverse.reshape(-1), axis=0, out=out, mode="clip")
        return out

    @contextlib.contextmanager
    def _locked_context(self):
        """The shared context, locked; a fresh one after a fork or a timeout abandoned this one."""
        while True:
            if self._context.pid != os.getpid() or self._context.abandoned:
                try:
                    self._context = _shared_context()
                except OSError as exc:
                    raise read_error(self.name, exc.errno, "no native AIO context for the read") from None
            with self._context.lock:
                if not self._context.abandoned:
                    yield
                    return

    def _gather_few(self, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """A request with no more rows than the queue is deep (a decode step): every block in one
        submission, one wait for all of them, one copy; fewer steps than `_read`'s refill loop."""
        offsets = row_offsets(self._header, slots)
        blocks = offsets // self._block
        distinct = np.unique(blocks)
        count = len(distinct)
        with self._locked_context():
            context = self._context
            self._iocbs["offset"][:count] = distinct * self._block
            try:
                self._submit(self._pointers[:count])
                done = 0
                while done < count:
                    got = self._wait(count - done, count - done, done)
                    done += got
            finally:
                self._drain()
            events = context.events[:count]
            self._check(events["res"], self._iocbs["offset"][events["data"].astype(np.int64)])
            if self.page_check is not None:
                self.page_check.check(self._blocks[:count], distinct * self._block)
            # Slot i holds distinct block i (the iocbs' order), whatever order they completed in.
            units = np.searchsorted(distinct, blocks) * (self._block // self._step) \
                + (offsets % self._block) // self._step
            out.view(self._row_type).reshape(-1)[...] = self._units[units]
        return out

    def _wait(self, least: int, most: int, first_event: int) -> int:
        """io_getevents for at least `least` completions into events[first_event:]; ReadTimeout when
        none completes within the timeout (the GIL is released meanwhile: ctypes drops it)."""
        context = self._context
        got = _call(_NUMBERS[3], ctypes.c_ulong(context.handle), ctypes.c_long(least), ctypes.c_long(most),
                    ctypes.c_void_p(context.events.ctypes.data + first_event * _EVENT.itemsize),
                    ctypes.byref(_timespec(self.timeout)))
        context.in_flight -= got
        if got == 0:
            in_flight = context.in_flight
            self._abandon()
            raise ReadTimeout(errno.ETIMEDOUT, f"{self.name}: no O_DIRECT read completed in {self.timeout:g} s "
                                               f"({in_flight} in flight): the disk stalled; this request failed "
                                               f"and the next one reads again")
        return got

    def _abandon(self) -> None:
        """Leave the context and buffer to the reads still in flight (see _Context)."""
        self._context.abandoned = True
        # (Reads in flight hold their own reference to the open file: closing the descriptor is safe.)
        _ABANDONED.append((self._context, self._buffer, self._iocbs))
        self._new_buffer()

    def _drain(self) -> None:
        """Wait for every read still in flight: the next request reuses their buffer."""
        context = self._context
        try:
            while context.in_flight > 0 and not context.abandoned:
                self._wait(1, MAX_QUEUE_DEPTH, 0)
        except ReadTimeout:
            pass  # the request fails with its own error; its reads are abandoned

    def _read(self, block_offsets: np.ndarray, starts: np.ndarray, block_rows: np.ndarray,
              within: np.ndarray, target: np.ndarray) -> None:
        """Read each block once, `queue_depth` in flight, copying its rows to `target` on arrival."""
        count = len(block_offsets)
        depth = self.queue_depth
        context = self._context
        slot_block = np.zeros(depth, dtype=np.int64)  # block index held by each buffer slot
        units_per_block = self._block // self._step
        submitted = done = 0
        free = np.arange(min(depth, count))
        try:
            while done < count:
                if len(free) and submitted < count:
                    take = free[:count - submitted]
                    fresh = np.arange(submitted, submitted + len(take))
                    self._iocbs["offset"][take] = block_offsets[fresh]
                    slot_block[take] = fresh
                    submitted += len(take)
                    self._submit(np.ascontiguousarray(self._pointers[take]))
                got = self._wait(1, depth, 0)
                events = context.events[:got]
                free = events["data"].astype(np.int64)
                finished = slot_block[free]
                self._check(events["res"], block_offsets[finished])
                if self.page_check is not None:
                    self.page_check.check(self._blocks[free], block_offsets[finished])
                lengths = block_rows[finished]
                first = starts[finished]
                # Rows of the finished blocks, in the distinct-row order: their runs concatenated.
                runs = np.repeat(first - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
                target[runs] = self._units[np.repeat(free * units_per_block, lengths) + within[runs]]
                done += got
        finally:
            self._drain()

    def _submit(self, pointers: np.ndarray) -> None:
        """Submit every iocb in `pointers`; the kernel may take fewer per call."""
        sent = 0
        while sent < len(pointers):
            try:
                taken = _call(_NUMBERS[2], ctypes.c_ulong(self._context.handle), ctypes.c_long(len(pointers) - sent),
                              ctypes.c_void_p(pointers.ctypes.data + sent * pointers.itemsize))
            except OSError as exc:
                raise read_error(self.name, exc.errno, "submitting O_DIRECT reads") from None
            self._context.in_flight += taken
            sent += taken

    def _check(self, results: np.ndarray, offsets: np.ndarray) -> None:
        """Each read must fill its block, or reach the table's end (a last block past the file's end)."""
        for index in np.flatnonzero(results < self._block).tolist():
            result, offset = int(results[index]), int(offsets[index])
            if result < 0:
                raise read_error(self.name, -result, f"O_DIRECT read of {self._block} bytes at byte {offset}")
            if offset + result < self._file_end:
                raise OSError(errno.EIO, f"{self.name}: short O_DIRECT read at byte {offset} ({result} of "
                                         f"{self._block} bytes): the file shrank or the disk failed")
