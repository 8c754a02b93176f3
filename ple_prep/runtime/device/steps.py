"""A model step's PLE lookup that the device starts and waits for itself: one CUDA graph can hold it.

    from ple_prep.runtime.device.steps import StepLookup

    lookup = StepLookup(table, device="cuda", resident_bytes=2 << 30, max_ids=4096 * 16)
    lookup.start(ids)            # int64 ids on the device: queues stream work only, returns at once
    ...                          # decoder layer 0 on the device
    values = lookup.finish()     # queues stream work only: bf16 (len(ids), values_per_row)
    lookup.check()               # raises the error of a step that failed (an id outside the table, I/O)

`start` queues the copy of the ids into pinned memory and the write of their count into a pinned
flag (REQUEST). A thread of the compiled runtime (runtime/native/steps.c)
waits for that flag, finds each id's slot, stages the disk-tier rows and the tier index into
pinned memory (the rows copied from the page cache where they are there, else read from the file
with O_DIRECT, runtime/native/disk_reads.c), without ever taking the GIL and without any CUDA
call, and stores 1 into a second flag (READY). The device's fetch waits for READY, resets it and
copies the staged span (as many rows as the step has ids, and their index: a size fixed by the
count, so a graph holds it). Up to `kernel_max_ids` ids (a decode step's), two small kernels do that
(runtime/native/step_kernels.cu): the first stores the ids and the request, the second marks the
device's arrival (ARRIVED), waits for READY and copies the span with its own loads, with no memory
operation or copy engine to pay for (docs/RUNTIME.md, "Kernels for small steps"); both go on the
caller's stream, the second queued by finish.
Larger steps go through stream memory operations and the copy engine: where the step's finish is
queued eagerly or in the same CUDA graph, start queues the fetch too, on the side stream, and finish
marks the arrival and joins it; else (a piecewise graph may end between start and finish, and a
capture may not end with a side stream unjoined) start queues only the request on the current stream
and finish queues the arrival and the fetch there. The arrival is marked before the device waits, so
a step whose rows were not ready is counted late in every mode. `finish` queues the index
and decode into `output`.
Only the thread's host store releases a wait (docs/RUNTIME.md, "A step in one CUDA graph", why).
Neither call waits on the host or depends on the host's state of the step, so the same calls run
eagerly, inside breakable piecewise graphs and inside one FULL graph replayed with new ids every
step. If the thread is late the device waits at the fetch only. A failed step's positions read a
poison row, which decodes to NaN everywhere, never a stale or a wrong row; the error is kept for
`check` (called by the next `start`; `pending_error` reads it without taking it). On the CPU the
host does the device's part (the caller stores and waits for the flags), through the same thread.
Disk-tier rows not in the page cache come from the table's host cache (runtime/hostcache.py, under
its own lock, never the GIL), the others are read from the file and admitted into it, which
`Table.read_ahead` fills too (docs/RUNTIME.md, "Host cache and read-ahead").
A step whose reads make no progress for `read_timeout` fails (ReadTimeout at `check`); the thread
abandons the stuck reads with their buffer and serves the next step (docs/RELIABILITY.md, section 10).
With a `failure_record` (runtime/failure_record.py) the thread also writes the first failure there,
before it releases that step, for another process to raise.
"""
from __future__ import annotations

import os
import time
import weakref

import numpy as np
import torch

from ...core.fileio import on_block_file_system, reopen_direct
from ..failure_record import FailureRecord, step_failure_error
from ..readcheck import DEFAULT_READ_TIMEOUT, capped_depth, check_timeout
from ..table import Table
from .buffers import DeviceBuffers, PickAndDecode, poison_row
from .driver import load_step_kernels, raw_stream_of
from .graphs import GraphCache
from .staging import LOOKUP_PART_IDS, LOOKUP_THREADS

try:
    from .. import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

# The flags' words (runtime/native/steps.c), a cache line apart.
REQUEST, ARRIVED, READY, FAILED, FLAG_WORDS = 0, 16, 32, 48, 64
# On the CPU `finish` waits for the thread at most this long before it gives up on the step.
HOST_WAIT_SECONDS = 120.0
# Cold reads the service thread keeps in flight (O_DIRECT, native AIO), as the runtime's DirectReader
# keeps: at 64 a cold chunk was well behind the eager path (BENCHMARKS.md, "Serving inside vLLM's
# CUDA graphs").
READ_DEPTH = 512
# Up to this many ids (4 tokens) a step goes through the step kernels (runtime/native/step_kernels.cu),
# more through the side stream and the copy engine, beside the work before the finish: from 256 ids
# the kernels' step is 1-3% slower (BENCHMARKS.md, "Serving inside vLLM's CUDA graphs").
KERNEL_MAX_IDS = 64
# A step's ids at most: with its one staging row more, under runtime/native/disk_reads.c's RANK_BITS.
MAX_IDS = (1 << 24) - 2


class StepLookup:
    """bf16 PLE values for row ids on a device, looked up without any host wait in the caller's calls."""

    def __init__(self, table: Table, *, device: str | torch.device = "cuda", resident_bytes: int = 0,
                 max_ids: int = 4096 * 16, read_timeout: float | None = None,
                 failure_record: FailureRecord | None = None):
        if _native is None:
            raise RuntimeError("StepLookup needs the compiled runtime helper (runtime/native/): reinstall "
                               "ple-prep where a C compiler is present")
        if not 1 <= max_ids <= MAX_IDS:
            raise ValueError(f"max_ids must be from 1 to {MAX_IDS}")
        self.capacity = int(max_ids)
        self.table = table
        # A cold read that makes no progress this long fails its step: the table's disk-tier
        # reader's timeout (open_table's read_timeout; a mapped table has none: the default) unless given.
        self.read_timeout = check_timeout(getattr(table._gatherer.direct, "timeout", DEFAULT_READ_TIMEOUT)
                                          if read_timeout is None else read_timeout)
        # Resolved ('cuda' -> 'cuda:0') so it compares equal to the devices of tensors.
        self.device = torch.empty(0, device=device).device
        self.num_resident = int(min(table.num_rows, max(0, resident_bytes) // table.row_bytes))
        # One staging row more than ids: the first is never staged into, and holds the poison row.
        self.buffers = buffers = DeviceBuffers(table, self.device, self.num_resident, self.capacity + 1)
        self.output = buffers.output
        self._cuda = buffers.cuda
        self._index_and_decode = PickAndDecode(table, buffers, self.device)
        self._poison = self.num_resident
        poison = torch.from_numpy(poison_row(table))
        buffers.tiers[self._poison].copy_(poison)
        self._host_index = buffers.host_index
        self._host_index[:] = self._poison  # what the device reads before the first step, in range
        buffers.host_rows[0] = poison.numpy()  # the staging row no step's fetch covers, for the CPU
        pin = self._cuda
        self._ids = torch.zeros(self.capacity + 1, dtype=torch.int64, pin_memory=pin)
        # The pinned host copy of a step's ids, which the service thread reads.
        self.host_ids = self._ids.numpy()
        self._slots = np.zeros(self.capacity + 1, dtype=np.int64)
        self._flags = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=pin)
        self._flags_array = self._flags.numpy()
        self._started: int | None = None
        self._started_beside = False  # the last start's copy went on the side stream
        self._owed_wait = False  # on the CPU, a step's wait timed out: its READY is still to come
        self._held_ids: torch.Tensor | None = None
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        # An eager finish's device half after the fetch, the index and decode, as CUDA graphs by size
        # (GraphCache keeps them), launched through their exec handles.
        self._graphs = GraphCache(buffers, self.device, self._index_and_decode)
        # The most ids a step may have to go through the step kernels (0: they are not loaded here).
        self.kernel_max_ids = 0
        handles = None
        if self._cuda:
            from .driver import device_context

            self._context = device_context(self.device.index)
            # A stream of its own beside the caller's for the ids' copy, the request and the fetch (torch
            # hands its pooled streams out again, to captures too); events: start's fork, finish's join.
            (self._side,), events = _native.step_handles(self._context, 1, 2)
            self._fork, self._done = events
            kernels = load_step_kernels(self._context)
            module, request_kernel, fetch_kernel = kernels or (0, 0, 0)
            handles = (self._context, (self._side,), events, (module,))  # destroyed with the service
            # The step kernels' two counters (runtime/native/step_kernels.cu), zero between steps, and the
            # word a dropped step's fetch writes its arrival into: a drop never reached the PLE layer.
            self._kernel_counters = torch.zeros(3, dtype=torch.int32, device=self.device)
            self.kernel_max_ids = min(KERNEL_MAX_IDS, self.capacity) if kernels else 0
            # The caller's current stream as a raw handle: a torch Stream object costs more to build
            # than the driver calls start and finish queue on it.
            self._current_stream = raw_stream_of(torch, self.device.index)
            flags = self._flags.data_ptr()
            self._flag_address = flags
            # What a step's start and fetch queue, held by the helper: a call passes only what changes.
            self._queue = _native.step_queue(self._side, self._fork, self._ids.data_ptr(), flags + 4 * REQUEST,
                                             flags + 4 * READY, flags + 4 * ARRIVED,
                                             buffers.span.data_ptr(), buffers.host_span.data_ptr(),
                                             buffers.capacity, buffers.row_bytes,
                                             buffers.index_at, request_kernel, fetch_kernel,
                                             self._kernel_counters.data_ptr(), self.kernel_max_ids)
            buffers.index[:] = self._poison
        header = table.header
        self.read_depth = capped_depth(READ_DEPTH, header.page_size)  # cold reads in flight at most
        self._descriptor = reopen_direct(table.descriptor)
        # The table's host cache (open_table's host_cache_bytes), which the thread reads and fills.
        tier = table.host_cache
        self.host_cache = tier.cache if tier is not None and tier.cache.handle is not None else None
        # Whether O_DIRECT reads complete inside io_submit here (FUSE: then the worker reads, within the
        # timeout's reach): as the table's O_DIRECT reader found; else only a block file system's AIO is trusted.
        synchronous = getattr(table._gatherer.direct, "synchronous", not on_block_file_system(self._descriptor))
        # With open_table's verify_reads, the thread checks each block it reads against the page sums too.
        page_check = getattr(table._gatherer.direct, "page_check", None)
        disk = (self._descriptor, header.data_offset, header.data_offset + header.num_pages * header.page_size,
                header.page_size, self.read_depth, self.read_timeout,
                None if self.host_cache is None else self.host_cache.handle, synchronous,
                None if page_check is None else page_check.sums)
        arguments = table._gatherer._stage_arguments(self.host_ids, table.order, table.first_row, self.num_resident,
                                                     self._slots, self._host_index, buffers.host_rows,
                                                     LOOKUP_THREADS)
        try:
            self._service = _native.step_service(self._flags_array, disk, self._poison,
                                                 (LOOKUP_THREADS, LOOKUP_PART_IDS), self._cuda,
                                                 None if failure_record is None else failure_record.buffer,
                                                 *arguments)
        except BaseException:
            os.close(self._descriptor)
            if handles:
                _native.drop_handles(*handles)
            raise
        # The thread stops when the lookup is closed or collected (or at exit), whichever comes first.
        self._stop = weakref.finalize(self, _stop_service, self._service, self._descriptor, handles)

    # --- the caller's calls: queued work only -------------------------------------------------

    def start(self, ids: torch.Tensor, *, finish_in_same_graph: bool = False) -> None:
        """Queue this step's lookup of `ids` (int64, any shape, on this lookup's device).
        `finish_in_same_graph`: during a capture, the caller's finish is captured in the same CUDA
        graph (a FULL graph), so start's copy may run beside the work between them; outside a
        capture it always does."""
        if self._owed_wait:  # on the CPU, a step whose wait timed out is waited for first
            self._wait_on_host(arrival=False)
        if self._flags_array[FAILED]:  # the thread kept a failure: a word read, not a call per step
            self.check()
        if self._started is not None:
            raise RuntimeError("start() called again before finish() or drop() of the previous start()")
        count = ids.numel()
        if ids.get_device() != self._device_index or ids.dtype is not torch.int64 or not 0 < count <= self.capacity:
            self._refuse(ids, count)
        self._started = count
        if not self._cuda:
            self.host_ids[:count] = ids.reshape(-1).numpy()
            self._flags_array[REQUEST] = count
            return
        if not ids.is_contiguous():  # read in row-major order, as the CPU's reshape does
            ids = ids.contiguous()
        # Held until finish has joined the copy to the caller's stream, so the allocator cannot hand
        # their memory to that stream's work before (ids.record_stream costs more than the calls).
        self._held_ids = ids
        # Beside the caller's work outside a capture, and in a capture whose graph holds the finish
        # (the compiled helper asks the driver whether the stream is being captured).
        self._started_beside = _native.queue_step_start(self._queue, self._current_stream(), ids.data_ptr(),
                                                        finish_in_same_graph, count)

    def _refuse(self, ids: torch.Tensor, count: int) -> None:
        """Raise why `ids` cannot be started."""
        if ids.get_device() != self._device_index:
            raise ValueError(f"ids on {ids.device}, this lookup serves {self.device}")
        if ids.dtype is not torch.int64:
            raise TypeError(f"row ids must be int64, not {ids.dtype}")
        raise ValueError(f"{count} row ids: this lookup takes 1 to max_ids = {self.capacity}")

    def finish(self, count: int | None = None) -> torch.Tensor:
        """Queue the wait for the last start's rows and their index and decode: bf16 (count,
        values_per_row), a view of `output` valid until the next finish. `count` defaults to the
        started ids. Outside a capture this launches one CUDA graph of the device half, captured
        once for the count rounded up to a power of two (each torch launch costs the host microseconds,
        a Triton launch from Python tens of them)."""
        if self._started is None:
            raise RuntimeError("finish() without a start()")
        started, self._started = self._started, None
        count = started if count is None else count
        if not self._cuda:
            self._wait_on_host()
            self.check()
            return self._index_and_decode(count)
        stream = self._current_stream()
        self._held_ids = None
        key = (self._graphs.size_for(count), False)
        launch = self._graphs.execs.get(key, 0)
        if self._started_beside:  # the arrival marked, the side stream joined, outside a capture the graph launched
            capturing = _native.queue_step_finish(stream, self._side, self._done, self._flag_address + 4 * ARRIVED,
                                                  launch)
        else:  # the arrival marked and the fetch queued, and outside a capture the graph launched
            capturing = _native.queue_step_fetch(self._queue, stream, launch, True, started)
        if capturing:
            return self._index_and_decode(count)
        if not launch:
            if key not in self._graphs.graphs:  # captured once per size, then launched by handle
                self._graphs.capture(*key, torch.cuda.current_stream(self.device))
            if key in self._graphs.execs:
                _native.launch_graph(self._graphs.execs[key], stream)
            else:  # a torch without graph exec handles
                self._graphs.graphs[key].replay()
        return self._graphs.output_view(count)

    def drop(self) -> None:
        """Abandon the last start if it was not finished (its forward pass failed before the PLE
        layer): its fetch is joined or queued, so the next step waits for its own rows (and a capture
        does not end with the side stream unjoined). On the CPU its error, if any, is dropped with it
        (on a GPU it is not known yet)."""
        if self._started is None:
            return
        started, self._started = self._started, None
        if not self._cuda:
            self._wait_on_host(arrival=False)
            _native.step_service_error(self._service, True)
            return
        stream = self._current_stream()
        if self._started_beside:
            _native.queue_step_finish(stream, self._side, self._done, 0, 0)
        else:
            _native.queue_step_fetch(self._queue, stream, 0, False, started)
        self._held_ids = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.start(ids)
        return self.finish()

    def check(self) -> None:
        """Raise the error of the first step that failed since the last check (the lookup serves
        the next steps afresh): IndexError for an id outside the table, OSError for a failed read,
        ReadTimeout (a TimeoutError) for a read that made no progress for `read_timeout` seconds."""
        failure = _native.step_service_error(self._service, True)
        if failure is not None:
            raise self._error_of(*failure)

    def pending_error(self) -> BaseException | None:
        """That error, without taking it (for a log line while the caller has not been told)."""
        failure = _native.step_service_error(self._service, False)
        return None if failure is None else self._error_of(*failure)

    def _error_of(self, kind: str, value: int, offset: int) -> BaseException:
        if kind == "id":
            try:
                self.table.slot_of(np.array([value], dtype=np.int64))
            except IndexError as error:
                return error
        return step_failure_error(kind, value, offset, name=self.table.path.name, read_timeout=self.read_timeout,
                                  capacity=self.capacity, path=self.table.path)

    def _wait_on_host(self, arrival: bool = True) -> None:
        """The CPU's stand-in for the device's wait: the arrival marked (not for a dropped step, which
        never reached the PLE layer), READY, then both reset. A wait that times out stays owed: the
        next `start` waits for that step first, or its READY would release the next step's wait
        with the old step's rows."""
        if arrival:
            self._flags_array[ARRIVED] = 1
        self._owed_wait = True
        deadline = time.monotonic() + HOST_WAIT_SECONDS
        while self._flags_array[READY] == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the PLE step service did not serve a step within {HOST_WAIT_SECONDS:.0f} s")
            time.sleep(20e-6)
        self._flags_array[READY] = 0
        self._flags_array[ARRIVED] = 0
        self._owed_wait = False

    # --- state -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts since the lookup was made (a later minus an earlier gives a window's): `starts`
        (steps) and their `ids`; positions served by each tier: `rows_resident` (on the device),
        `rows_page_cache` (disk-tier rows copied from the page cache), `rows_host_cache` (from the
        table's host cache), `rows_disk` (the others, read from the file), and `pages_read` (the
        blocks read for them, each once a step) with their `bytes_read`; `rows_read_ahead` (of the
        host cache's, rows read-ahead had brought: the read-ahead coverage is it over the disk
        tier's positions); `failed` steps; `late` steps (the device reached finish before the rows
        were ready: it waited at most `late_host_ns`, the thread's time on them); the thread's
        `host_ns` and the `copied_bytes` of the spans the device fetched."""
        counters = _native.step_service_stats(self._service)
        return {"starts": counters["steps"], "ids": counters["ids"],
                "rows_resident": counters["ids"] - counters["disk_positions"],
                "rows_page_cache": counters["cached_positions"],
                "rows_host_cache": counters["host_cache_positions"],
                "rows_disk": counters["disk_positions"] - counters["cached_positions"]
                - counters["host_cache_positions"],
                "rows_read_ahead": counters["read_ahead_positions"],
                "pages_read": counters["blocks_read"], "bytes_read": counters["bytes_read"],
                "failed": counters["failed_steps"],
                "late": counters["late_steps"],
                "late_host_ns": counters["late_host_ns"], "host_ns": counters["host_ns"],
                "copied_bytes": counters["copied_bytes"]}

    @property
    def reads_async(self) -> bool:
        """Whether the service thread reads cold rows with native AIO, many in flight; False: one
        pread at a time on a worker (native AIO refused, or reads completing inside io_submit: FUSE)."""
        return bool(_native.step_service_stats(self._service)["async_reads"])

    def close(self) -> None:
        """Stop the service thread (after the device's queued steps, which it still serves)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._stop()


def _stop_service(service, descriptor: int, handles) -> None:
    _native.step_service_stop(service)
    os.close(descriptor)
    if handles:
        _native.drop_handles(*handles)

