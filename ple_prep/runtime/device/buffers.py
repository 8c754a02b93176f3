"""EmbeddingSource's buffers: one device buffer holding the resident tier, the staging rows and the
tier index, and its pinned host mirror that one copy carries to the device."""
from __future__ import annotations

import numpy as np
import torch

from ..tiers import read_leading_slots


class DeviceBuffersMixin:
    """The buffer layout of EmbeddingSource (source.py)."""

    def _allocate_buffers(self) -> None:
        """The tiers, the span, the index and their host views; the resident rows read in."""
        table = self.table
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
            self._allocate_device_ids(capacity)
        else:
            # On the CPU the host writes the span in place: there is nothing to copy.
            self._host_span = self._span
        self._host_rows = self._host_span[:capacity * row_bytes].view(capacity, row_bytes).numpy()
        self._host_index = self._host_span[self._index_at:].view(torch.int32).numpy()
        self._rows = torch.empty((capacity, row_bytes), dtype=torch.uint8, device=self.device)
        self.output = torch.empty((capacity, table.values_per_row), dtype=torch.bfloat16, device=self.device)
