"""The bounds every request is checked against before anything is allocated for it: integer ids
or slots, at most a table's `max_request_rows`, inside the table (docs/RELIABILITY.md, section 10)."""
from __future__ import annotations

import numpy as np

# The most rows one call may ask for unless the table is opened with another bound (the vLLM plugin
# sets it from vLLM's maximum tokens per step): 4 Mi rows, 640 MiB of 160-byte rows and 2.5 GiB of
# their float32 values; a larger request is refused before anything is allocated for it.
DEFAULT_MAX_REQUEST_ROWS = 1 << 22


def check_request(count: int, limit: int) -> None:
    """Refuse a request of more than `limit` rows: its buffers would be sized by the caller."""
    if count > limit:
        raise ValueError(f"a request of {count} rows is more than the {limit} one call may ask for "
                         f"(max_request_rows): split it, or open the table with a larger max_request_rows")


def checked_slots(slots, num_slots: int, limit: int) -> np.ndarray:
    """A caller's slots as a flat int64 array, refused as row ids are: TypeError if not integers,
    ValueError past `limit`, IndexError outside [0, num_slots) (as the compiled copy raises)."""
    slots = np.asarray(slots)
    if slots.dtype.kind not in "iu":
        raise TypeError(f"slots must be integers, not {slots.dtype}")
    check_request(slots.size, limit)
    slots = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
    check_slot_range(slots, num_slots)
    return slots


def check_slot_range(slots: np.ndarray, num_slots: int) -> None:
    """IndexError for a slot outside [0, num_slots)."""
    if len(slots):
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_slots:
            raise IndexError(f"slot {low if low < 0 else high} is outside the table's {num_slots} slots")
