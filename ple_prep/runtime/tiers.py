"""Resident and disk tiers: the leading slots held in RAM, the rest read on demand (the GPU's
resident tier is EmbeddingSource's, runtime/device/buffers.py, which loads it with
`read_leading_slots`).

The file's leading slots are its hottest rows when it has an access-ordered layout (and merely its
first rows in source order otherwise), so a budget of B bytes keeps the B // row_bytes rows most
likely to be asked for. A lookup splits a request by tier; the merge writes every output position
exactly once, from the tier that holds its row, so no position can keep an earlier request's row.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..core.fileio import read_exactly
from ..format.header import Header
from ..format.pages import pages_for, slot_offset
from .gather import Gatherer

# Bytes read per positioned read while loading the resident tier (through the file descriptor,
# so the kernel's sequential readahead applies, which the mapping's MADV_RANDOM turns off).
LOAD_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass
class Resident:
    """Slots [0, num_slots) of a table as uint8 rows `(num_slots, row_bytes)` in RAM."""

    num_slots: int
    rows: np.ndarray


@dataclasses.dataclass
class Lookup:
    """Where each requested position's row comes from. Positions index the request."""

    resident_positions: np.ndarray  # int64
    resident_slots: np.ndarray      # int64, rows of the resident tier
    disk_positions: np.ndarray      # int64
    disk_rows: np.ndarray           # uint8 (len(disk_positions), row_bytes), request order


def load_resident(descriptor: int, name: str, header: Header, budget_bytes: int) -> Resident:
    """Copy the leading slots of the table open at `descriptor` (`name` in messages) that fit in
    `budget_bytes` into RAM."""
    if budget_bytes < 0:
        raise ValueError("budget_bytes must be >= 0")
    num_slots = int(min(header.num_rows, budget_bytes // header.row_bytes))
    rows = np.empty((num_slots, header.row_bytes), dtype=np.uint8)

    def put(start: int, chunk: np.ndarray) -> None:
        rows[start:start + len(chunk)] = chunk

    read_leading_slots(descriptor, name, header, num_slots, put)
    return Resident(num_slots, rows)


def read_leading_slots(descriptor: int, name: str, header: Header, num_slots: int, put) -> None:
    """Read slots [0, num_slots) of the table open at `descriptor` page-chunk by chunk, dropping page
    padding, and `put(first_slot, rows)` them."""
    pages_per_chunk = max(1, LOAD_CHUNK_BYTES // header.page_size)
    rows_per_chunk = pages_per_chunk * header.rows_per_page
    buffer = np.empty((pages_per_chunk, header.page_size), dtype=np.uint8)
    used = header.rows_per_page * header.row_bytes
    for start in range(0, num_slots, rows_per_chunk):
        count = min(rows_per_chunk, num_slots - start)
        pages = pages_for(count, header.rows_per_page)
        read_exactly(descriptor, memoryview(buffer[:pages]).cast("B"), slot_offset(header, start), name)
        put(start, np.ascontiguousarray(buffer[:pages, :used]).reshape(-1, header.row_bytes)[:count])


def split(slots: np.ndarray, resident: Resident | None, gatherer: Gatherer) -> Lookup:
    """Positions of `slots` (int64) served by the resident tier, and the rest gathered from disk."""
    num_slots = resident.num_slots if resident is not None else 0
    in_memory = slots < num_slots
    resident_positions = np.flatnonzero(in_memory)
    disk_positions = np.flatnonzero(~in_memory)
    disk_rows = gatherer.gather_slots(slots[disk_positions])
    return Lookup(resident_positions, slots[resident_positions], disk_positions, disk_rows)


def merge(lookup: Lookup, resident: Resident | None, out: np.ndarray) -> None:
    """Write each position of `out` once: resident rows from the resident tier, the rest from disk."""
    if len(lookup.resident_positions):
        out[lookup.resident_positions] = resident.rows[lookup.resident_slots]
    out[lookup.disk_positions] = lookup.disk_rows
