"""The PLE layer's input as a torch tensor: row ids on the device in, bf16 values out.

    from ple_prep.runtime import open_table
    from ple_prep.runtime.torch import EmbeddingSource

    source = EmbeddingSource(open_table("/nvme/ple.bin"), device="cuda",
                             resident_bytes=2 << 30, max_tokens=4096)
    values = source(row_ids)   # row_ids: (T, 16) or flat, on the device -> bf16 (T, 2560)

Resident rows (the file's leading slots, the hottest with an access-ordered layout) live on the
device next to a staging area; the row-to-slot map lives there too, so the device finds every id's
slot. Only the distinct slots travel to the host, which gathers each distinct disk row once into a
pinned buffer; one non-blocking copy puts them in the staging area, and one index on the device
picks each position's row from exactly one tier before decoding. The returned tensor is a view of a
buffer allocated once, so a captured CUDA graph can read it; each call overwrites it.

Imported only when asked: needs torch (`pip install 'ple-prep[torch]'`).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .table import Table
from .tiers import read_leading_slots
from .torch_dequant import decoder_for


class _Clock:
    """Seconds per stage of one call, the device synchronised at each mark (profiling only)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stages[name] = now - self._last
        self._last = now


class EmbeddingSource:
    """bf16 `(T, heads * values_per_row)` PLE values for row ids, from a resident and a disk tier."""

    def __init__(self, table: Table, *, device: str | torch.device = "cuda",
                 resident_bytes: int = 0, max_tokens: int = 4096, heads: int = 16):
        self.table = table
        # Resolved ('cuda' -> 'cuda:0') so it compares equal to the devices of tensors.
        self.device = torch.empty(0, device=device).device
        self.heads = heads
        self.max_rows = max_tokens * heads
        self.num_resident = int(min(table.num_rows, max(0, resident_bytes) // table.row_bytes))
        row_bytes = table.row_bytes
        # Slots [0, num_resident) hold the resident rows; the rest is the staging area for disk
        # rows of one call, so one index picks every position's row from its tier.
        self._tiers = torch.empty((self.num_resident + self.max_rows, row_bytes), dtype=torch.uint8,
                                  device=self.device)

        def put(start: int, chunk: np.ndarray) -> None:
            self._tiers[start:start + len(chunk)].copy_(torch.from_numpy(chunk))

        read_leading_slots(table.path, table.header, self.num_resident, put)
        order = table.order
        self._num_placed = order.num_placed
        self._sorted_rows = torch.from_numpy(order.sorted_rows.astype(np.int64)).to(self.device)
        self._sorted_slots = torch.from_numpy(order.sorted_slots.astype(np.int64)).to(self.device)
        pin = self.device.type == "cuda"
        self._slots_host = torch.empty(self.max_rows, dtype=torch.int64, pin_memory=pin)
        self._staging = torch.empty((self.max_rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._rows = torch.empty((self.max_rows, row_bytes), dtype=torch.uint8, device=self.device)
        self.output = torch.empty((self.max_rows, table.values_per_row), dtype=torch.bfloat16,
                                  device=self.device)
        self._decoder = decoder_for(table.encoding, table.values_per_row, table.scale, self.device)
        self._distinct = torch.empty(self.max_rows, dtype=torch.int64, device=self.device)
        self._count_host = torch.empty(1, dtype=torch.int64, pin_memory=pin)
        # Distinct rows the last call read from the disk tier.
        self.last_disk_rows = 0
        # With profile on, each call synchronises after every stage and records its seconds.
        self.profile = False
        self.last_stages: dict[str, float] = {}

    def slot_of(self, local: torch.Tensor) -> torch.Tensor:
        """File slot of each local row id, on the device (as `RowOrder.slot_of`)."""
        if not self._num_placed:
            return local.clone()
        position = torch.searchsorted(self._sorted_rows, local)
        clipped = position.clamp(max=self._num_placed - 1)
        placed = self._sorted_rows[clipped] == local
        return torch.where(placed, self._sorted_slots[clipped], self._num_placed + local - position)

    def __call__(self, row_ids: torch.Tensor) -> torch.Tensor:
        """bf16 `(T, heads * values_per_row)`: a view of `output`, valid until the next call."""
        flat = row_ids.reshape(-1)
        count = flat.numel()
        if count % self.heads:
            raise ValueError(f"{count} row ids is not a whole number of tokens of {self.heads} heads")
        if count > self.max_rows:
            raise ValueError(f"{count} row ids exceed max_tokens * heads = {self.max_rows}")
        if flat.device != self.device:
            raise ValueError(f"row ids are on {flat.device}, this source serves {self.device}")
        clock = _Clock(self.device) if self.profile else None
        if not count:
            return self.output[:0].view(0, self.heads * self.table.values_per_row)
        local = flat.to(torch.int64) - self.table.first_row
        outside = (local < 0) | (local >= self.table.num_rows)
        slots = torch.where(outside, -1, self.slot_of(local.clamp(0, self.table.num_rows - 1)))
        # Distinct slots, ascending (bad ids, resident, then disk rows), by one sort on the device;
        # only they cross to the host, which reads each distinct disk row once, in address order.
        sorted_slots, order = torch.sort(slots)
        is_first = torch.ones(count, dtype=torch.bool, device=self.device)
        torch.ne(sorted_slots[1:], sorted_slots[:-1], out=is_first[1:])
        rank = torch.cumsum(is_first, 0) - 1
        inverse = torch.empty_like(rank).scatter_(0, order, rank)
        distinct = self._distinct[:count].scatter_(0, rank, sorted_slots)
        self._slots_host[:count].copy_(distinct, non_blocking=True)
        self._count_host.copy_(rank[-1:] + 1, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if clock:
            clock.mark("slots_on_device_to_host")
        unique_count = int(self._count_host[0])
        host = self._slots_host[:unique_count].numpy()
        if host[0] < 0:
            bad = flat[(slots < 0).nonzero()[0, 0]].item()
            first, stop = self.table.row_range
            raise IndexError(f"row id {bad} is outside this table's rows [{first}, {stop})")
        first_disk = int(np.searchsorted(host, self.num_resident))
        disk = unique_count - first_disk
        self.last_disk_rows = disk
        if disk:
            self.table.gather_slots(host[first_disk:], out=self._staging[:disk].numpy())
            if clock:
                clock.mark("host_gather")
            self._tiers[self.num_resident:self.num_resident + disk].copy_(self._staging[:disk],
                                                                           non_blocking=True)
            if clock:
                clock.mark("host_to_device")
        # Each position reads one tier: its resident slot, or its distinct disk row's staging place.
        source = torch.where(slots < self.num_resident, slots,
                             inverse + (self.num_resident - first_disk))
        rows = self._rows[:count]
        torch.index_select(self._tiers, 0, source, out=rows)
        if clock:
            clock.mark("tier_index")
        values = self.output[:count]
        self._decoder(rows, out=values)
        if clock:
            clock.mark("decode")
            self.last_stages = clock.stages
        return values.view(count // self.heads, self.heads * self.table.values_per_row)
