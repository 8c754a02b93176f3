"""Open a prepared table: validate it against its manifest, map it, and hand out rows."""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..core.constants import HEADER_SIZE
from ..core.errors import BadInput
from ..format.header import Header
from ..format.manifest import load_manifest, manifest_path
from ..format.order import RowOrder
from .dequant import decode
from .gather import DEFAULT_WINDOW_BYTES, DEFAULT_WINDOW_PAGES, Gatherer
from .tiers import Lookup, Resident, load_resident, merge, split

# Header fields that must agree with the manifest's, or the pair does not belong together.
_MATCHED_FIELDS = ("page_size", "row_bytes", "rows_per_page", "values_per_row", "num_rows",
                   "first_row", "data_offset", "file_size")


class Table:
    """A prepared PLE table mapped copy-on-write; ids are the model's global row ids."""

    def __init__(self, path: Path, manifest: dict[str, Any], header: Header, mapping: mmap.mmap,
                 window_pages: int = DEFAULT_WINDOW_PAGES, window_bytes: int = DEFAULT_WINDOW_BYTES):
        self.path = path
        self.manifest = manifest
        self.header = header
        self._mapping = mapping
        self.num_rows = header.num_rows
        self.first_row = header.first_row
        self.row_bytes = header.row_bytes
        self.values_per_row = header.values_per_row
        self.page_size = header.page_size
        self.rows_per_page = header.rows_per_page
        self.encoding = header.encoding.label
        scale = manifest["scale"]
        self.scale: float | None = None if scale is None else float(scale["value"])
        # The map starts at order_offset, not at the file's first byte.
        self.order = RowOrder.from_buffer(memoryview(mapping)[header.order_offset:header.data_offset],
                                          header.num_placed, header.num_rows, path.name) \
            if header.num_placed else RowOrder.identity(header.num_rows)
        self._gatherer = Gatherer(mapping, header, window_pages, window_bytes)
        self._resident: Resident | None = None

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._gatherer.close()
        self._resident = None
        self.order = None
        try:
            self._mapping.close()
        except BufferError:
            # A caller still holds a view; the mapping goes when the last view does.
            pass

    @property
    def row_range(self) -> tuple[int, int]:
        """Global row ids this file holds: [first, stop)."""
        return self.first_row, self.first_row + self.num_rows

    @property
    def tensor_parallel(self) -> dict[str, int] | None:
        """{"rank", "size"} for a file written by `convert --tp-size`, else None."""
        return self.manifest.get("tensor_parallel")

    def _local(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, not {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        local = ids - self.first_row
        # One pass checks both ends: seen as unsigned, a negative local id is above any row count.
        if len(local) and local.view(np.uint64).max() >= self.num_rows:
            bad = ids[(local < 0) | (local >= self.num_rows)][0]
            first, stop = self.row_range
            raise IndexError(f"row id {bad} is outside this table's rows [{first}, {stop})")
        return local

    def slot_of(self, ids: np.ndarray) -> np.ndarray:
        """Position of each row in the file's slot order (int64)."""
        local = self._local(ids)
        # In source order a slot is the local id, and `local` is already a fresh array.
        return self.order.slot_of(local) if self.order.num_placed else local

    def page_of(self, ids: np.ndarray) -> np.ndarray:
        """Index of the file page (counted from the data region) holding each row."""
        return self.slot_of(ids) // self.rows_per_page

    @property
    def window_pages(self) -> int:
        """Distinct pages kept under MADV_WILLNEED ahead of a cold gather's copy; 0: no advice."""
        return self._gatherer.window_pages

    @window_pages.setter
    def window_pages(self, pages: int) -> None:
        self._gatherer.window_pages = int(pages)

    @property
    def window_bytes(self) -> int:
        """Cap on the advice window in bytes, for hosts under memory pressure; 0: no advice."""
        return self._gatherer.window_bytes

    @window_bytes.setter
    def window_bytes(self, limit: int) -> None:
        self._gatherer.window_bytes = int(limit)

    @property
    def threads(self) -> int:
        """Threads copying a large cached gather (parts of at least THREAD_MIN_ROWS rows); 1: inline."""
        return self._gatherer.threads

    @threads.setter
    def threads(self, count: int) -> None:
        self._gatherer.threads = max(1, int(count))

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 `(len(ids), row_bytes)`: the source bytes of each row, in request order."""
        return self._gatherer.gather_slots(self.slot_of(ids), out)

    def gather_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Like `gather`, by file slot (`slot_of`) instead of row id; slots are not checked."""
        return self._gatherer.gather_slots(slots, out)

    def resident(self, budget_bytes: int, device: str = "cpu") -> Resident:
        """Keep the leading (hottest) slots that fit in `budget_bytes` in RAM or GPU memory.

        `device` is 'cpu' (a numpy copy) or a torch device such as 'cuda' (needs torch). Replaces
        any earlier resident tier; `lookup` then serves those rows from it.
        """
        self._resident = None
        self._resident = load_resident(self.path, self.header, budget_bytes, device)
        return self._resident

    @property
    def resident_tier(self) -> Resident | None:
        return self._resident

    def lookup(self, ids: np.ndarray, out: Any = None) -> Lookup:
        """Split a request into resident positions (with their slots) and disk positions (with
        their rows, gathered). With `out` (uint8 `(len(ids), row_bytes)`, a numpy array or a
        tensor on the resident tier's device) the merged rows are written there, each position
        once, from its tier.
        """
        found = split(self.slot_of(ids), self._resident, self._gatherer)
        if out is not None:
            count = len(found.resident_positions) + len(found.disk_positions)
            if tuple(out.shape) != (count, self.row_bytes):
                raise ValueError(f"out must have shape {(count, self.row_bytes)}, not {tuple(out.shape)}")
            merge(found, self._resident, out)
        return found

    def values(self, ids: np.ndarray) -> np.ndarray:
        """float32 `(len(ids), values_per_row)`: exactly what the model layer computes."""
        return decode(self.header.encoding, self.gather(ids), self.values_per_row, self.scale)


def open_table(path: str | Path, manifest: str | Path | None = None, *,
               window_pages: int = DEFAULT_WINDOW_PAGES,
               window_bytes: int = DEFAULT_WINDOW_BYTES) -> Table:
    """Open a prepared table and its manifest, refusing any pair that does not belong together.

    `window_pages`/`window_bytes` bound the read-ahead advice of cold gathers (docs/RUNTIME.md).
    To also refuse a table whose source checkpoint changed since conversion, open it with
    `ple_prep.offline.staleness.open_checked` (that check reads the checkpoint's format).
    """
    path = Path(path)
    manifest_file = Path(manifest) if manifest is not None else manifest_path(path)
    meta = load_manifest(manifest_file)
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise BadInput(f"cannot open {path}: {exc.strerror}") from None
    try:
        size = os.fstat(descriptor).st_size
        header = Header.unpack(os.pread(descriptor, HEADER_SIZE, 0), size, path.name)
        if header.file_id.hex() != meta["file_id"]:
            raise BadInput(f"{path.name} and {manifest_file.name} come from different conversions "
                           f"(file ids {header.file_id.hex()} and {meta['file_id']})")
        mismatched = [f for f in _MATCHED_FIELDS if getattr(header, f) != meta[f]]
        if header.encoding.label != meta["encoding"]:
            mismatched.append("encoding")
        if mismatched:
            raise BadInput(f"{path.name} disagrees with its manifest on {', '.join(mismatched)}")
        # MAP_PRIVATE: a writer elsewhere can never change what this process reads through us.
        mapping = mmap.mmap(descriptor, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    finally:
        os.close(descriptor)
    mapping.madvise(mmap.MADV_RANDOM)
    return Table(path, meta, header, mapping, window_pages, window_bytes)
