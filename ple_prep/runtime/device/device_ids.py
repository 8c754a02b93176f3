"""Ids given on the device: their copy to pinned memory, the two pinned flags a helper thread of the
compiled runtime waits for (runtime/native/jobs.c), and a small request's finish in one call."""
from __future__ import annotations

import time

import numpy as np
import torch

from .driver import device_context, queue_ids_copy
from .graphs import INLINE_IDS

# Values the device writes into the pinned flags of a start from device ids, in turn (never 0).
FLAG_VALUES = 256


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


class DeviceIdsMixin:
    """EmbeddingSource's start from device ids (source.py builds the buffers it uses)."""

    def _allocate_device_ids(self, capacity: int) -> None:
        """The pinned ids and flags, the events and the raw handles of a CUDA source's device ids."""
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
        # (device/driver.py), and a large request's staged rows to the device by the helper's
        # thread (Table.stage_when). They wait on and record these events, which must exist
        # first (torch creates an event at its first record).
        self._consumed.record()
        self._copied.record(self._copy_stream)
        self._ids_landed.record()
        self._context = device_context(self.device.index) if self.table.compiled else None
        # The raw handles and addresses of every step's driver calls, read once: each torch
        # accessor costs the H200's host up to a microsecond.
        self._ids_landed_handle, self._copied_handle = self._ids_landed.cuda_event, self._copied.cuda_event
        self._device_ids_address, self._flags_address = self._device_ids.data_ptr(), self._flags.data_ptr()
        self._device_copy = None if self._context is None else (
            self._context, self._copy_stream.cuda_stream, self._consumed.cuda_event, self._copied_handle,
            self._span.data_ptr())

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

