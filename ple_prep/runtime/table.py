"""Open a prepared table: validate it against its manifest, map it, and hand out rows."""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..core.constants import HEADER_SIZE
from ..core.errors import BadInput
from ..core.fileio import open_regular
from ..format.header import Header, header_region_crc
from ..format.manifest import check_spec_digest, load_table_manifest, manifest_path
from ..format.order import RowOrder
from ..format.pagesums import load_page_sums
from . import gather
from .compiled import warn_once_if_missing
from .dequant import decode
from .direct import DEFAULT_QUEUE_DEPTH, DirectReader
from .diskreader import open_disk_reader
from .footprint import MappedBudget
from .gather import DEFAULT_WINDOW_BYTES, DEFAULT_WINDOW_PAGES, Gatherer
from .hostcache import HostCache, default_budget
from .readahead import CachedDiskTier, ReadAhead
from .readcheck import DEFAULT_READ_TIMEOUT
from .requests import DEFAULT_MAX_REQUEST_ROWS, check_request, checked_slots
from .tiers import Lookup, Resident, load_resident, merge, split
from .watch import FileWatch

# Header fields that must agree with the manifest's, or the pair does not belong together.
_MATCHED_FIELDS = ("page_size", "row_bytes", "rows_per_page", "values_per_row", "num_rows",
                   "first_row", "data_offset", "file_size")
# How uncached rows are read: "direct" (O_DIRECT and native AIO, runtime/direct.py), "pread"
# (buffered preadv on threads, runtime/pread.py) or "mapped" (page faults behind MADV_WILLNEED,
# runtime/gather.py): BENCHMARKS.md, "Cold rows against fio"; what each does when the disk fails:
# docs/RELIABILITY.md, section 10.
READ_PATHS = ("direct", "pread", "mapped")
VALUES_STEP_ROWS = 1024  # the smallest step of `values`' decode: below it, fixed costs outweigh memory saved
DEFAULT_READ_PATH = "direct"


class Table:
    """A prepared PLE table mapped copy-on-write; ids are the model's global row ids."""

    def __init__(self, path: Path, manifest: dict[str, Any], header: Header, mapping: mmap.mmap,
                 watch: FileWatch, window_pages: int = DEFAULT_WINDOW_PAGES,
                 window_bytes: int = DEFAULT_WINDOW_BYTES, direct: DirectReader | None = None,
                 read_path_note: str | None = None, budget: MappedBudget | None = None,
                 host_cache_bytes: int = 0, max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS):
        self.path = path
        self._watch = watch
        # The file validated at open: later reads (resident tier, another mapping) go through it,
        # so a table renamed over `path` meanwhile never mixes its rows with this one's.
        self.descriptor = watch.descriptor
        self.manifest = manifest
        self.header = header
        self._mapping = mapping
        self.num_rows = header.num_rows
        self.first_row = header.first_row
        self.row_bytes = header.row_bytes
        self.values_per_row = header.values_per_row
        self.page_size = header.page_size
        self.rows_per_page = header.rows_per_page
        self.encoding = header.encoding.label
        scale = manifest["scale"]
        # The value its exact bytes give: loading the manifest checked that `value` is exactly that
        # (format/manifest.py, scale_value).
        self.scale: float | None = None if scale is None else float(scale["value"])
        self.order = RowOrder.for_table(mapping, header, path.name)
        self._gatherer = Gatherer(mapping, header, window_pages, window_bytes, direct, budget, name=str(path),
                                  max_request_rows=max_request_rows, order=self.order)
        # Disk-tier reads go through the host cache when it has a budget (runtime/readahead.py).
        self._disk = CachedDiskTier(self._gatherer, HostCache(header, host_cache_bytes), header.rows_per_page) \
            if host_cache_bytes > 0 else None
        self._reader = self._disk or self._gatherer
        # Why the default read path fell back to "mapped" (None when it did not).
        self.read_path_note = read_path_note
        self._resident: Resident | None = None

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._watch.close()
        if self._disk is not None:
            self._disk.close()
        self._gatherer.close()
        self._resident = None
        self.order = None
        try:
            self._mapping.close()
        except BufferError:
            # A caller still holds a view; the mapping goes when the last view does.
            pass

    @property
    def row_range(self) -> tuple[int, int]:
        """Global row ids this file holds: [first, stop)."""
        return self.first_row, self.first_row + self.num_rows

    @property
    def tensor_parallel(self) -> dict[str, int] | None:
        """{"rank", "size"} for a file written by `convert --tp-size`, else None."""
        return self.manifest.get("tensor_parallel")

    def slot_of(self, ids: np.ndarray) -> np.ndarray:
        """Position of each row in the file's slot order (int64, flat); ids outside this table's
        rows raise IndexError."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, not {ids.dtype}")
        return self.order.slot_of(ids.reshape(-1), self.first_row)

    def _request_ids(self, ids) -> np.ndarray:
        """Row ids as a flat int64 array, refused as `gather` refuses them (not integers, too many)."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, not {ids.dtype}")
        check_request(ids.size, self._gatherer.max_request_rows)
        return np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)

    def page_of(self, ids: np.ndarray) -> np.ndarray:
        """Index of the file page (counted from the data region) holding each row."""
        return self.slot_of(ids) // self.rows_per_page

    # The staging calls: the device package's protocol (runtime/device/), private to it.

    def _stage(self, ids: np.ndarray, num_resident: int, slots: np.ndarray, index: np.ndarray,
               out: np.ndarray, threads: int = 1) -> tuple[int, bool]:
        """The host half of a lookup split between a resident tier (the first `num_resident` slots)
        and this file, into caller buffers, for a serving stack's every step (runtime/device/).

        `slots` (int64) gets each id's slot and `index` (int32) the slot of each resident position.
        If the other positions' rows are in the page cache (a few probed), they are copied into
        the last rows of `out` (uint8 rows) in position order and their `index` set to
        num_resident + their row of `out`. Returns (number of other positions, whether their rows
        were staged); if not, the caller reads them (`gather_slots`). `threads` splits a large
        request where the compiled helper runs it.
        """
        self._watch.check()
        ids = self._request_ids(ids)
        return self._gatherer.stage(ids, self.order, self.first_row, num_resident, slots, index, out, threads)

    def _stage_when(self, flags: np.ndarray, ids_value: int, free_value: int, ids: np.ndarray, num_resident: int,
                    slots: np.ndarray, index: np.ndarray, out: np.ndarray, threads: int = 1,
                    device_copy: tuple | None = None):
        """`_stage`, run on a thread of the compiled helper once a device has written ids_value into
        flags[0] and free_value into flags[1] (int32 in pinned host memory: after its copy of `ids`
        there, and after its last read of `out`; a free_value below 0 when that read is known to be
        done); returns a job whose `join()` returns what `_stage` does and whether it copied. The
        buffers must stay untouched until then. Needs the compiled helper (`compiled`).

        `device_copy` (context, stream, wait_event, done_event, address), CUDA driver handles as
        ints (context from `driver.device_context`): once the rows are staged, the job's thread
        queues on `stream` a wait for `wait_event`, the copy of the bytes from the first staged row
        of `out` to the end of the request's entries of `index` (which must follow `out` in the same
        pinned allocation) to the same offsets from `address`, and a record of `done_event`."""
        if not self.compiled:
            raise RuntimeError("stage_when needs the compiled helper (runtime/native/)")
        self._watch.check()
        return self._gatherer.stage_when(flags, ids_value, free_value, ids, self.order, self.first_row, num_resident,
                                         slots, index, out, threads, device_copy)

    def _stage_and_launch(self, ids: np.ndarray, num_resident: int, slots: np.ndarray, index: np.ndarray,
                          out: np.ndarray, *, context: int, events: tuple[int, ...], graph: int,
                          stream: int) -> tuple[int, bool, bool]:
        """`_stage` once each CUDA event of `events` has completed, then, if the rows were staged, the
        launch of CUDA graph exec `graph` on `stream` (raw driver handles as ints; `context` from
        `driver.device_context`), in one call of the compiled helper: a small request from device
        ids finished without a CUDA call from Python (runtime/device/), on this thread alone.
        Returns what `_stage` does and whether the graph was launched. Needs the compiled helper
        (`compiled`)."""
        if not self.compiled:
            raise RuntimeError("stage_and_launch needs the compiled helper (runtime/native/)")
        self._watch.check()
        return self._gatherer.stage_and_launch(ids, self.order, self.first_row, num_resident, slots, index, out,
                                               context, events, graph, stream)

    @property
    def compiled(self) -> bool:
        """Whether the compiled helper (runtime/native/) runs this table's host lookups."""
        return gather._native is not None

    @property
    def read_path(self) -> str:
        """How rows not in the page cache are read: "direct" (O_DIRECT), "pread" or "mapped" (page faults)."""
        return "mapped" if self._gatherer.direct is None else self._gatherer.direct.kind

    @property
    def mapped_budget(self) -> MappedBudget | None:
        """The bound on pages mapped by copies (`open_table(mapped_budget_bytes=...)`), or None."""
        return self._gatherer.budget

    @property
    def window_pages(self) -> int:
        """Distinct pages kept under MADV_WILLNEED ahead of a cold gather's copy; 0: no advice."""
        return self._gatherer.window_pages

    @window_pages.setter
    def window_pages(self, pages: int) -> None:
        self._gatherer.window_pages = int(pages)

    @property
    def window_bytes(self) -> int:
        """Cap on the advice window in bytes, for hosts under memory pressure; 0: no advice."""
        return self._gatherer.window_bytes

    @window_bytes.setter
    def window_bytes(self, limit: int) -> None:
        self._gatherer.window_bytes = int(limit)

    @property
    def max_request_rows(self) -> int:
        """The most row ids one call may ask for; a larger request raises ValueError before anything
        is allocated for it (`open_table(max_request_rows=...)`)."""
        return self._gatherer.max_request_rows

    @max_request_rows.setter
    def max_request_rows(self, rows: int) -> None:
        if int(rows) < 1:
            raise ValueError("max_request_rows must be >= 1")
        self._gatherer.max_request_rows = int(rows)

    @property
    def advice_window(self) -> int:
        """Distinct pages a cold mapped gather advises ahead of its copy: `window_pages`, capped by
        `window_bytes`; 0: no advice."""
        return self._gatherer.window

    def in_page_cache(self, ids: np.ndarray) -> bool:
        """Whether a few rows spread over these ids are in the page cache: the probe that sends a
        request to the copy from memory rather than to the read path."""
        return self._gatherer.cached(self.slot_of(ids))

    @property
    def threads(self) -> int:
        """Threads copying a large cached gather (parts of at least THREAD_MIN_ROWS rows); 1: inline."""
        return self._gatherer.threads

    @threads.setter
    def threads(self, count: int) -> None:
        self._gatherer.threads = max(1, int(count))

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 `(len(ids), row_bytes)`: the source bytes of each row, in request order."""
        self._watch.check()
        return self._reader.gather_slots(self.slot_of(self._request_ids(ids)), out)

    def gather_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Like `gather`, by file slot (`slot_of`) instead of row id; IndexError outside the table."""
        self._watch.check()
        return self._reader.gather_slots(checked_slots(slots, self.num_rows, self._gatherer.max_request_rows), out)

    @property
    def host_cache(self) -> CachedDiskTier | None:
        """The host cache in front of the disk tier (`open_table(host_cache_bytes=...)`), or None:
        `.cache` holds its rows and hit counts, `.rows_read`/`.pages_read` count demand reads."""
        return self._disk

    def read_ahead(self, chunks, skip_slots: int = 0) -> ReadAhead | None:
        """Read the rows of a request's coming chunks (row ids each, in the order they will be gathered,
        each refused as `gather` refuses a request) into the host cache on a thread, leaving out slots
        below `skip_slots` (a resident tier's); returns at once (None without a host cache)."""
        if self._disk is None:
            return None
        self._watch.check()
        slots = [self.slot_of(self._request_ids(chunk)) for chunk in chunks]  # each chunk a request
        return self._disk.read_ahead([chunk[chunk >= skip_slots] for chunk in slots])

    def resident(self, budget_bytes: int, device: str = "cpu") -> Resident:
        """Keep the leading (hottest) slots that fit in `budget_bytes` in RAM (a numpy copy).

        Replaces any earlier resident tier; `lookup` then serves those rows from it. Rows on a GPU
        are EmbeddingSource's resident tier (`EmbeddingSource(table, device=..., resident_bytes=...)`).
        """
        if device != "cpu":
            raise ValueError(f"Table.resident keeps rows in host RAM, not on {device!r}: for rows on a GPU, "
                             f"use ple_prep.runtime.EmbeddingSource(table, device={device!r}, resident_bytes=...)")
        self._resident = None
        self._resident = load_resident(self.descriptor, self.path.name, self.header, budget_bytes)
        return self._resident

    def lookup(self, ids: np.ndarray, out: np.ndarray | None = None) -> Lookup:
        """Split a request into resident positions (with their slots) and disk positions (with
        their rows, gathered). With `out` (a uint8 numpy array `(len(ids), row_bytes)`) the merged
        rows are written there, each position once, from its tier.
        """
        if out is not None and not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, not {type(out).__name__} (rows on a GPU: EmbeddingSource)")
        if out is not None and out.dtype != np.uint8:
            raise ValueError(f"out must hold uint8 row bytes, not {out.dtype}")
        self._watch.check()
        found = split(self.slot_of(self._request_ids(ids)), self._resident, self._reader)
        if out is not None:
            count = len(found.resident_positions) + len(found.disk_positions)
            if tuple(out.shape) != (count, self.row_bytes):
                raise ValueError(f"out must have shape {(count, self.row_bytes)}, not {tuple(out.shape)}")
            merge(found, self._resident, out)
        return found

    def values(self, ids: np.ndarray) -> np.ndarray:
        """float32 `(len(ids), values_per_row)`: exactly what the model layer computes. Decoded in
        steps of at most a 32nd of the request, so its temporaries stay a fraction of the result."""
        rows = self.gather(ids)
        values = np.empty((len(rows), self.values_per_row), dtype=np.float32)
        step = max(VALUES_STEP_ROWS, -(-len(rows) // 32))
        for start in range(0, len(rows), step):
            values[start:start + step] = decode(self.header.encoding, rows[start:start + step], self.values_per_row,
                                                self.scale)
        return values


def open_table(path: str | Path, manifest: str | Path | None = None, *,
               window_pages: int = DEFAULT_WINDOW_PAGES,
               window_bytes: int = DEFAULT_WINDOW_BYTES, read_path: str | None = None,
               queue_depth: int = DEFAULT_QUEUE_DEPTH, mapped_budget_bytes: int | None = None,
               budget_advice: str = "dontneed", host_cache_bytes: int | None = None,
               read_timeout: float = DEFAULT_READ_TIMEOUT, max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS,
               verify_reads: bool = False) -> Table:
    """Open a prepared table and its manifest, refusing any pair that does not belong together.

    `window_pages`/`window_bytes` bound the read-ahead advice of cold gathers (docs/RUNTIME.md).
    `read_path` "direct" reads uncached rows with O_DIRECT at `queue_depth` reads in flight, "pread"
    with buffered system calls on up to PREAD_THREADS threads, "mapped" through the mapping; None
    takes DEFAULT_READ_PATH, falling back to "pread" where O_DIRECT cannot serve (`read_path_note`
    says why; runtime/diskreader.py). A disk-tier read that makes no progress for `read_timeout`
    seconds fails its request with ReadTimeout; a call asking for more than `max_request_rows` rows
    is refused; `verify_reads` checks what the direct or pread path reads against the table's page
    sums (`ple-prep pagesums`), and at open the header and row-order map against the manifest.
    docs/RELIABILITY.md, section 10: what each path does when the disk fails.
    `mapped_budget_bytes` bounds the pages that copies leave mapped (RssFile): past it the data
    region is advised away with `budget_advice`, "dontneed" or "pageout" (runtime/footprint.py).
    `host_cache_bytes` bounds the host cache of disk-tier rows (runtime/hostcache.py): None takes
    `default_budget` on "direct" (which bypasses the page cache) and 0 on "pread" and "mapped" (the
    page cache is their cache); 0 turns it off.
    To also refuse a table whose source checkpoint changed since conversion, open it with
    `ple_prep.offline.staleness.open_checked` (that check reads the checkpoint's format).
    """
    warn_once_if_missing()  # serving without the compiled helper is slow: say so once
    if read_path is not None and read_path not in READ_PATHS:
        raise ValueError(f"read_path must be one of {', '.join(READ_PATHS)}, not {read_path!r}")
    if verify_reads and read_path == "mapped":
        raise ValueError("verify_reads checks the disk tier's reads, which the mapped path leaves to page faults: "
                         "open the table with read_path='direct' or 'pread'")
    if host_cache_bytes is not None and host_cache_bytes < 0:
        raise ValueError(f"host_cache_bytes must be >= 0, not {host_cache_bytes}")
    path = Path(path)
    manifest_file = Path(manifest) if manifest is not None else manifest_path(path)
    meta = load_table_manifest(path, manifest)
    descriptor = open_regular(path, "table")
    try:
        size = os.fstat(descriptor).st_size
        header = Header.unpack(os.pread(descriptor, HEADER_SIZE, 0), size, path.name)
        if header.file_id.hex() != meta["file_id"]:
            raise BadInput(f"{path.name} and {manifest_file.name} come from different conversions "
                           f"(file ids {header.file_id.hex()} and {meta['file_id']})")
        mismatched = [f for f in _MATCHED_FIELDS if getattr(header, f) != meta[f]]
        if header.encoding.label != meta["encoding"]:
            mismatched.append("encoding")
        if mismatched:
            raise BadInput(f"{path.name} disagrees with its manifest on {', '.join(mismatched)}")
        check_spec_digest(header.spec_digest, meta, path.name, manifest_file.name)
        # MAP_PRIVATE keeps this process's pages its own, but pages it has not touched still come
        # from the file: a rewrite in place shows through, which FileWatch detects.
        mapping = mmap.mmap(descriptor, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        watch = FileWatch(path, descriptor, header.file_id)
    except BaseException:
        os.close(descriptor)
        raise
    mapping.madvise(mmap.MADV_RANDOM)
    try:
        budget = None if mapped_budget_bytes is None else \
            MappedBudget(mapping, header, mapped_budget_bytes, budget_advice)
        sums = load_page_sums(path, header) if verify_reads else None
        # The page sums cover the data's pages only: a changed map entry would pass them.
        if verify_reads and header_region_crc(descriptor, header.data_offset) != meta["checksums"]["header_crc32"]:
            raise BadInput(f"{path.name}: its header and row-order map read back other bytes than were written "
                           f"(their crc32 differs from the manifest's header_crc32); `ple-prep verify` checks "
                           f"the whole file")
        direct, note = open_disk_reader(read_path or DEFAULT_READ_PATH, read_path is None, descriptor, path, header,
                                        queue_depth, read_timeout, sums)
    except BaseException:
        mapping.close()
        watch.close()
        raise
    if host_cache_bytes is None:
        host_cache_bytes = default_budget(header.num_pages * header.page_size) \
            if direct is not None and direct.kind == "direct" else 0
    return Table(path, meta, header, mapping, watch, window_pages, window_bytes, direct, note, budget,
                 int(host_cache_bytes), max_request_rows)
