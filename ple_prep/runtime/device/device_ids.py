"""Ids given on the device: their copy to pinned memory and the two pinned flags a helper thread of
the compiled runtime waits for (runtime/native/jobs.c) before it looks them up.

flags[0] gets a value once the ids have landed (the same stream, so in that order); flags[1] one
once the device's last read of the pinned span is done, when that read may still be running.
Values cycle through 1..FLAG_VALUES (never 0), so a job waits for this start's value, not an
earlier one's.
"""
from __future__ import annotations

import numpy as np
import torch

from .buffers import DeviceBuffers
from .driver import device_context, queue_ids_copy, raw_stream_of

FLAG_VALUES = 256


class DeviceIds:
    """The pinned ids and flags of one source, the events marking them, and the raw handles and
    addresses of the driver calls that copy them (read once: each torch accessor costs host time)."""

    def __init__(self, buffers: DeviceBuffers, device: torch.device, compiled: bool):
        self._buffers = buffers
        capacity = buffers.capacity
        self.pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.pinned_array = self.pinned.numpy()
        self._flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        self.flags = self._flags.numpy()
        # One-element views made once: slicing costs more than the copy's launch.
        self._free_flag = self._flags[1:2]
        self._flag_values = torch.arange(1, FLAG_VALUES + 1, dtype=torch.int32, device=device)
        self._flag_sources = [self._flag_values[k:k + 1] for k in range(FLAG_VALUES)]
        self._written = 0
        self._ready = torch.cuda.Event()
        self.landed = torch.cuda.Event()
        self.landed.record()  # recorded by the driver calls later: it must exist first
        # With the compiled helper, ids are copied by driver calls (device/driver.py), and a large
        # request's staged rows go to the device by the helper's thread (Table._stage_when).
        self.context = device_context(device.index) if compiled else None
        self.raw_stream = raw_stream_of(torch, device.index)
        self.landed_handle, self.copied_handle = self.landed.cuda_event, buffers.copied.cuda_event
        self._pinned_address, self._flags_address = self.pinned.data_ptr(), self._flags.data_ptr()
        self.helper_copy = None if self.context is None else (
            self.context, buffers.copy_stream.cuda_stream, buffers.consumed.cuda_event, self.copied_handle,
            buffers.span.data_ptr())

    def copy(self, row_ids: torch.Tensor, count: int) -> np.ndarray:
        """Queue the copy of `row_ids` into pinned memory on the current stream (no flag: the
        lookup runs at join); the pinned ids, valid once `landed` has completed."""
        self._copy(row_ids, count, None)
        return self.pinned_array[:count]

    def copy_flagged(self, row_ids: torch.Tensor, count: int) -> tuple[np.ndarray, int, int, bool]:
        """Queue the copy of `row_ids` and the flags a helper thread's job waits for: (the pinned
        ids, ids_value, free_value, whether they wait behind the span's last copy). Usually that
        copy has run (its finish waited for it): then the ids and their flag go on the caller's
        stream and free_value is -1 (not waited for); else, on the side stream, the flags land
        after that copy, in the order written."""
        buffers = self._buffers
        behind = not buffers.copied.query()
        free_value = self._next_value() if behind else -1
        ids_value = self._next_value()
        if not behind:
            self._copy(row_ids, count, ids_value)
        else:
            self._ready.record()
            stream = buffers.copy_stream
            stream.wait_event(self._ready)
            row_ids.record_stream(stream)  # the caller may free its tensor before the copy has run
            with torch.cuda.stream(stream):
                stream.wait_event(buffers.copied)
                self._free_flag.copy_(self._flag_sources[free_value - 1], non_blocking=True)
                self._copy(row_ids, count, ids_value)
        return self.pinned_array[:count], ids_value, free_value, behind

    def _copy(self, row_ids: torch.Tensor, count: int, ids_value: int | None) -> None:
        """The ids' copy (any shape: a contiguous tensor's bytes are its ids in order), then, for a
        helper thread's job, the flag that says they landed; `landed` marks them."""
        if self.context is None:  # no compiled helper, so no helper thread and no flag: torch's copy
            self.pinned[:count].copy_(row_ids.reshape(-1), non_blocking=True)
            self.landed.record()
            return
        if row_ids.dtype is not torch.int64 or not row_ids.is_contiguous():
            row_ids = row_ids.to(torch.int64).contiguous()
        flag_source = 0 if ids_value is None else self._flag_values.data_ptr() + 4 * (ids_value - 1)
        queue_ids_copy(self.context, self.raw_stream(), self.landed_handle, self._pinned_address,
                       row_ids.data_ptr(), 8 * count, self._flags_address, flag_source)

    def _next_value(self) -> int:
        self._written += 1
        return self._written % FLAG_VALUES + 1
