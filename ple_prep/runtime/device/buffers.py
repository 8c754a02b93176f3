"""The lookups' buffers (EmbeddingSource's and StepLookup's): one device buffer holding the resident
tier, the staging rows and the tier index, and the pinned host mirror of its span, which one copy
carries to the device; and the device half of a finish, which picks and decodes their rows."""
from __future__ import annotations

import numpy as np
import torch

from ..dequant import decode
from ..table import Table
from ..tiers import read_leading_slots
from .dequant import decoder_for
from .triton_gather import fp8_gather_for

# Byte patterns tried for the poison row, the first whose every value decodes to NaN is kept:
# FP8's 0x7F code, and the 16-bit NaN of BF16 rows and of the f16/fp8 block scales of the others.
_POISON_PATTERNS = (b"\x7f", b"\xc0\x7f", b"\x00\x7e", b"\xff")


class DeviceBuffers:
    """The device buffer [lead][resident rows][staging rows][pad][tier index, int32 per position].

    The staging rows fill from their end, so a call's disk rows and its index are one contiguous
    span (`span`, mirrored in pinned `host_span`): one copy. The lead keeps the span 16-byte
    aligned, as its pinned mirror is, so that the step kernels copy any part of it in 16-byte words
    (runtime/native/step_kernels.cu); the pad keeps the index 4-byte aligned. On the CPU the host
    writes the span in place and nothing is copied.

    tiers    uint8 (resident + capacity, row_bytes): the resident rows, then the staging rows
    index    int32 (capacity,): each position's row of `tiers`
    host_rows, host_index   numpy views of the pinned span: where the host stages a request
    rows     uint8 (capacity, row_bytes): the picked rows, for decoders that are not fused
    output   bf16 (capacity, values_per_row): what `finish` returns views of
    """

    def __init__(self, table: Table, device: torch.device, num_resident: int, capacity: int):
        rows, row_bytes = num_resident, table.row_bytes
        self.capacity, self.row_bytes = capacity, row_bytes
        lead = -rows * row_bytes % 16
        pad = -capacity * row_bytes % 4
        self.index_at = capacity * row_bytes + pad  # within the span
        span_bytes = self.index_at + 4 * capacity
        buffer = torch.empty(lead + rows * row_bytes + span_bytes, dtype=torch.uint8, device=device)
        self.tiers = buffer[lead:lead + (rows + capacity) * row_bytes].view(rows + capacity, row_bytes)
        self.span = buffer[lead + rows * row_bytes:]
        # Every index entry, also past a call's count, names a real tier row: a graph captured
        # for more positions than a replay's call has reads stale rows there, never outside.
        self.span[self.index_at:].zero_()
        self.index = self.span[self.index_at:].view(torch.int32)

        def put(start: int, chunk: np.ndarray) -> None:
            self.tiers[start:start + len(chunk)].copy_(torch.from_numpy(chunk))

        read_leading_slots(table.descriptor, table.path.name, table.header, rows, put)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host_span = torch.zeros(span_bytes, dtype=torch.uint8, pin_memory=True)
            self.copy_stream = torch.cuda.Stream(device)
            # External events: captured in a graph they become record/wait nodes on these events.
            # `copied` marks the end of the span's last copy, `consumed` the device's last read of
            # it. The compiled helper's driver calls wait on and record them, so they must exist
            # first (torch creates an event at its first record).
            self.copied = torch.cuda.Event(external=True)
            self.consumed = torch.cuda.Event(external=True)
            self.consumed.record()
            self.copied.record(self.copy_stream)
        else:
            self.host_span = self.span
        self.host_rows = self.host_span[:capacity * row_bytes].view(capacity, row_bytes).numpy()
        self.host_index = self.host_span[self.index_at:].view(torch.int32).numpy()
        self.rows = torch.empty((capacity, row_bytes), dtype=torch.uint8, device=device)
        self.output = torch.empty((capacity, table.values_per_row), dtype=torch.bfloat16, device=device)

    def span_of(self, disk: int, count: int) -> tuple[int, int]:
        """Bytes [low, high) of the span a request of `count` positions with `disk` staged rows uses
        (runtime/native/memops.c computes the same for a step lookup's fetch)."""
        return (self.capacity - disk) * self.row_bytes, self.index_at + 4 * count

    def launch_copy(self, span: tuple[int, int], stream) -> None:
        """Bytes [low, high) of the pinned span to the device span, on `stream`, once the last
        finish has read the device span; `copied` marks its end."""
        stream.wait_event(self.consumed)
        low, high = span
        if stream is self.copy_stream:
            with torch.cuda.stream(stream):
                self.span[low:high].copy_(self.host_span[low:high], non_blocking=True)
        else:  # the caller's current stream, or a capture's
            self.span[low:high].copy_(self.host_span[low:high], non_blocking=True)
        self.copied.record(stream)


class PickAndDecode:
    """The device half of a finish: each position's row picked from `buffers.tiers` by
    `buffers.index` and decoded into `buffers.output`; calling it only launches kernels, so it can
    be captured in a CUDA graph. FP8 on a GPU with Triton does both in one kernel, compiled here so
    that no capture compiles it: `fused(tiers, index, out)`, None elsewhere."""

    def __init__(self, table: Table, buffers: DeviceBuffers, device: torch.device):
        self._buffers = buffers
        self._decoder = decoder_for(table.encoding, table.values_per_row, table.scale, device)
        self.fused = fp8_gather_for(self._decoder, table.row_bytes, device)
        if self.fused is not None:
            self.fused(buffers.tiers, buffers.index[:1], buffers.output[:1])

    @property
    def kernel(self) -> str:
        """"fused" (one Triton kernel) or "torch" (an index, then the encoding's torch decoder)."""
        return "torch" if self.fused is None else "fused"

    def __call__(self, count: int) -> torch.Tensor:
        """bf16 (count, values_per_row): a view of `output`."""
        buffers = self._buffers
        values = buffers.output[:count]
        if self.fused is not None:
            self.fused(buffers.tiers, buffers.index[:count], values)
            return values
        rows = torch.index_select(buffers.tiers, 0, buffers.index[:count], out=buffers.rows[:count])
        self._decoder(rows, out=values)
        return values


def poison_row(table: Table) -> np.ndarray:
    """A row of the table's encoding whose values all decode to NaN (refused if none is found): the
    tier row a failed step's index names at every position."""
    for pattern in _POISON_PATTERNS:
        row = np.frombuffer(pattern * table.row_bytes, dtype=np.uint8)[:table.row_bytes].copy()
        values = decode(table.header.encoding, row.reshape(1, -1), table.values_per_row, table.scale)
        if np.isnan(values).all():
            return row
    raise ValueError(f"no poison row found for {table.encoding} rows")
