"""The PLE layer's input as a torch tensor: row ids from the host in, bf16 values on the device out.

    from ple_prep.runtime import open_table
    from ple_prep.runtime.torch import EmbeddingSource

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
them; a large request's lookup starts on a helper thread of core/_native.c as soon as they land,
while the caller goes on launching work, a small one's runs at `finish` (which waits on the host
for those ids: the device is usually past them by then; with the compiled helper, once a graph of
its size exists, that wait, the lookup and the graph's launch are one call). `finish` makes the
current stream wait for that copy (an event: no host synchronisation when the copy was launched in
time), then one index picks every position's row from its tier and the decoder writes bf16 into an
output buffer allocated once (FP8 with Triton: one kernel does both, runtime/triton_gather.py).
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

from .driver import device_context, queue_ids_copy
from .table import Table
from .tiers import read_leading_slots
from .torch_dequant import decoder_for
from .triton_gather import fp8_gather_for

# Up to this many ids, `start` does its host work inline (a hop to the worker thread costs more)
# and copies on the caller's stream, inside `finish`'s graph when `source(ids)` calls both.
INLINE_IDS = 1024
# An eager `finish` replays a graph captured for the count rounded up to a power of two, at least
# this (a decode step's 16 ids): one launch instead of a handful, each 5-15 us of host time on the
# H200's host, and a Triton launch from Python costs more than the chunk's replay.
GRAPH_MIN_IDS = 16
# Values the device writes into the pinned flags of a start from device ids, in turn (never 0).
FLAG_VALUES = 256
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


class _Staged:
    """A small start's stage already run by Table.stage_and_launch (its rows not cached), shaped
    like a helper thread's job for `_prepare`."""

    def __init__(self, disk: int, staged: bool):
        self.outcome = (disk, staged, False)

    def join(self) -> tuple[int, bool, bool]:
        return self.outcome


class _FromDevice:
    """A start from device ids: their copy to pinned memory queued, and for a large request the
    lookup waiting on a helper thread for them to land (`job`); the rest runs at join."""

    def __init__(self, ids: np.ndarray, job=None):
        self.ids = ids
        self.job = job


class EmbeddingSource:
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
        rows, row_bytes, capacity = self.num_resident, table.row_bytes, self.capacity
        # One device buffer: [lead][resident rows][staging rows][pad][tier index, int32 per position].
        # The staging rows fill from their end, so a call's disk rows and its index are one
        # contiguous span: one copy. The lead and pad keep the span and the index 4-byte aligned.
        lead = -rows * row_bytes % 4
        pad = -capacity * row_bytes % 4
        self._index_at = capacity * row_bytes + pad          # within the span
        span_bytes = self._index_at + 4 * capacity
        buffer = torch.empty(lead + rows * row_bytes + span_bytes, dtype=torch.uint8, device=self.device)
        self._tiers = buffer[lead:lead + (rows + capacity) * row_bytes].view(rows + capacity, row_bytes)
        self._span = buffer[lead + rows * row_bytes:]
        # Every index entry, also past a call's count, names a real tier row: a graph captured
        # for more positions than a replay's call has reads stale rows there, never outside.
        self._span[self._index_at:].zero_()
        self._index = self._span[self._index_at:].view(torch.int32)

        def put(start: int, chunk: np.ndarray) -> None:
            self._tiers[start:start + len(chunk)].copy_(torch.from_numpy(chunk))

        read_leading_slots(table.descriptor, table.path.name, table.header, rows, put)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._host_span = torch.zeros(span_bytes, dtype=torch.uint8, pin_memory=True)
            self._copy_stream = torch.cuda.Stream(self.device)
            # External events: captured in a graph they become record/wait nodes on these events.
            self._copied = torch.cuda.Event(external=True)
            self._consumed = torch.cuda.Event(external=True)
            # Ids given on the device land here, then a value in flags[0]; flags[1] gets one after
            # the device's last read of the pinned span (what Table.stage_when waits for).
            self._device_ids = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._device_ids_array = self._device_ids.numpy()
            self._flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)
            self._flags_array = self._flags.numpy()
            # One-element views made once: slicing costs more than the copy's launch.
            self._free_flag = self._flags[1:2]
            self._flag_values = torch.arange(1, FLAG_VALUES + 1, dtype=torch.int32, device=self.device)
            self._flag_sources = [self._flag_values[k:k + 1] for k in range(FLAG_VALUES)]
            self._flags_written = 0
            self._ids_ready = torch.cuda.Event()
            self._ids_landed = torch.cuda.Event()
            # With the compiled helper, device ids are copied to pinned memory by driver calls
            # (runtime/driver.py), and a large request's staged rows to the device by the helper's
            # thread (Table.stage_when). They wait on and record these events, which must exist
            # first (torch creates an event at its first record).
            self._consumed.record()
            self._copied.record(self._copy_stream)
            self._ids_landed.record()
            self._context = device_context(self.device.index) if table.compiled else None
            # The raw handles and addresses of every step's driver calls, read once: each torch
            # accessor costs the H200's host up to a microsecond.
            self._ids_landed_handle, self._copied_handle = self._ids_landed.cuda_event, self._copied.cuda_event
            self._device_ids_address, self._flags_address = self._device_ids.data_ptr(), self._flags.data_ptr()
            self._device_copy = None if self._context is None else (
                self._context, self._copy_stream.cuda_stream, self._consumed.cuda_event, self._copied_handle,
                self._span.data_ptr())
        else:
            # On the CPU the host writes the span in place: there is nothing to copy.
            self._host_span = self._span
        self._host_rows = self._host_span[:capacity * row_bytes].view(capacity, row_bytes).numpy()
        self._host_index = self._host_span[self._index_at:].view(torch.int32).numpy()
        self._rows = torch.empty((capacity, row_bytes), dtype=torch.uint8, device=self.device)
        self.output = torch.empty((capacity, table.values_per_row), dtype=torch.bfloat16, device=self.device)
        self._decoder = decoder_for(table.encoding, table.values_per_row, table.scale, self.device)
        # FP8 on a GPU with Triton: the row index and the decode in one kernel, compiled here so
        # that no graph capture compiles it.
        self._fused = fp8_gather_for(self._decoder, table.row_bytes, self.device)
        if self._fused is not None:
            self._fused(self._tiers, self._index[:1], self.output[:1])
        self._slots = np.empty(capacity, dtype=np.int64)
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

    def _start_from_device(self, row_ids: torch.Tensor) -> _FromDevice:
        dtype = row_ids.dtype
        if dtype is not torch.int64 and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise TypeError(f"row ids must be integers, not {dtype}")
        count = self._checked_count(row_ids.numel())
        ids = self._device_ids_array[:count]
        if count <= INLINE_IDS or not self.table.compiled:
            # The lookup at join: for a small request that costs less than a helper thread's start
            # (and without the compiled helper there is no such thread).
            self._copy_ids(row_ids, count)
            return _FromDevice(ids)
        # Usually the last copy out of the pinned span has run (its finish waited for it): then the
        # ids and their flag go on the caller's stream and the job waits for that flag alone;
        # else, on the side stream, the flags land after that copy, in the order written.
        span_free = self._copied.query()
        free_value = -1 if span_free else self._next_flag_value()
        ids_value = self._next_flag_value()
        # The copies first: the device runs them while the job's thread starts (which then may
        # find its flags written already).
        if span_free:
            self._copy_ids(row_ids, count, ids_value)
        else:
            self._ids_ready.record()
            stream = self._copy_stream
            stream.wait_event(self._ids_ready)
            row_ids.record_stream(stream)  # the caller may free its tensor before the copy has run
            with torch.cuda.stream(stream):
                stream.wait_event(self._copied)
                self._write_free_flag(free_value)
                self._copy_ids(row_ids, count, ids_value)
        job = self.table.stage_when(self._flags_array, ids_value, free_value, ids, self.num_resident,
                                    self._slots[:count], self._host_index[:count], self._host_rows,
                                    self._lookup_threads(count), self._device_copy)
        return _FromDevice(ids, job)

    def _copy_ids(self, row_ids: torch.Tensor, count: int, ids_value: int | None = None) -> None:
        """Queue on the current stream the copy of `row_ids` into pinned memory (any shape: a
        contiguous tensor's bytes are its ids in order), then (for a helper thread's job) the flag
        that says they landed; `_ids_landed` marks them."""
        if self._context is None:  # no compiled helper, so no helper thread and no flag: torch's copy
            self._device_ids[:count].copy_(row_ids.reshape(-1), non_blocking=True)
            self._ids_landed.record()
            return
        if row_ids.dtype is not torch.int64 or not row_ids.is_contiguous():
            row_ids = row_ids.to(torch.int64).contiguous()
        flag_source = 0 if ids_value is None else self._flag_values.data_ptr() + 4 * (ids_value - 1)
        # The current stream's handle without a Stream object (torch.cuda.current_stream builds
        # one, 3.5-7 us on the H200's host).
        queue_ids_copy(self._context, torch._C._cuda_getCurrentRawStream(self.device.index), self._ids_landed_handle,
                       self._device_ids_address, row_ids.data_ptr(), 8 * count, self._flags_address, flag_source)

    def _next_flag_value(self) -> int:
        self._flags_written += 1
        return self._flags_written % FLAG_VALUES + 1

    def _write_free_flag(self, value: int) -> None:
        """Queue the device's write of `value` into flags[1], on the current stream."""
        self._free_flag.copy_(self._flag_sources[value - 1], non_blocking=True)

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

    def _graph_size(self, count: int) -> int:
        """The positions of the graph an eager finish of `count` positions replays."""
        return min(self.capacity, max(GRAPH_MIN_IDS, 1 << (count - 1).bit_length()))

    def _finish_in_one_call(self, count: int | None) -> torch.Tensor | None:
        """An eager finish of a small start from device ids in one call of the compiled helper
        (Table.stage_and_launch): the waits for its ids and for the span's last copy, its lookup,
        and the launch of the graph that copies its rows and decodes them, with no torch call for
        them (each costs the H200's host several microseconds: BENCHMARKS.md). None where that
        graph is not captured yet (the start still pending: the general path captures it) or the
        rows are not cached (then read here as `_join` does, and the general path replays the
        graph)."""
        pending = self._pending
        if not isinstance(pending, _FromDevice) or pending.job is not None or not self._graph_execs:
            return None
        started = len(pending.ids)
        count = started if count is None else count
        graph = self._graph_execs.get(self._graph_size(count)) if 0 < started <= count <= self.capacity else None
        if graph is None:
            return None
        began = time.perf_counter()
        self._pending = None  # as in `_join`: a raised error leaves no start pending
        disk, staged, launched = self.table.stage_and_launch(
            pending.ids, self.num_resident, self._slots[:started], self._host_index[:started], self._host_rows,
            context=self._context, events=(self._ids_landed_handle, self._copied_handle), graph=graph,
            stream=torch._C._cuda_getCurrentRawStream(self.device.index))
        if not launched:
            self._joined = self._prepare(pending.ids, None, _Staged(disk, staged), defer_copy=True)
            return None
        self.last_disk_rows = disk
        self.last_stages = {"lookup": time.perf_counter() - began, "split": 0.0, "gather": 0.0, "copy": 0.0}
        return self._output_view(count)

    def _output_view(self, count: int) -> torch.Tensor:
        """output[:count]; for a small request (a decode step's, every step) made once."""
        if count > INLINE_IDS:
            return self.output[:count]
        view = self._small_outputs.get(count)
        if view is None:
            view = self._small_outputs[count] = self.output[:count]
        return view

    def _index_and_decode(self, count: int) -> torch.Tensor:
        if self._fused is not None:
            values = self.output[:count]
            self._fused(self._tiers, self._index[:count], values)
            return values
        rows = torch.index_select(self._tiers, 0, self._index[:count], out=self._rows[:count])
        values = self.output[:count]
        self._decoder(rows, out=values)
        return values

    def _capture(self, size: int, with_copy: bool, stream) -> torch.cuda.CUDAGraph:
        """The device half for `size` positions as a CUDA graph, captured once per size; `with_copy`:
        preceded by the copy of the span's part that `size` positions can use (their rows fill the
        staging rows from the end) and with the events the copy waits for and marks."""
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(self.device)
        capture.wait_stream(stream)
        with torch.cuda.stream(capture):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                if with_copy:
                    self._launch_copy(((self.capacity - size) * self.table.row_bytes, self._index_at + 4 * size),
                                      capture)
                self._index_and_decode(size)
                if with_copy:
                    self._consumed.record(capture)
            finally:
                graph.capture_end()
        stream.wait_stream(capture)
        self._graphs[(size, with_copy)] = graph
        if with_copy and self._context is not None and hasattr(graph, "raw_cuda_graph_exec"):
            self._graph_execs[size] = graph.raw_cuda_graph_exec()
        return graph

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
