"""The PLE layer's input as a torch tensor: row ids from the host in, bf16 values on the device out.

    from ple_prep.runtime import EmbeddingSource, open_table

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
them; a large request's lookup starts on a helper thread of the compiled runtime (runtime/native/)
as soon as they land, while the caller goes on launching work, a small one's runs at `finish` (which waits on the host
for those ids: the device is usually past them by then; with the compiled helper, once a graph of
its size exists, that wait, the lookup and the graph's launch are one call). `finish` makes the
current stream wait for that copy (an event: no host synchronisation when the copy was launched in
time), then one index picks every position's row from its tier and the decoder writes bf16 into an
output buffer allocated once (FP8 with Triton: one kernel does both, device/triton_gather.py).
The device half launches kernels only, on fixed buffers, so it can be captured in a CUDA graph and
replayed; docs/SERVING.md gives the contract. `stats()` counts what it served (device/stats.py).

Imported only when asked: needs torch (`pip install 'ple-prep[torch]'`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import numpy as np
import torch

from ..gather import StageJob
from ..table import Table
from .buffers import DeviceBuffers, PickAndDecode
from .device_ids import DeviceIds
from .graphs import INLINE_IDS, GraphCache
from .staging import HostStaging
from .stats import SourceStats


@dataclasses.dataclass
class PendingStart:
    """The last start until it is joined: its ids' count and how its host work runs. Host ids run
    inline (done: `error` holds what it raised) or on the worker thread (`future`); ids given on
    the device (`device_ids`, pinned, valid once they landed) are looked up at join, or for a
    large request by a helper thread's `job` as soon as they land."""

    count: int
    future: concurrent.futures.Future | None = None
    error: BaseException | None = None
    device_ids: np.ndarray | None = None
    job: StageJob | None = None


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
        self.buffers = DeviceBuffers(table, self.device, self.num_resident, self.capacity)
        self._cuda = self.buffers.cuda
        self._device_ids = DeviceIds(self.buffers, self.device, table.compiled) if self._cuda else None
        self._index_and_decode = PickAndDecode(table, self.buffers, self.device)
        self._graphs = GraphCache(self.buffers, self.device, self._index_and_decode)
        self._stats = SourceStats()
        self._staging = HostStaging(table, self.buffers, self.num_resident, self._stats, self._current_stream)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: PendingStart | None = None
        self._joined: int | None = None

    @property
    def last_disk_rows(self) -> int:
        """Rows the last start copied from the disk tier: each disk position when they were
        cached, each distinct disk row once when they were not."""
        return self._staging.last_disk_rows

    @property
    def last_stages(self) -> dict[str, float]:
        """Seconds of the last start's host stages: lookup, split, gather, copy (the launch); for a
        start from device ids finished in one call, that call's seconds as the lookup."""
        return self._staging.last_stages

    @property
    def kernel(self) -> str:
        """How `finish` picks and decodes rows: "fused" (one Triton kernel: FP8 on a GPU with
        Triton) or "torch" (an index, then the encoding's torch decoder)."""
        return self._index_and_decode.kernel

    def stats(self) -> SourceStats:
        """A snapshot of what this source has served since it was made (device/stats.py)."""
        return dataclasses.replace(self._stats)

    def captured_graphs(self) -> list[tuple[int, bool]]:
        """The device halves captured as CUDA graphs, as (positions, whether the graph holds the
        span's copy), ascending."""
        return sorted(self._graphs.graphs)

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
            self._count_start(self._pending.count)
            return
        ids = self._host_ids(row_ids)
        self._count_start(len(ids))
        if inline is None:
            inline = len(ids) <= INLINE_IDS
        if inline:
            try:
                self._pending = PendingStart(self._staging.prepare(ids, stream, defer_copy=defer_copy))
            except Exception as error:  # raised at finish(), as from the worker
                self._pending = PendingStart(len(ids), error=error)
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-prep-start")
        # The worker reads its own copy: the caller may reuse its array at once.
        stream = self.buffers.copy_stream if self._cuda else None
        future = self._worker.submit(self._staging.prepare, ids.copy(), stream)
        self._pending = PendingStart(len(ids), future=future)

    def _count_start(self, count: int) -> None:
        self._stats.starts += 1
        self._stats.ids += count

    def _start_from_device(self, row_ids: torch.Tensor) -> PendingStart:
        dtype = row_ids.dtype
        if dtype is not torch.int64 and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise TypeError(f"row ids must be integers, not {dtype}")
        count = self._checked_count(row_ids.numel())
        self._stats.starts_from_device += 1
        if count <= INLINE_IDS or not self.table.compiled:
            # The lookup at join: for a small request that costs less than a helper thread's start
            # (and without the compiled helper there is no such thread).
            return PendingStart(count, device_ids=self._device_ids.copy(row_ids, count))
        # The copies first: the device runs them while the job's thread starts (which then may find
        # its flags written already).
        ids, ids_value, free_value, behind = self._device_ids.copy_flagged(row_ids, count)
        self._stats.helper_lookups += 1
        self._stats.behind_copy += behind
        buffers = self.buffers
        job = self.table._stage_when(self._device_ids.flags, ids_value, free_value, ids, self.num_resident,
                                     self._staging.slots[:count], buffers.host_index[:count], buffers.host_rows,
                                     self._staging.lookup_threads(count), self._device_ids.helper_copy)
        return PendingStart(count, device_ids=ids, job=job)

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
        if pending.device_ids is not None:
            # Raises the device's error, if any; after it both flags have landed, so a job ends.
            self._device_ids.landed.synchronize()
            stream = self.buffers.copy_stream if pending.job is not None else stream
            self._joined = self._staging.prepare(pending.device_ids, stream, pending.job, defer_copy=defer_copy)
        elif pending.future is not None:
            self._joined = pending.future.result()
        elif pending.error is not None:
            raise pending.error
        else:
            self._joined = pending.count
        return self._joined

    def drop(self) -> None:
        """Abandon the last start, if any (say, its forward pass failed before it was finished):
        its host work is stopped or waited for and its errors are dropped."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.future is not None:
            concurrent.futures.wait([pending.future])
        elif pending is not None and pending.job is not None:
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
        self.table = self._staging.table = table

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

    @property
    def output(self) -> torch.Tensor:
        """bf16 `(max_ids, values_per_row)`: the buffer `finish` returns views of."""
        return self.buffers.output

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
        buffers, graphs = self.buffers, self._graphs
        # Only an eager finish follows a deferring start or join (none runs while capturing).
        staging = self._staging
        deferred, staging.deferred_copy = staging.deferred_copy, None
        size = graphs.size_for(count)
        # With the copy deferred, one graph holds it, its waits and marks, and the device half:
        # replayed on the current stream without naming it (each lookup of it costs host time).
        with_copy = deferred is not None
        graph = graphs.graphs.get((size, with_copy))
        if with_copy and graph is not None:
            graph.replay()
            self._stats.graph_replays += 1
            return graphs.output_view(count)
        stream = stream or self._current_stream()
        if capturing or count == 0:
            if deferred is not None:
                buffers.launch_copy(deferred, stream)
                self._stats.host_copies += 1
            buffers.copied.wait(stream)
            values = self._index_and_decode(count)
            buffers.consumed.record(stream)
            return values
        if graph is None:
            graph = graphs.capture(size, with_copy, stream)
            self._stats.graph_captures += 1
        if not with_copy:
            buffers.copied.wait(stream)
        graph.replay()
        self._stats.graph_replays += 1
        if not with_copy:
            buffers.consumed.record(stream)
        return graphs.output_view(count)

    def _finish_in_one_call(self, count: int | None) -> torch.Tensor | None:
        """An eager finish of a small start from device ids in one call of the compiled helper
        (Table._stage_and_launch): the waits for its ids and for the span's last copy, its lookup,
        and the launch of the graph that copies its rows and decodes them, with no torch call for
        them (each costs host time on every step). None where that graph is not captured yet (the
        start still pending: the general path captures it) or the rows are not cached (then read
        here as `_join` does, and the general path replays the graph)."""
        pending, graphs = self._pending, self._graphs
        # Graphs are captured on a GPU only; the helper's launch needs its CUDA context.
        if pending is None or pending.device_ids is None or pending.job is not None or not graphs.execs \
                or self._device_ids.context is None:
            return None
        started = pending.count
        count = started if count is None else count
        graph = graphs.execs.get((graphs.size_for(count), True)) if 0 < started <= count <= self.capacity else None
        if graph is None:
            return None
        began = time.perf_counter()
        self._pending = None  # as in `_join`: a raised error leaves no start pending
        buffers, device_ids = self.buffers, self._device_ids
        disk, staged, launched = self.table._stage_and_launch(
            pending.device_ids, self.num_resident, self._staging.slots[:started], buffers.host_index[:started],
            buffers.host_rows, context=device_ids.context, events=(device_ids.landed_handle, device_ids.copied_handle),
            graph=graph, stream=device_ids.raw_stream())
        if not launched:  # looked up by that call: staged from here without a second lookup
            self._stats.lookups += 1
            self._joined = self._staging.prepare(pending.device_ids, None, outcome=(disk, staged), defer_copy=True)
            return None
        self._staging.one_call_done(started, disk, began)
        return self._graphs.output_view(count)

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
