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


def test_a_copied_group_is_read_from_its_copy_only_where_the_plan_reads_two_pages_or_more():
    bench = _bench()
    per_page = bench.ROWS_PER_PAGE
    layout = object.__new__(bench.HashedCopiesLayout)
    # Two copied groups: the bigram of key 5 (copy page 100) and the trigram of key 9 (copy page 101).
    bench.KnownGroups.__init__(layout, np.array([5, 9], dtype=np.uint64), np.array([2, 3], dtype=np.uint8))
    layout.group_page = np.array([100, 101])
    slot_of_row = np.arange(20 * per_page)  # the plan: row r at slot r
    def on_pages(*pages):  # 8 rows, one on each page given, cycling
        return [pages[k % len(pages)] * per_page + k for k in range(8)]
    mixed = np.array([[5, 7], [5, 9], [6, 9]], dtype=np.uint64)
    rows = np.array([on_pages(3, 4, 5) + on_pages(6),        # copied bigram over 3 pages; trigram not copied
                     on_pages(7) + on_pages(0, 8),           # copied bigram on 1 page; copied trigram, 1 page resident
                     on_pages(9, 10) + on_pages(11, 12)])    # bigram not copied; copied trigram over 2 pages

    pages = bench.HashedCopiesLayout.pages(layout, slot_of_row, mixed, rows, resident_pages=1)

    planned = rows // per_page
    assert np.array_equal(pages[0], [100] * 8 + list(planned[0, 8:]))
    assert np.array_equal(pages[1], planned[1])
    assert np.array_equal(pages[2], list(planned[2, :8]) + [101] * 8)


def test_making_room_needs_split_copies():
    assert "error: --make-room applies to --split-copies" in _refused("--make-room")


def test_a_copies_growth_outside_0_to_1_is_refused():
    assert "error: --hashed-copies takes a file growth between 0 and 1" in _refused("--hashed-copies", "1.5")


def test_copy_key_bytes_need_hashed_copies_and_at_most_a_whole_key():
    assert "error: --copy-key-bytes applies to --hashed-copies" in _refused("--copy-key-bytes", "2")
    assert "error: --copy-key-bytes applies to --hashed-copies" in _refused("--copy-key-bytes", "8")
    assert "error: --copy-key-bytes takes" in _refused("--hashed-copies", "0.1", "--copy-key-bytes", "0")
    assert "error: --copy-key-bytes takes" in _refused("--hashed-copies", "0.1", "--copy-key-bytes", "9")


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


def test_hashed_copies_go_to_pages_of_their_own_three_a_page_the_most_reads_saved_first(monkeypatch):
    bench = _bench()
    from ple_prep.ngram import NgramSpec, rows_of_mixed
    from ple_prep.tools.fixtures import fixture_config

    spec = NgramSpec.from_config(fixture_config(base=1000))
    num_rows = spec.rows_stored
    keys = np.arange(1, 4001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    orders = np.where(np.arange(4000) % 2 == 0, 2, 3).astype(np.uint8)
    counts = np.arange(4000, 0, -1).astype(np.uint64)  # hottest first, as _hot_groups gives them
    monkeypatch.setattr(bench, "_hot_groups", lambda profile, parts, with_counts: (keys, orders, counts))
    slot_of_row = np.arange(num_rows)  # the plan: row r at slot r, so a group's rows spread over pages

    layout = bench.HashedCopiesLayout(None, spec, slot_of_row, 0.1)

    table_pages = -(-num_rows // bench.ROWS_PER_PAGE)
    assert layout.copy_pages == int(0.1 * num_rows) // bench.ROWS_PER_PAGE
    assert layout.groups <= 3 * layout.copy_pages and layout.map_bytes == 24 * layout.copy_pages
    # A fingerprint of each place's key charged instead of the key: the same copies, fewer bytes.
    fingerprinted = bench.HashedCopiesLayout(None, spec, slot_of_row, 0.1, key_bytes=2)
    assert fingerprinted.map_bytes == 6 * layout.copy_pages
    assert np.array_equal(fingerprinted.group_page, layout.group_page)
    assert np.bincount(layout.group_page - table_pages, minlength=layout.copy_pages).max() <= 3
    assert (layout.group_page >= table_pages).all()
    # The hottest group spread over several pages is copied; a copied group is one the plan splits.
    rows = np.concatenate([rows_of_mixed(keys[k:k + 1], int(orders[k]), spec) for k in range(4000)])
    spread = [len(np.unique(rows[k] // bench.ROWS_PER_PAGE)) > 1 for k in range(4000)]
    hottest = int(np.argmax(spread))
    assert layout.find(np.array([[keys[hottest]] * 2], dtype=np.uint64), int(orders[hottest]) - 2)[1][0]
    copied_keys = np.concatenate([layout.by_order[order][0] for order in layout.by_order])
    assert all(spread[k] for k in np.flatnonzero(np.isin(keys, copied_keys)))
