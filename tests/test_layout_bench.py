"""bench/layout_bench.py's models that decide what to build: the home pages that make room for
their groups' copies, and the options it refuses."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "layout_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("layout_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_home_pages_push_out_as_many_other_rows_as_they_take_copies():
    bench = _bench()
    per_page = bench.ROWS_PER_PAGE
    num_rows = 10 * per_page + 7
    slot_of_row = np.random.default_rng(3).permutation(num_rows).astype(np.int32)
    row_of_slot = np.argsort(slot_of_row)
    # Two copied groups at home on page 2 (5 and 6 of their 8 rows there), one on page 9 (4).
    def rows_at(*slots):
        return row_of_slot[np.concatenate([np.atleast_1d(part) for part in slots])]
    group_rows = np.stack([rows_at(np.arange(50, 55), [100, 130, 160]),
                           rows_at(np.arange(55, 61), [101, 131]),
                           rows_at(np.arange(225, 229), [102, 132, 162, 192])])
    group_pages = slot_of_row[group_rows] // per_page
    homes = np.array([2, 2, 9])
    copies = np.array([3, 2, 4])
    layout = types.SimpleNamespace()

    pages = bench.SplitCopiesLayout._pushed_out(layout, slot_of_row, group_rows, group_pages, homes, copies)

    table_pages = -(-num_rows // per_page)
    pushed = np.flatnonzero(pages >= table_pages)
    assert layout.pushed_rows == len(pushed) == copies.sum()
    assert np.array_equal(np.bincount(slot_of_row[pushed] // per_page, minlength=11)[[2, 9]], [5, 4])
    at_home = group_rows[group_pages == homes[:, None]]
    assert not np.isin(at_home, pushed).any()
    assert np.array_equal(np.sort(pages[pushed]), table_pages + np.arange(len(pushed)) // per_page)
    others = np.setdiff1d(np.arange(num_rows), pushed)
    assert np.array_equal(pages[others], slot_of_row[others] // per_page)
    # A page gives up its last slots first.
    assert np.array_equal(np.sort(slot_of_row[pushed]), [70, 71, 72, 73, 74, 246, 247, 248, 249])


def _refused(*arguments: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True)
    assert result.returncode == 2 and not result.stdout
    return result.stderr.strip().splitlines()[-1]


def test_making_room_needs_split_copies():
    assert "error: --make-room applies to --split-copies" in _refused("--make-room")


def test_an_index_of_negative_bits_is_refused():
    assert "error: --index-bits" in _refused("--index-bits", "1", "-2")


def test_a_tokens_reads_split_by_whether_a_page_holds_a_row_of_a_seen_ngram():
    bench = _bench()
    # Two n-grams a token, two heads each; pages below 2 are resident.
    pages = np.array([[5, 5, 7, 1],    # the seen n-gram's page, the other's
                      [3, 9, 3, 0],    # page 3 holds rows of both: it counts as seen
                      [0, 1, 4, 4]])   # the seen n-gram all resident
    seen = np.array([[True, False], [False, True], [True, False]])

    of_seen, of_unseen, seen_not_resident = bench.reads_by_ngram(pages, seen, 2)

    _, fresh = bench.first_of_each_page(np.where(pages >= 2, pages, -1))
    assert of_seen + of_unseen == np.count_nonzero(fresh) == 5
    assert (of_seen, of_unseen, seen_not_resident) == (2, 3, 2)
