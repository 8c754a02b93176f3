"""The disk tier behind the host cache, and whole-request read-ahead into that cache.

`CachedDiskTier.gather_slots` is what a Table's reads go through when it has a host cache
(runtime/hostcache.py): cached rows are copied from the cache, the others read through the table's
read path (one demand read at a time: `read_lock`) and admitted.

`read_ahead` takes the rows of a request's coming chunks (a prompt's, known when it is scheduled)
and plans their reads at once (runtime/readplan.py's `ReadAhead`: each block read once, with the
first chunk that needs any of its rows, chunk by chunk in order). A thread reads the plan into the
cache.
With the compiled helper on the direct read path it reads on a reader of its own
(runtime/native/readahead.c), the queue kept full from the first read to the last and each block's
rows admitted as it lands, without the GIL: reading the plan in batches through the table's reader,
with Python work between them, left the disk idle for part of the time (BENCHMARKS.md, "Host cache
and read-ahead"); with open_table's `verify_reads` it checks each block against the page sums as it
lands, admitting none of a block that differs. Elsewhere (no compiled helper, the pread or mapped
path) it reads the plan in batches of BATCH_ROWS through the table's read path.

Rows it reads stay pinned until a lookup takes them, so nothing evicts the rows a coming chunk
needs; it pins at most PIN_FRACTION of the cache, and waits for lookups to take pinned rows before
reading further ahead.

Demand reads go first. A lookup whose missing rows the compiled read-ahead is about to read (all in
the chunk it reads now or the next, none passed over) waits for it to pass them: the same blocks
read, with the disk's queue left full. Any other lookup that misses stops the read-ahead queueing
more reads (the compiled one at once, its reads in flight landing; the batched one after its batch),
reads its rows with the plan's coming rows on the same blocks (pinned for their chunks), and the
read-ahead then goes on.

Pins that no lookup has taken (a request cancelled, or its rows served from another path) are
released by `ReadAhead.cancel`, and by the read-ahead thread itself once no lookup has taken a pin
for STALE_SECONDS while it waits or when it has nothing left to read. Lookups are the cache's:
this tier's gathers and the step service's (runtime/device/steps.py), whose thread looks rows up
and admits what it reads in C without the GIL; the cache's `read_ahead_hits` count says a pin was
taken, whoever took it.
"""
from __future__ import annotations

import collections
import errno
import fcntl
import os
import threading
import time

import numpy as np

from .hostcache import HostCache
from .readcheck import MIN_BLOCK, ReadTimeout, bad_sum_error, read_error
from .readplan import ReadAhead

try:
    from . import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

# Rows per read of the batched read-ahead: each a full-depth batch for the direct read path, and
# short enough (tens of milliseconds) that a demand read waiting behind one is not held long.
# Also how many pins must be free before a read-ahead held at its pin limit goes on.
BATCH_ROWS = 8192
# Share of the cache's entries read-ahead may hold pinned at once; the rest serves reuse.
PIN_FRACTION = 0.5
# Pins no lookup has taken for this long are released: their request is gone.
STALE_SECONDS = 2.0
# Why a fill returned (runtime/native/disk_reads.h's FILL_ values): its rows handled, or the next
# read would pass the pin limit.
_FILL_DONE, _FILL_PINS = 0, 2
# disk_reads.h's errors besides errnos: a read that ended inside the table, a disk that stalled, a page
# whose sum differs.
_SHORT_READ, _STALLED, _BAD_SUM = -1, -2, -3


class CachedDiskTier:
    """A table's disk reads (`reader.gather_slots`) behind a host cache, with read-ahead."""

    def __init__(self, reader, cache: HostCache, rows_per_page: int):
        self.reader = reader
        self.cache = cache
        self.rows_per_page = rows_per_page
        header = reader._header
        self._data_offset, self._page_size = header.data_offset, header.page_size
        self._block = max(header.page_size, MIN_BLOCK)
        self.read_lock = threading.Lock()
        # Demand reads go first: the read-ahead thread takes `read_lock` only while none waits.
        self._demand = threading.Condition()
        self._demand_waiting = 0
        self.rows_read = self.pages_read = 0   # distinct rows and pages of demand reads, summed
        self.ahead_rows_read = 0               # by read-ahead
        self._queue: collections.deque[ReadAhead] = collections.deque()
        self._wake = threading.Condition()
        self._taken = threading.Event()        # a lookup took pinned rows
        self._thread: threading.Thread | None = None
        self._serving: ReadAhead | None = None  # the job the thread reads now
        self._compiled = None                  # read-ahead's own reader (runtime/native/readahead.c)
        self._compiled_tried = False
        self._closed = False

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for job in self._queue:
                job._cancelled = True
            if self._compiled is not None:
                _native.readahead_stop(self._compiled)
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._compiled = None  # its descriptor and AIO context go with it

    def stats(self) -> dict[str, int | float]:
        """Counts since open: rows looked up in the cache (`host_cache_hits` + `host_cache_misses`),
        rows and pages demand reads took from the disk, rows read ahead, and `read_ahead_coverage`,
        the share of rows looked up that read-ahead had brought."""
        cache = self.cache.counts()  # one consistent reading
        looked_up = cache["hits"] + cache["misses"]
        return {"host_cache_hits": cache["hits"], "host_cache_misses": cache["misses"],
                "disk_rows_read": self.rows_read, "disk_pages_read": self.pages_read,
                "read_ahead_rows_read": self.ahead_rows_read, "read_ahead_hits": cache["read_ahead_hits"],
                "host_cache_pinned": cache["pinned"],
                "read_ahead_coverage": cache["read_ahead_hits"] / looked_up if looked_up else 0.0}

    def _block_of(self, slots: np.ndarray) -> np.ndarray:
        return (self._data_offset + slots // self.rows_per_page * self._page_size) // self._block

    def gather_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 `(len(slots), row_bytes)`: the rows at these file slots, in request order; IndexError
        for a slot outside the table."""
        slots = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        count, row_bytes = len(slots), self.cache.row_bytes
        if out is None:
            out = np.empty((count, row_bytes), dtype=np.uint8)
        elif out.shape != (count, row_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            if out.shape == (count, row_bytes) and out.dtype == np.uint8:
                out[...] = self.gather_slots(slots)
                return out
            raise ValueError(f"out must be uint8 {(count, row_bytes)}, not {out.dtype} {out.shape}")
        pinned = self.cache.pinned
        missed = self.cache.lookup(slots, out)
        if self.cache.pinned < pinned:
            self._taken.set()
        if len(missed) and self._waited_for_read_ahead(slots[missed]):
            missed = missed[self.cache.lookup(slots[missed], out, missed)]
            self._taken.set()
        if not len(missed):
            return out
        compiled = self._compiled
        with self._demand:
            self._demand_waiting += 1
        if compiled is not None:
            _native.readahead_hold(compiled, 1)  # the compiled read-ahead queues no more reads
        try:
            self.read_lock.acquire()
        finally:
            if compiled is not None:
                _native.readahead_hold(compiled, -1)
            with self._demand:
                self._demand_waiting -= 1
                self._demand.notify_all()
        try:
            # A read-ahead this waited for may have brought some of them.
            missed = missed[self.cache.lookup(slots[missed], out, missed)]
            self._taken.set()
            if len(missed):
                self._read_missed(slots, missed, out)
        finally:
            self.read_lock.release()
        return out

    def _read_missed(self, slots: np.ndarray, missed: np.ndarray, out: np.ndarray) -> None:
        """A demand read (`read_lock` held): the rows at slots[missed] read into out[missed] and
        admitted, with the read-ahead's coming rows on their blocks (pinned for their chunks)."""
        row_bytes = self.cache.row_bytes
        missed_slots = slots[missed]
        job = self._serving
        extra = np.zeros(0, dtype=np.int64)
        if job is not None:
            extra = job.coming_rows_on_blocks_of(missed_slots, self._progress(job))
            extra = extra[self.cache.probe(extra)]
        if len(extra):
            both = np.concatenate([missed_slots, extra])
            rows = self.reader.gather_slots(both, np.empty((len(both), row_bytes), dtype=np.uint8))
            self.cache.admit(missed_slots, rows[:len(missed)])
            self.cache.admit(extra, rows[len(missed):], pin=True)
            self.ahead_rows_read += len(extra)
            out[missed] = rows[:len(missed)]
        elif len(missed) == len(slots):
            self.reader.gather_slots(slots, out)
            self.cache.admit(slots, out)
        else:
            rows = self.reader.gather_slots(missed_slots, np.empty((len(missed), row_bytes), dtype=np.uint8))
            self.cache.admit(missed_slots, rows)
            out[missed] = rows
        distinct = np.unique(missed_slots)
        pages = distinct // self.rows_per_page
        self.rows_read += len(distinct)
        self.pages_read += 1 + int(np.count_nonzero(pages[1:] != pages[:-1]))

    def _progress(self, job: ReadAhead) -> int:
        """Rows of the job's plan handled: the compiled reader's count is ahead of the job's own
        while it reads."""
        if self._compiled is not None:
            serial, done, _ = _native.readahead_progress(self._compiled)
            if serial == job.serial:
                return max(done, job.done_rows)
        return job.done_rows

    def _waited_for_read_ahead(self, missed_slots: np.ndarray) -> bool:
        """Whether the compiled read-ahead was about to read every one of these rows (none past the
        chunk after the one it reads now) and this thread waited for it to pass them, or for it to
        stop (its pauses for demand reads waited through: this thread, reading again at once after
        one, would otherwise find it paused every time). Rows it passed meanwhile are in the cache."""
        job, compiled = self._serving, self._compiled
        if job is None or compiled is None:
            return False
        serial, done, _ = _native.readahead_progress(compiled)
        where = job.positions(missed_slots) if serial == job.serial else None
        if where is None:
            return False
        reading = int(np.searchsorted(job.group_ends, done, side="right"))  # the chunk it reads now
        if reading < len(job.group_ends) and where.max() >= job.group_ends[min(reading + 1, len(job.group_ends) - 1)]:
            return False
        _native.readahead_wait(compiled, job.serial, int(where.max()))
        return True

    def read_ahead(self, chunks: list[np.ndarray]) -> ReadAhead:
        """Queue a request's chunks (file slots each) for reading into the cache; returns at once."""
        job = ReadAhead(chunks, self._block_of)
        job._tier = self
        with self._wake:
            if self._closed:
                raise ValueError("the table is closed")
            if not self._compiled_tried:
                self._compiled_tried = True
                self._compiled = self._open_compiled()
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ple-prep-read-ahead", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    def _open_compiled(self):
        """Read-ahead's own reader (runtime/native/readahead.c) on a duplicate of the direct
        reader's O_DIRECT descriptor, checking the page sums the direct reader checks; None without
        the compiled cache, off the direct path, or where the kernel refuses the reader its AIO
        context."""
        direct = getattr(self.reader, "direct", None)
        if _native is None or self.cache.handle is None or getattr(direct, "kind", None) != "direct":
            return None
        header = self.reader._header
        descriptor = fcntl.fcntl(direct._descriptor, fcntl.F_DUPFD_CLOEXEC, 0)
        try:
            return _native.readahead_new(descriptor, header.data_offset,
                                         header.data_offset + header.num_pages * header.page_size, header.page_size,
                                         header.rows_per_page, header.row_bytes, header.num_rows, direct.queue_depth,
                                         direct.timeout, direct.synchronous, self.cache.handle,
                                         None if direct.page_check is None else direct.page_check.sums)
        except OSError:
            os.close(descriptor)
            return None
        except BaseException:
            os.close(descriptor)
            raise

    def cancelled(self, job: ReadAhead) -> None:
        with self._wake:
            if job in self._queue and job is not self._queue[0]:
                self._queue.remove(job)
                job._done.set()
            elif self._compiled is not None:
                _native.readahead_stop(self._compiled)
            self._wake.notify_all()
        # Pins carry no owner: release all; other requests' rows stay cached, unpinned.
        self.cache.unpin_all()

    # --- the read-ahead thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    taken = self.cache.read_ahead_hits
                    if not self._wake.wait(STALE_SECONDS) and self.cache.pinned and not self._queue \
                            and self.cache.read_ahead_hits == taken:
                        self.cache.unpin_all()  # nothing has asked for them since: stale
                if self._closed:
                    return
                job = self._queue[0]
            self._serving = job
            self._served(job)
            try:
                self._serve(job)
            except BaseException as error:  # noqa: BLE001 (kept for the caller: ReadAhead.error)
                job.error = error
            finally:
                self._serving = None
                self._served(None)
            if job._cancelled:  # rows that landed after cancel released the pins
                self.cache.unpin_all()
            with self._wake:
                if self._queue and self._queue[0] is job:
                    self._queue.popleft()
            job._done.set()

    def _served(self, job: ReadAhead | None) -> None:
        """Tell the compiled reader which request's lookups may wait for its reads (None: none)."""
        if self._compiled is not None:
            _native.readahead_serve(self._compiled, 0 if job is None else job.serial,
                                    0 if job is None else job.done_rows)

    def _serve(self, job: ReadAhead) -> None:
        limit = int(self.cache.entries * PIN_FRACTION)
        resume = max(1, min(BATCH_ROWS, limit))
        while job.done_rows < len(job.slots):
            with self._demand:
                while self._demand_waiting:
                    self._demand.wait()
            stops = _native.readahead_progress(self._compiled)[2] if self._compiled is not None else 0
            if job._cancelled or self._closed:
                return
            with self.read_lock:
                reason = self._fill(job, limit, stops) if self._compiled is not None else self._read_batch(job, limit)
            if reason == _FILL_PINS:
                self._served(None)  # a lookup waiting for its rows reads them itself meanwhile
                if not self._room(job, resume, limit):
                    return
                self._served(job)

    def _fill(self, job: ReadAhead, limit: int, stops: int) -> int:
        """The plan from where it stands read by the compiled reader until it is done, stopped
        (a demand read waits, a cancel) or at the pin limit: that reason."""
        done, read, found, pages, reason, error, failed_at = _native.readahead_fill(
            self._compiled, job.serial, job.slots, job.done_rows, limit, stops)
        job.rows_read += read
        job.rows_found += found
        job.pages_read += pages
        self.ahead_rows_read += read
        job._advance(done)
        if error == _STALLED:
            raise ReadTimeout(errno.ETIMEDOUT, f"{self.reader.name}: no read-ahead read completed in "
                                               f"{self.reader.direct.timeout:g} s (waiting for byte {failed_at}): "
                                               f"the disk stalled")
        if error == _SHORT_READ:
            raise OSError(errno.EIO, f"{self.reader.name}: short O_DIRECT read at byte {failed_at}: the file shrank "
                                     f"or the disk failed")
        if error == _BAD_SUM:
            raise bad_sum_error(self.reader.name, failed_at)
        if error:
            raise read_error(self.reader.name, error, f"O_DIRECT read-ahead read at byte {failed_at}")
        return reason

    def _read_batch(self, job: ReadAhead, limit: int) -> int:
        """The plan's next rows (at most BATCH_ROWS, within the pin limit) through the table's read
        path: _FILL_DONE, or _FILL_PINS where no row fits."""
        pinned = self.cache.pinned
        size = min(BATCH_ROWS, limit - pinned) if pinned else max(1, min(BATCH_ROWS, limit))
        if size <= 0:
            return _FILL_PINS
        batch = job.slots[job.done_rows:job.done_rows + size]
        missing = batch[self.cache.probe(batch)]
        job.rows_found += len(batch) - len(missing)
        if len(missing):
            rows = self.reader.gather_slots(missing, np.empty((len(missing), self.cache.row_bytes), np.uint8))
            self.cache.admit(missing, rows, pin=True)
            pages = np.unique(missing // self.rows_per_page)
            job.rows_read += len(missing)
            job.pages_read += len(pages)
            self.ahead_rows_read += len(missing)
        job._advance(job.done_rows + len(batch))
        return _FILL_DONE

    def _room(self, job: ReadAhead, rows: int, limit: int) -> bool:
        """Wait until `rows` more pins fit under `limit`; False if the job was cancelled."""
        waited_since = time.monotonic()
        taken = self.cache.read_ahead_hits
        while self.cache.pinned + rows > limit and self.cache.pinned:
            if job._cancelled or self._closed:
                return False
            if self._taken.wait(0.05):  # this tier's gathers wake it at once; the step service's are polled
                self._taken.clear()
            now = self.cache.read_ahead_hits
            if now != taken:
                taken, waited_since = now, time.monotonic()
            elif time.monotonic() - waited_since > STALE_SECONDS:
                self.cache.unpin_all()
        return not (job._cancelled or self._closed)
