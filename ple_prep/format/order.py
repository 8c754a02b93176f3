"""The row order: which table row sits in which slot of the prepared file.

The first `num_placed` slots hold chosen rows (the hot ones) in the order given; every other row
follows in source order. Only the placed rows are stored, so the map costs 12 bytes per placed row
and nothing for the rest: slot = num_placed + row - (placed rows below it).
"""
from __future__ import annotations

import functools

import numpy as np

from ..core.constants import ORDER_DTYPE
from ..core.errors import BadInput


class RowOrder:
    def __init__(self, num_rows: int, slot_rows: np.ndarray, sorted_rows: np.ndarray,
                 sorted_slots: np.ndarray):
        self.num_rows = num_rows
        self.slot_rows = slot_rows
        self.sorted_rows = sorted_rows
        self.sorted_slots = sorted_slots

    @property
    def num_placed(self) -> int:
        return len(self.slot_rows)

    @property
    def is_identity(self) -> bool:
        return bool(np.array_equal(self.slot_rows, np.arange(self.num_placed)))

    @classmethod
    def identity(cls, num_rows: int) -> "RowOrder":
        empty = np.zeros(0, dtype=ORDER_DTYPE)
        return cls(num_rows, empty, empty, empty)

    @classmethod
    def from_placed(cls, placed_rows: np.ndarray, num_rows: int) -> "RowOrder":
        """Rows to put first, in slot order; they must be distinct and inside the table."""
        placed = np.asarray(placed_rows, dtype=np.int64).reshape(-1)
        if len(placed) and (placed.min() < 0 or placed.max() >= num_rows):
            raise BadInput(f"placed row outside the table of {num_rows} rows")
        by_row = np.argsort(placed, kind="stable")
        sorted_rows = placed[by_row]
        if np.any(sorted_rows[1:] == sorted_rows[:-1]):
            raise BadInput("a row is placed twice")
        return cls(num_rows, placed.astype(ORDER_DTYPE), sorted_rows.astype(ORDER_DTYPE),
                   by_row.astype(ORDER_DTYPE))

    def to_bytes(self) -> bytes:
        return self.slot_rows.tobytes() + self.sorted_rows.tobytes() + self.sorted_slots.tobytes()

    @classmethod
    def from_buffer(cls, buffer, num_placed: int, num_rows: int, name: str = "file") -> "RowOrder":
        """Views over a stored map, checked so that no lookup can leave the table."""
        arrays = [np.frombuffer(buffer, dtype=ORDER_DTYPE, count=num_placed, offset=4 * i * num_placed)
                  for i in range(3)]
        slot_rows, sorted_rows, sorted_slots = arrays
        if num_placed:
            if (sorted_rows[-1] >= num_rows or np.any(sorted_rows[1:] <= sorted_rows[:-1])
                    or sorted_slots.max() >= num_placed
                    or not np.array_equal(slot_rows[sorted_slots], sorted_rows)):
                raise BadInput(f"{name}: the row-order map is inconsistent (corrupt file)")
        return cls(num_rows, slot_rows, sorted_rows, sorted_slots)

    def slot_of(self, rows: np.ndarray) -> np.ndarray:
        """File slot of each local row id (int64, ids already checked to be in range)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.num_placed:
            return rows.copy()
        position = np.searchsorted(self.sorted_rows, rows)
        clipped = np.minimum(position, self.num_placed - 1)
        placed = self.sorted_rows[clipped] == rows
        return np.where(placed, self.sorted_slots[clipped].astype(np.int64),
                        self.num_placed + rows - position)

    def rows_at(self, start: int, stop: int) -> np.ndarray:
        """Local row ids held by slots [start, stop), int64."""
        slots = np.arange(start, stop, dtype=np.int64)
        rows = np.empty(len(slots), dtype=np.int64)
        head = slots < self.num_placed
        rows[head] = self.slot_rows[slots[head]]
        # The k-th unplaced row is k plus the number of placed rows at or below it.
        rank = slots[~head] - self.num_placed
        rows[~head] = rank + np.searchsorted(self._unplaced_below, rank, side="right")
        return rows

    @functools.cached_property
    def _unplaced_below(self) -> np.ndarray:
        """For each placed row in ascending order, how many unplaced rows come before it."""
        return self.sorted_rows.astype(np.int64) - np.arange(self.num_placed)
