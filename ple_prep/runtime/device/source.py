"""The PLE layer's input as a torch tensor: row ids from the host in, bf16 values on the device out.

    from ple_prep.runtime import open_table
    from ple_prep.runtime.device import EmbeddingSource

    source = EmbeddingSource(open_table("/nvme/ple.bin"), device="cuda",
                             resident_bytes=2 << 30, max_ids=4096 * 16)
    source.start(row_ids)       # int64 of any shape, numpy, CPU or GPU tensor; returns at once
    ...                         # earlier layers run on the device meanwhile
    values = source.finish()    # bf16 (len(row_ids), 160) on the device
    values = source(row_ids)    # both in one call: (T, 16) ids -> bf16 (T, 2560)

Resident rows (the file's leading slots, the hottest with an access-ordered layout) live on the
device. `start` runs on the host (inline for a few ids, else on a worker thread): the table's host
lookup finds each id's slot and writes the resident positions' tier index; the rows of the other
positions are copied into a pinned buffer (from the page cache: every position, in parts on
threads; cold: each distinct row once, through the table's read path) with their tier index next
to them; one non-blocking copy on a side stream carries both to the device. Ids on the device (a
serving stack that computes them there) are copied to pinned memory behind the kernel that wrote
them; a large request's lookup starts on a helper thread of the compiled runtime (runtime/native/) as soon as they land,
while the caller goes on launching work, a small one's runs at `finish` (which waits on the host
for those ids: the device is usually past them by then; with the compiled helper, once a graph of
its size exists, that wait, the lookup and the graph's launch are one call). `finish` makes the
current stream wait for that copy (an event: no host synchronisation when the copy was launched in
time), then one index picks every position's row from its tier and the decoder writes bf16 into an
output buffer allocated once (FP8 with Triton: one kernel does both, device/triton_gather.py).
The device half launches kernels only, on fixed buffers, so it can be captured in a CUDA graph and
replayed; docs/SERVING.md gives the contract.

Imported only when asked: needs torch (`pip install 'ple-prep[torch]'`).
"""
from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np
import torch

from ..table import Table
from .buffers import DeviceBuffersMixin
from .dequant import decoder_for
from .device_ids import DeviceIdsMixin, _FromDevice
from .graphs import INLINE_IDS, GraphsMixin
from .triton_gather import fp8_gather_for

# Up to this many disk positions of a cold request, rows are read without deduplication: the sort
# costs more than reading a rare duplicate row (whose page the first read has cached).
DEDUP_MIN_ROWS = 64
# A large request's slot lookup and cached row copy are split over up to LOOKUP_THREADS threads
# (the compiled helper's own pool), parts of at least LOOKUP_PART_IDS ids. On the H200's 16-core
# host a 4,096-token chunk's host half took 2.63 ms on one thread and 0.33 ms on 14
# (BENCHMARKS.md); two of the cores this process may run on are left to the threads that launch
# the model's work.
LOOKUP_THREADS = min(16, max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                  else os.cpu_count() or 1) - 2))
LOOKUP_PART_IDS = 4096


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ascending distinct values of a non-negative int64 array and each element's rank among them."""
    count = len(values)
    shift = max(1, (count - 1).bit_length())
    # One sort of (value, position) packed in an int64: cheaper than np.unique's argsort.
    keys = values << shift
    keys |= np.arange(count, dtype=np.int64)
    keys.sort()
    ordered = keys >> shift
    first = np.empty(count, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    rank = np.cumsum(first)
    rank -= 1
    inverse = np.empty(count, dtype=np.int64)
    inverse[keys & ((1 << shift) - 1)] = rank
    return ordered[first], inverse


class _Done:
    """A start whose host work ran inline: its outcome, shaped like a future's."""

    def __init__(self, count: int, error: BaseException | None = None):
        self.count = count
        self.error = error

    def result(self) -> int:
        if self.error is not None:
            raise self.error
        return self.count


class EmbeddingSource(DeviceBuffersMixin, DeviceIdsMixin, GraphsMixin):
    """bf16 PLE values on a torch device for row ids given on the host, from a resident and a disk tier."""

    def __init__(self, table: Table, *, device: str | torch.device = "cuda", resident_bytes: int = 0,
                 max_ids: int = 4096 * 16):
        if max_ids < 1:
            raise ValueError("max_ids must be >= 1")
        self.table = table
        # Resolved ('cuda' -> 'cuda:0') so it compares equal to the devices of tensors.
        self.device = torch.empty(0, device=device).device
        self.capacity = int(max_ids)
        self.num_resident = int(min(table.num_rows, max(0, resident_bytes) // table.row_bytes))
        self._allocate_buffers()
        self._decoder = decoder_for(table.encoding, table.values_per_row, table.scale, self.device)
        # FP8 on a GPU with Triton: the row index and the decode in one kernel, compiled here so
        # that no graph capture compiles it.
        self._fused = fp8_gather_for(self._decoder, table.row_bytes, self.device)
        if self._fused is not None:
            self._fused(self._tiers, self._index[:1], self.output[:1])
        self._slots = np.empty(self.capacity, dtype=np.int64)
        self._small_outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # The graphs with a copy as CUDA graph execs, by size, for the compiled helper to launch
        # (`_finish_in_one_call`); torch builds without `raw_cuda_graph_exec` replay through torch.
        self._graph_execs: dict[int, int] = {}
        # A small request's copy to the device, left to finish's graph (the pinned span's bytes).
        self._deferred_copy: tuple[int, int] | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | _Done | None = None
        self._joined: int | None = None
        # Rows the last start copied from the disk tier: each disk position when they were cached,
        # each distinct disk row once when they were not.
        self.last_disk_rows = 0
        # Seconds of the last start's host stages: lookup, split, gather, copy (the launch); for a
        # start from device ids finished in one call, that call's seconds as the lookup.
        self.last_stages: dict[str, float] = {}

    # --- the host half -------------------------------------------------------------------------

    def start(self, row_ids, *, inline: bool | None = None) -> None:
        """Begin serving `row_ids`. Returns once the host work is handed off.

        Host ids (numpy or a CPU tensor): up to INLINE_IDS ids the work runs inline, else on a
        worker thread (`inline` forces either way). Ids on this source's GPU: their copy to pinned
        memory is queued on the current stream and `start` returns without waiting for it; a
        large request's lookup then runs on a helper thread as soon as they land, a small one's
        at `join`. Errors of that work (ids outside the table, I/O) are raised by `join` or `finish`.
        """
        self._start(row_ids, inline, None)

    def _start(self, row_ids, inline: bool | None, stream, defer_copy: bool = False) -> None:
        if self._pending is not None:
            raise RuntimeError("start() called again before finish() or join() of the previous start()")
        self._joined = None
        if self._cuda and isinstance(row_ids, torch.Tensor) and row_ids.device == self.device:
            self._pending = self._start_from_device(row_ids)
            return
        ids = self._host_ids(row_ids)
        if inline is None:
            inline = len(ids) <= INLINE_IDS
        if inline:
            try:
                self._pending = _Done(self._prepare(ids, stream, defer_copy=defer_copy))
            except Exception as error:  # raised at finish(), as from the worker
                self._pending = _Done(len(ids), error)
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-prep-start")
        # The worker reads its own copy: the caller may reuse its array at once.
        self._pending = self._worker.submit(self._prepare, ids.copy(), self._copy_stream if self._cuda else None)

    def _current_stream(self):
        return torch.cuda.current_stream(self.device) if self._cuda else None

    def join(self) -> int:
        """Wait for the last start's host work (the copy launched, not finished); raise its error.

        Returns the number of ids. `finish` calls it; call it yourself before replaying a graph
        that captured `finish`. After it, the next `start` may come.
        """
        return self._join(defer_copy=False, stream=None)

    def _join(self, defer_copy: bool, stream) -> int:
        """`join`; a small start from device ids copies on `stream` (default: the current one)."""
        pending, self._pending = self._pending, None
        if pending is None:
            if self._joined is None:
                raise RuntimeError("finish() or join() without a start()")
            return self._joined
        if isinstance(pending, _FromDevice):
            # Raises the device's error, if any; after it both flags have landed, so a job ends.
            self._ids_landed.synchronize()
            stream = self._copy_stream if pending.job is not None else stream
            self._joined = self._prepare(pending.ids, stream, pending.job, defer_copy)
        else:
            self._joined = pending.result()
        return self._joined

    def drop(self) -> None:
        """Abandon the last start, if any (say, its forward pass failed before it was finished):
        its host work is stopped or waited for and its errors are dropped."""
        pending, self._pending = self._pending, None
        if isinstance(pending, concurrent.futures.Future):
            concurrent.futures.wait([pending])
        elif isinstance(pending, _FromDevice) and pending.job is not None:
            pending.job.cancel()

    def _host_ids(self, row_ids) -> np.ndarray:
        if isinstance(row_ids, torch.Tensor):
            row_ids = row_ids.detach().to("cpu").numpy()
        ids = np.asarray(row_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, not {ids.dtype}")
        self._checked_count(ids.size)
        return np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)

    def _checked_count(self, count: int) -> int:
        if count > self.capacity:
            raise ValueError(f"{count} row ids exceed this source's max_ids = {self.capacity}")
        return count

    def _lookup_threads(self, count: int) -> int:
        """Threads of the compiled helper's pool for a request of `count` ids (1 without it)."""
        return max(1, min(LOOKUP_THREADS, count // LOOKUP_PART_IDS)) if self.table.compiled else 1

    def close(self) -> None:
        """Release the worker thread (a pending start is finished first); the table stays open."""
        self.drop()
        if self._worker is not None:
            self._worker.shutdown()
        self._worker = None

    def read_ahead(self, chunks):
        """Read the disk-tier rows of a request's coming chunks (row ids each, in the order they
        will be started: a prompt's, when it arrives) into the table's host cache ahead of them;
        returns at once (`Table.read_ahead`: a ReadAhead, None without a host cache)."""
        return self.table.read_ahead([self._host_ids(chunk) for chunk in chunks], skip_slots=self.num_resident)

    def reopen(self, table: Table) -> None:
        """Serve from `table`, a new opening of the same file (after `close`, when the old opening
        was closed: say, to evict its pages)."""
        if (table.num_rows, table.row_bytes, table.header.file_id) != \
                (self.table.num_rows, self.table.row_bytes, self.table.header.file_id):
            raise ValueError(f"{table.path} is not the table this source was built from")
        self.table = table

    def _prepare(self, ids: np.ndarray, stream, job=None, defer_copy: bool = False) -> int:
        """Slots, the resident/disk split, the disk rows and the tier index into the span (or the
        outcome of `job`, a stage already run: on a helper thread, which may have queued the copy
        too, or by `_finish_in_one_call`); the
        copy on `stream` (None: the current one, looked up only then; for inline work the caller's,
        where it is queued ahead of what comes next). With `defer_copy` (a finish follows at once)
        a small request's copy is left to finish's graph instead."""
        count, resident, table = len(ids), self.num_resident, self.table
        began = time.perf_counter()
        self._deferred_copy = None
        slots, index = self._slots[:count], self._host_index[:count]
        copied = False  # by the job's thread, right after it staged the rows
        if job is not None:
            disk, staged, copied = job.join()
        else:
            if self._cuda:
                # The previous copy has left the pinned span before this call rewrites it.
                self._copied.synchronize()
            disk, staged = table.stage(ids, resident, slots, index, self._host_rows, self._lookup_threads(count))
        looked_up = split = gathered = time.perf_counter()
        if not staged:
            # Cold: each distinct row read once, through the table's read path.
            disk_positions = np.flatnonzero(slots >= resident)
            disk_slots = slots[disk_positions]
            if disk > DEDUP_MIN_ROWS:
                disk_slots, inverse = _distinct(disk_slots)
                disk = len(disk_slots)
            else:
                inverse = np.arange(disk)
            first = self.capacity - disk
            index[disk_positions] = resident + first + inverse
            split = time.perf_counter()
            table.gather_slots(disk_slots, out=self._host_rows[first:])
            gathered = time.perf_counter()
        self.last_disk_rows = disk
        span = ((self.capacity - disk) * self.table.row_bytes, self._index_at + 4 * count)
        if self._cuda and not copied:
            if defer_copy and 0 < count <= INLINE_IDS:
                self._deferred_copy = span
            else:
                self._launch_copy(span, stream or self._current_stream())
        self.last_stages = {"lookup": looked_up - began, "split": split - looked_up,
                            "gather": gathered - split, "copy": time.perf_counter() - gathered}
        return count

    def _launch_copy(self, span: tuple[int, int], stream) -> None:
        """Bytes [low, high) of the pinned span to the device span, on `stream`, once the last
        finish has read the device span; `_copied` marks its end."""
        stream.wait_event(self._consumed)
        self._copy(*span, stream)
        self._copied.record(stream)

    def _copy(self, low: int, high: int, stream) -> None:
        """Bytes [low, high) of the pinned span to the device span, on `stream`."""
        if stream is self._copy_stream:
            with torch.cuda.stream(stream):
                self._span[low:high].copy_(self._host_span[low:high], non_blocking=True)
        else:  # the caller's current stream
            self._span[low:high].copy_(self._host_span[low:high], non_blocking=True)

    # --- the device half -----------------------------------------------------------------------

    def finish(self, count: int | None = None) -> torch.Tensor:
        """bf16 `(count, values_per_row)` for the last start's ids: a view of `output`, valid until
        the next finish (or graph replay) overwrites it.

        `count` defaults to the number of ids; a larger one (up to max_ids) also decodes the
        positions past them from stale, in-range rows: the fixed shape a captured graph needs.
        While the current stream captures a CUDA graph only the device half is recorded, and the
        last start must have been joined before the capture began.
        """
        return self._finish(count, None)

    def _finish(self, count: int | None, stream) -> torch.Tensor:
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            if self._pending is not None:
                raise RuntimeError("join() the pending start() before capturing finish() in a graph")
            if count is None:
                raise ValueError("finish() in a captured graph needs count (the graph's fixed size)")
        else:
            values = self._finish_in_one_call(count)
            if values is not None:
                return values
            joined = self._join(defer_copy=True, stream=stream)
            self._joined = None
            count = joined if count is None else count
            if count < joined:
                raise ValueError(f"count {count} is smaller than the {joined} ids started")
        if not 0 <= count <= self.capacity:
            raise ValueError(f"count {count} is outside [0, max_ids = {self.capacity}]")
        if not self._cuda:
            return self._index_and_decode(count)
        # Only an eager finish follows a deferring start or join (none runs while capturing).
        deferred, self._deferred_copy = self._deferred_copy, None
        size = self._graph_size(count)
        # With the copy deferred, one graph holds it, its waits and marks, and the device half:
        # replayed on the current stream without naming it (each lookup of it costs microseconds).
        with_copy = deferred is not None
        graph = self._graphs.get((size, with_copy))
        if with_copy and graph is not None:
            graph.replay()
            return self._output_view(count)
        stream = stream or self._current_stream()
        if capturing or count == 0:
            if deferred is not None:
                self._launch_copy(deferred, stream)
            self._copied.wait(stream)
            values = self._index_and_decode(count)
            self._consumed.record(stream)
            return values
        graph = graph or self._capture(size, with_copy, stream)
        if not with_copy:
            self._copied.wait(stream)
        graph.replay()
        if not with_copy:
            self._consumed.record(stream)
        return self._output_view(count)

    def __call__(self, row_ids) -> torch.Tensor:
        """`start` inline then `finish`: bf16 values on the device, each row of ids concatenated;
        ids `(T, 16)` give `(T, 16 * values_per_row)`, flat ids `(n, values_per_row)`."""
        stream = self._current_stream()  # looked up once for both halves
        # Outside a capture, a small request's copy goes into finish's graph (one launch fewer).
        self._start(row_ids, True, stream, defer_copy=self._cuda and not torch.cuda.is_current_stream_capturing())
        values = self._finish(None, stream)
        shape = tuple(row_ids.shape)
        if len(shape) < 2:
            return values
        return values.view(*shape[:-1], shape[-1] * self.table.values_per_row)
