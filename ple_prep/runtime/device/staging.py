"""The host half of EmbeddingSource: a request's slots, each position's tier index and its disk
rows staged in the pinned span (device/buffers.py), and the span's copy to the device."""
from __future__ import annotations

import os
import time

import numpy as np

from ..gather import StageJob, distinct
from ..table import Table
from .buffers import DeviceBuffers
from .graphs import INLINE_IDS
from .stats import SourceStats

# Up to this many disk positions of a cold request, rows are read without deduplication: the sort
# costs more than reading a rare duplicate row (whose page the first read has cached).
DEDUP_MIN_ROWS = 64
# A large request's slot lookup and cached row copy are split over up to LOOKUP_THREADS threads
# (the compiled helper's own pool), parts of at least LOOKUP_PART_IDS ids: the host half of a
# prefill chunk scales with them (BENCHMARKS.md, "Host lookup"). Two of the cores this process may
# run on are left to the threads that launch the model's work.
LOOKUP_THREADS = min(16, max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                  else os.cpu_count() or 1) - 2))
LOOKUP_PART_IDS = 4096


class HostStaging:
    """Stages requests of one source into its pinned span; `table` may be replaced by a reopening."""

    def __init__(self, table: Table, buffers: DeviceBuffers, num_resident: int, stats: SourceStats,
                 current_stream):
        self.table = table
        self._buffers = buffers
        self._num_resident = num_resident
        self._stats = stats
        self._current_stream = current_stream
        self.slots = np.empty(buffers.capacity, dtype=np.int64)
        # A small request's copy to the device, left to finish's graph (the pinned span's bytes).
        self.deferred_copy: tuple[int, int] | None = None
        # Rows the last start copied from the disk tier: each disk position when they were cached,
        # each distinct disk row once when they were not.
        self.last_disk_rows = 0
        # Seconds of the last start's host stages: lookup, split, gather, copy (the launch); for a
        # start from device ids finished in one call, that call's seconds as the lookup.
        self.last_stages: dict[str, float] = {}

    def lookup_threads(self, count: int) -> int:
        """Threads of the compiled helper's pool for a request of `count` ids (1 without it)."""
        return max(1, min(LOOKUP_THREADS, count // LOOKUP_PART_IDS)) if self.table.compiled else 1

    def prepare(self, ids: np.ndarray, stream, job: StageJob | None = None, outcome: tuple[int, bool] | None = None,
                defer_copy: bool = False) -> int:
        """Slots, the resident/disk split, the disk rows and the tier index into the span, or the
        outcome of a stage already run (by a helper thread's `job`, which may have queued the copy
        too, or by a one-call finish: `outcome`); the copy on `stream` (None: the current one,
        looked up only then; for inline work the caller's, where it is queued ahead of what comes
        next). With `defer_copy` (a finish follows at once) a small request's copy is left to
        finish's graph instead. Returns the number of ids."""
        count, resident, table, buffers = len(ids), self._num_resident, self.table, self._buffers
        began = time.perf_counter()
        self.deferred_copy = None
        slots, index = self.slots[:count], buffers.host_index[:count]
        copied = False  # by the job's thread, right after it staged the rows
        if job is not None:
            disk, staged, copied = job.join()
        elif outcome is not None:
            disk, staged = outcome
        else:
            if buffers.cuda:
                # The previous copy has left the pinned span before this call rewrites it.
                buffers.copied.synchronize()
            disk, staged = table._stage(ids, resident, slots, index, buffers.host_rows, self.lookup_threads(count))
        looked_up = split = gathered = time.perf_counter()
        stats = self._stats
        stats.lookups += outcome is None  # a one-call finish counted its own
        stats.rows_resident += count - disk
        stats.helper_copies += copied
        if staged:
            stats.rows_page_cache += disk
        else:
            # Cold: each distinct row read once, through the table's read path.
            stats.rows_disk += disk
            disk_positions = np.flatnonzero(slots >= resident)
            disk_slots = slots[disk_positions]
            if disk > DEDUP_MIN_ROWS:
                disk_slots, inverse = distinct(disk_slots)
                disk = len(disk_slots)
            else:
                inverse = np.arange(disk)
            first = buffers.capacity - disk
            index[disk_positions] = resident + first + inverse
            split = time.perf_counter()
            tier = table.host_cache
            hits = tier.cache.hits if tier is not None else 0
            table.gather_slots(disk_slots, out=buffers.host_rows[first:])
            gathered = time.perf_counter()
            cached = tier.cache.hits - hits if tier is not None else 0
            stats.rows_host_cache += cached
            stats.rows_read += disk - cached
        self.last_disk_rows = disk
        span = buffers.span_of(disk, count)
        if buffers.cuda and not copied:
            if defer_copy and 0 < count <= INLINE_IDS:
                self.deferred_copy = span
            else:
                buffers.launch_copy(span, stream or self._current_stream())
                stats.host_copies += 1
        self.last_stages = {"lookup": looked_up - began, "split": split - looked_up,
                            "gather": gathered - split, "copy": time.perf_counter() - gathered}
        return count

    def one_call_done(self, count: int, disk: int, began: float) -> None:
        """Account for a one-call finish of `count` ids whose `disk` rows were staged from the page cache."""
        stats = self._stats
        stats.one_call_finishes += 1
        stats.lookups += 1
        stats.rows_resident += count - disk
        stats.rows_page_cache += disk
        self.last_disk_rows = disk
        self.last_stages = {"lookup": time.perf_counter() - began, "split": 0.0, "gather": 0.0, "copy": 0.0}
