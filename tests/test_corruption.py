"""Corruption: one flipped bit anywhere in a prepared file is found by verify from checksums alone.

Flips cover every region: the fixed header, the row-order map, the padding before the data, row
bytes, page-end padding and the last page's tail. Data flips must be reported with their checksum
block and exactly that block's rows.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from ple_prep.cli import cli
from ple_prep.core.constants import HEADER_SIZE, HEADER_STRUCT
from ple_prep.offline import writer
from ple_prep.offline.verify import verify
from ple_prep.runtime import open_table

BLOCK_BYTES = 64 << 10  # small blocks so that a 2.7 MB fixture has many (43)
RANDOM_FLIPS = 600


@pytest.fixture(scope="module")
def placed_table(fp8_checkpoint, tmp_path_factory, converted_table):
    """A table with 300 placed rows (so the order map is 3600 bytes) and 64 KiB checksum blocks."""
    out = tmp_path_factory.mktemp("corrupt") / "t.bin"
    patch = pytest.MonkeyPatch()
    patch.setattr(writer, "CHECKSUM_BLOCK_BYTES", BLOCK_BYTES)
    try:
        converted_table(fp8_checkpoint, out,
                        placed=lambda rows, _: np.random.default_rng(4).choice(rows, 300, replace=False))
    finally:
        patch.undo()
    return out


def _regions(table) -> dict[str, list[int]]:
    """Byte positions of interest in each region of the file."""
    header = table.header
    order_end = header.order_offset + 12 * header.num_placed
    used = table.rows_per_page * table.row_bytes
    last_page = header.data_offset + (header.num_pages - 1) * header.page_size
    last_used = (table.num_rows - (header.num_pages - 1) * table.rows_per_page) * table.row_bytes
    return {
        "header fields": [0, 7, 8, HEADER_STRUCT.size - 17, HEADER_STRUCT.size - 1],
        "header reserved": [HEADER_STRUCT.size, HEADER_SIZE - 1],
        "order map": [HEADER_SIZE, HEADER_SIZE + 4 * header.num_placed, order_end - 1],
        "padding before data": [order_end, header.data_offset - 1],
        "row bytes": [header.data_offset, header.data_offset + used - 1, last_page],
        "page-end padding": [header.data_offset + used, header.data_offset + header.page_size - 1],
        "last page tail": [last_page + last_used, header.file_size - 1],
    }


def _flip(path, position: int, bit: int) -> None:
    descriptor = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(descriptor, 1, position)[0]
        os.pwrite(descriptor, bytes([byte ^ (1 << bit)]), position)
    finally:
        os.close(descriptor)


def _block_rows(table, block: int) -> np.ndarray:
    pages_per_block = BLOCK_BYTES // table.page_size
    first_slot = block * pages_per_block * table.rows_per_page
    stop_slot = min(table.num_rows, first_slot + pages_per_block * table.rows_per_page)
    return table.order.rows_at(first_slot, stop_slot) + table.first_row


def _check_flip(path, table, position: int, bit: int) -> str:
    _flip(path, position, bit)
    try:
        report = verify(path)
    finally:
        _flip(path, position, bit)
    assert not report.ok, f"flip at byte {position} bit {bit} not found"
    header = table.header
    if position < header.data_offset:
        assert not report.header_ok and not report.bad_blocks
        return "header"
    block = (position - header.data_offset) // BLOCK_BYTES
    rows = _block_rows(table, block)
    assert report.header_ok and not report.file_problems
    assert [b["block"] for b in report.bad_blocks] == [block]
    bad = report.bad_blocks[0]
    assert bad["num_rows"] == len(rows) and bad["first_rows"] == rows[:10].tolist()
    page, in_page = divmod(position - header.data_offset, header.page_size)
    if in_page < table.rows_per_page * table.row_bytes:
        slot = page * table.rows_per_page + in_page // table.row_bytes
        if slot < table.num_rows:
            assert table.order.rows_at(slot, slot + 1)[0] in rows
    return "data"


def test_verify_finds_flipped_bit_in_every_region(placed_table):
    with open_table(placed_table) as table:
        for positions in _regions(table).values():
            for position in positions:
                for bit in (0, 7):
                    _check_flip(placed_table, table, position, bit)
        assert verify(placed_table).ok


def test_verify_finds_flipped_bits_at_random_positions(placed_table):
    rng = np.random.default_rng(5)
    with open_table(placed_table) as table:
        size = table.header.file_size
        # Half over the whole file, half inside the header pages, which are a small share of it.
        positions = np.concatenate([rng.integers(0, size, RANDOM_FLIPS // 2),
                                    rng.integers(0, table.header.data_offset, RANDOM_FLIPS // 2)])
        kinds = [_check_flip(placed_table, table, int(p), int(rng.integers(0, 8))) for p in positions]
    assert kinds.count("header") >= RANDOM_FLIPS // 2
    assert verify(placed_table).ok


def test_verify_cli_names_bad_block_and_rows(placed_table, runner, tmp_path):
    with open_table(placed_table) as table:
        position = table.header.data_offset + 5 * BLOCK_BYTES + 1000
        rows = _block_rows(table, 5)
    _flip(placed_table, position, 3)
    try:
        result = runner.invoke(cli, ["verify", str(placed_table)])
    finally:
        _flip(placed_table, position, 3)
    assert result.exit_code == 1
    start = table.header.data_offset + 5 * BLOCK_BYTES
    assert (f"  block 5 (bytes {start}-{start + BLOCK_BYTES}): {len(rows)} rows, "
            f"first {rows[:10].tolist()}") in result.stdout


def test_verify_cli_reports_damaged_header_as_failed_check(placed_table, runner):
    _flip(placed_table, 8, 0)  # the format version
    try:
        result = runner.invoke(cli, ["verify", str(placed_table)])
    finally:
        _flip(placed_table, 8, 0)
    assert result.exit_code == 1
    assert "header BAD" in result.stdout and "file: t.bin: format version 3" in result.stdout
