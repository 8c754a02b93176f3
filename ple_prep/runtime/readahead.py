"""The disk tier behind the host cache, and whole-request read-ahead into that cache.

`CachedDiskTier.gather_slots` is what a Table's reads go through when it has a host cache
(runtime/hostcache.py): cached rows are copied from the cache, the others read through the table's
read path (one request at a time: `read_lock`) and admitted. `read_ahead` takes the rows of a
request's coming chunks (a prompt's, known when it is scheduled) and reads them into the cache on
a thread, chunk by chunk in order, each chunk's distinct missing rows in file order in batches of
BATCH_ROWS through the same read path (its full queue depth); the later chunks' rows on the pages a
batch (or a demand read) reads are read with it: each page once. Rows it reads stay pinned until a
lookup takes them, so nothing evicts the rows a coming chunk needs; it pins at most PIN_FRACTION
of the cache, and waits for lookups to take pinned rows before reading further ahead. A demand
read goes first: it waits for at most the batch in flight, then looks again (the batch may have
brought its rows), and the read-ahead thread starts no batch while a demand read waits.

Pins that no lookup has taken (a request cancelled, or its rows served from another path) are
released by `ReadAhead.cancel`, and by the read-ahead thread itself once no lookup has taken a pin
for STALE_SECONDS while it waits or when it has nothing left to read. Lookups are the cache's:
this tier's gathers and the step service's (runtime/device/steps.py), whose thread looks rows up
and admits what it reads in C without the GIL; the cache's `read_ahead_hits` count says a pin was
taken, whoever took it.
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from .hostcache import HostCache

# Rows per read of the read-ahead thread: each a full-depth batch for the direct read path, and
# short enough (tens of milliseconds) that a demand read waiting behind one is not held long.
BATCH_ROWS = 8192
# Share of the cache's entries read-ahead may hold pinned at once; the rest serves reuse.
PIN_FRACTION = 0.5
# Pins no lookup has taken for this long are released: their request is gone.
STALE_SECONDS = 2.0


class ReadAhead:
    """One request's read-ahead: `chunks` (arrays of file slots) in the order they will be read."""

    def __init__(self, chunks: list[np.ndarray]):
        self.chunks = chunks
        self.chunks_done = 0      # chunks whose rows have all been read or found cached
        self.rows_read = 0        # rows this read-ahead read from the disk
        self.rows_found = 0       # rows it found cached already
        self.pages_read = 0       # pages those reads took
        self.error: BaseException | None = None
        # While it is read (under the tier's read_lock): the chunks' rows not read yet, and the
        # chunk being read.
        self.later: list[np.ndarray] | None = None
        self.position = 0
        self._cancelled = False
        self._done = threading.Event()
        self._tier: CachedDiskTier | None = None

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


class CachedDiskTier:
    """A table's disk reads (`reader.gather_slots`) behind a host cache, with read-ahead."""

    def __init__(self, reader, cache: HostCache, rows_per_page: int):
        self.reader = reader
        self.cache = cache
        self.rows_per_page = rows_per_page
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
        self._closed = False

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for job in self._queue:
                job._cancelled = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

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

    def gather_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 `(len(slots), row_bytes)`: the rows at these file slots, in request order."""
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
        if not len(missed):
            return out
        with self._demand:
            self._demand_waiting += 1
        try:
            self.read_lock.acquire()
        finally:
            with self._demand:
                self._demand_waiting -= 1
                self._demand.notify_all()
        try:
            # A read-ahead batch this waited for may have brought some of them.
            missed = missed[self.cache.lookup(slots[missed], out, missed)]
            self._taken.set()
            # A read-ahead's coming rows on the pages read now come with them (pinned for their chunk).
            extra = self._later_rows_on_pages_of(slots[missed]) if len(missed) else np.zeros(0, np.int64)
            if len(extra):
                extra = extra[self.cache.probe(extra)]
            if len(extra):
                missed_slots = slots[missed]
                both = np.concatenate([missed_slots, extra])
                rows = self.reader.gather_slots(both, np.empty((len(both), row_bytes), dtype=np.uint8))
                self.cache.admit(missed_slots, rows[:len(missed)])
                self.cache.admit(extra, rows[len(missed):], pin=True)
                self.ahead_rows_read += len(extra)
                out[missed] = rows[:len(missed)]
            elif len(missed) == count:
                self.reader.gather_slots(slots, out)
                self.cache.admit(slots, out)
                missed_slots = slots
            elif len(missed):
                missed_slots = slots[missed]
                rows = self.reader.gather_slots(missed_slots, np.empty((len(missed), row_bytes), dtype=np.uint8))
                self.cache.admit(missed_slots, rows)
                out[missed] = rows
            else:
                return out
            distinct = np.unique(missed_slots)
            pages = distinct // self.rows_per_page
            self.rows_read += len(distinct)
            self.pages_read += 1 + int(np.count_nonzero(pages[1:] != pages[:-1]))
        finally:
            self.read_lock.release()
        return out

    def read_ahead(self, chunks: list[np.ndarray]) -> ReadAhead:
        """Queue a request's chunks (file slots each) for reading into the cache; returns at once."""
        job = ReadAhead([np.unique(np.asarray(chunk, dtype=np.int64)) for chunk in chunks])
        job._tier = self
        with self._wake:
            if self._closed:
                raise ValueError("the table is closed")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ple-prep-read-ahead", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    def cancelled(self, job: ReadAhead) -> None:
        with self._wake:
            if job in self._queue and job is not self._queue[0]:
                self._queue.remove(job)
                job._done.set()
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
            try:
                self._serve(job)
            except BaseException as error:  # noqa: BLE001 (kept for the caller: ReadAhead.error)
                job.error = error
            with self._wake:
                if self._queue and self._queue[0] is job:
                    self._queue.popleft()
            job._done.set()

    def _serve(self, job: ReadAhead) -> None:
        limit = int(self.cache.entries * PIN_FRACTION)
        later = job.later = list(job.chunks)
        for index in range(len(later)):
            job.position = index
            chunk = later[index]
            for start in range(0, len(chunk), BATCH_ROWS):
                batch = chunk[start:start + BATCH_ROWS]
                if not self._room(job, len(batch), limit):
                    return
                with self._demand:
                    while self._demand_waiting:
                        self._demand.wait()
                with self.read_lock:
                    missing = batch[self.cache.probe(batch)]
                    job.rows_found += len(batch) - len(missing)
                    if not len(missing):
                        continue
                    extra = self._later_rows_on_pages_of(missing)
                    if len(extra):
                        missing = np.unique(np.concatenate([missing, extra]))
                    rows = self.reader.gather_slots(missing, np.empty((len(missing), self.cache.row_bytes), np.uint8))
                    self.cache.admit(missing, rows, pin=True)
                    pages = missing // self.rows_per_page  # sorted
                    job.rows_read += len(missing)
                    job.pages_read += 1 + int(np.count_nonzero(pages[1:] != pages[:-1]))
                    self.ahead_rows_read += len(missing)
            job.chunks_done += 1

    def _later_rows_on_pages_of(self, slots: np.ndarray) -> np.ndarray:
        """The rows of the read-ahead's coming chunks (after the one it reads) on the pages of
        `slots`, taken out of those chunks: read with `slots`, each page is read once. Called with
        `read_lock` held (which guards the chunks)."""
        job = self._queue[0] if self._queue else None
        later = getattr(job, "later", None)
        if later is None or not len(slots):
            return np.zeros(0, dtype=np.int64)
        pages = np.unique(slots // self.rows_per_page)
        extra = []
        for following in range(job.position + 1, len(later)):
            on_pages = np.isin(later[following] // self.rows_per_page, pages)
            if on_pages.any():
                extra.append(later[following][on_pages])
                later[following] = later[following][~on_pages]
        return np.concatenate(extra) if extra else np.zeros(0, dtype=np.int64)

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
