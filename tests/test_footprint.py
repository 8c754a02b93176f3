"""The mapped footprint bound: pages copied through the mapping are advised away past a budget."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ple_prep.runtime import open_table
from ple_prep.runtime.footprint import FAULT_AROUND_BYTES, MIN_SLACK_BYTES, rss_file_bytes
from ple_prep.tools.fixtures import make_checkpoint

POISON = 0xA5
REQUEST_ROWS = 8


@pytest.fixture(scope="module")
def cached_table(tmp_path_factory, converted_table):
    """A 10 MiB table, all in the page cache, and its rows."""
    folder = tmp_path_factory.mktemp("footprint")
    rows = converted_table(make_checkpoint(folder / "ckpt", base=4000, with_tokenizer=False), folder / "t.bin",
                           with_rows=True).rows
    (folder / "t.bin").read_bytes()
    return folder / "t.bin", rows


def mapped_kib(table) -> int:
    """Resident KiB of the table's mapping in this process (its Rss line in /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) == table._gatherer._base:
            return next(int(field.split()[1]) for field in lines[index + 1:] if field.startswith("Rss:"))
    raise LookupError("the table's mapping is not in /proc/self/smaps")


def requests(num_rows: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, num_rows, REQUEST_ROWS) for _ in range(40)]


@pytest.mark.parametrize("advice", ["dontneed", "pageout"])
def test_budget_keeps_rss_file_small_and_rows_exact(cached_table, advice):
    path, source_rows = cached_table
    request_bytes = REQUEST_ROWS * FAULT_AROUND_BYTES  # the most one request's copy can map
    with open_table(path, read_path="mapped") as unbounded:
        for ids in requests(unbounded.num_rows):
            unbounded.gather(ids)
        assert mapped_kib(unbounded) * 1024 > 4 * request_bytes  # without a budget: most of the table
    # MADV_PAGEOUT skips pages another mapping still holds, so the unbounded table is closed first.
    out = np.full((REQUEST_ROWS, source_rows.shape[1]), POISON, dtype=np.uint8)
    budget = rss_file_bytes() + 2 * request_bytes  # this process's other file mappings, and room
    with open_table(path, read_path="mapped", mapped_budget_bytes=budget, budget_advice=advice) as bounded:
        peak = 0
        for ids in requests(bounded.num_rows):
            assert np.array_equal(bounded.gather(ids, out=out), source_rows[ids])
            peak = max(peak, rss_file_bytes())
            assert mapped_kib(bounded) * 1024 <= 4 * request_bytes
        assert bounded.mapped_budget.releases >= 5
        # Other file mappings of the process may grow unseen between two reads of RssFile.
        assert peak <= budget + request_bytes + MIN_SLACK_BYTES


def test_budget_options_are_checked(cached_table):
    path, _ = cached_table
    with pytest.raises(ValueError, match="mapped_budget_bytes must be > 0"):
        open_table(path, mapped_budget_bytes=0)
    with pytest.raises(ValueError, match="budget advice must be one of"):
        open_table(path, mapped_budget_bytes=1 << 20, budget_advice="cold")
    with open_table(path) as table:
        assert table.mapped_budget is None
