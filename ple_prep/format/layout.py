"""A table's layout as the writer takes it: the row order, the manifest's `layout` entry describing
how it was planned, and the residency hints measured on it (docs/FORMAT.md)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .order import RowOrder


@dataclasses.dataclass(frozen=True)
class TableLayout:
    order: RowOrder
    # The manifest's `layout` entry; None writes {"kind": "source-order", "num_placed": ...}.
    entry: dict[str, Any] | None = None
    residency: tuple[dict[str, Any], ...] = ()
