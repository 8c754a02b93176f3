"""Rows in pages: slot s lies in page s // rows_per_page, at byte (s % rows_per_page) * row_bytes of
it; each page's tail past its rows is zero padding (docs/FORMAT.md). The one place that arithmetic
is written, for the writer, the resume check and the readers.
"""
from __future__ import annotations

import numpy as np

from .header import Header


def pages_for(rows: int, rows_per_page: int) -> int:
    """Pages that hold `rows` rows (the last one possibly partial)."""
    return -(-rows // rows_per_page)


def slot_offset(header: Header, slot: int) -> int:
    """The file offset of the page holding `slot` (slots on page boundaries start their page)."""
    return header.data_offset + slot // header.rows_per_page * header.page_size


def row_offsets(header: Header, slots):
    """The file offset of each slot's row (an int or an int64 array)."""
    return header.data_offset + slots // header.rows_per_page * header.page_size \
        + slots % header.rows_per_page * header.row_bytes


def rows_in_block(header: Header, block: int, block_bytes: int) -> tuple[int, int]:
    """Slots [first, stop) whose pages lie in checksum block `block` of `block_bytes`."""
    rows_per_block = block_bytes // header.page_size * header.rows_per_page
    first = block * rows_per_block
    return min(first, header.num_rows), min(first + rows_per_block, header.num_rows)


def pack_rows(rows: np.ndarray, pages: np.ndarray, rows_per_page: int) -> np.ndarray:
    """Lay `rows` (uint8 `(n, row_bytes)`) at the heads of `pages` (uint8 `(m, page_size)`, reused);
    returns the view of the pages used. A last, partial page has its unused bytes zeroed."""
    count, row_bytes = rows.shape
    used = rows_per_page * row_bytes
    full, leftover = divmod(count, rows_per_page)
    out = pages[:full + bool(leftover)]
    out[:full, :used] = rows[:full * rows_per_page].reshape(full, used)
    if leftover:
        out[full] = 0
        out[full, :leftover * row_bytes] = rows[full * rows_per_page:].reshape(-1)
    return out


def page_rows(pages: np.ndarray, count: int, rows_per_page: int, row_bytes: int) -> list[np.ndarray]:
    """The first `count` rows of `pages` (uint8 `(m, page_size)`) as byte runs without the padding:
    one `(full_pages, rows_per_page * row_bytes)` view and, when the last page is partial, its rows."""
    full, leftover = divmod(count, rows_per_page)
    runs = [pages[:full, :rows_per_page * row_bytes]]
    if leftover:
        runs.append(pages[full, :leftover * row_bytes])
    return runs
