"""Disk page reads per 1,000 tokens: access-ordered layout against the checkpoint's own layout.

Run: flock /tmp/ple-bench.lock python bench/layout_bench.py [--map-fraction F] [--base B] [--duplicates]
     [--group-keyed G] [--split-copies G [--group-map-bytes B] [--make-room]] [--hashed-copies G [--copy-key-bytes K]]
     [--index-bits ROW PLACED]
(F: most RAM the row-order map's lookup index may cost, as a fraction of the table, default 0.015;
B: `ngram_vocab_size_base`, 20,000,000 for the real geometry, 2,500,000 for 1/8 of it.)

Corpus: bench/real_corpus.py (real documents, split by document into a profile half and a disjoint
evaluation half; tokenizer trained on the profile half). The profile half is profiled, and the
layout planned for the geometry of B (the real one by default: 320,001,536 FP8 rows of 160 bytes,
4 KiB pages, 25 rows a page) with the planner alone, from both parts of the profile as `convert`
plans it: no rows are read or written.

Metric, for each token of the evaluation half: the number of distinct 4 KiB pages holding its 16
rows that are not resident (a page read once per token, no page cache beyond the resident set).
Both layouts get the same resident budget, a fraction of the table's 51.2 GB, as whole pages:
- prepared: the file's leading pages (the hottest rows, as `ple-prep inspect` hints);
- checkpoint: its rows back to back in source order (row r at byte 160*r, so one row in 25.6
  straddles two pages and needs both), with the budget spent on its hottest pages by the profile
  half's row reads (both parts of the profile, as the prepared layout gets).
`by_ngram` splits the map-charged reads by the n-gram whose rows a page holds: a page of a row of
an n-gram the profile saw counts as "seen", the rest as "unseen" (any layout reads about a page a
row for those); with `seen_groups_not_resident` (seen n-grams with a row not resident), the ratio
if every seen n-gram were one page read, as placing all of them whole would give.
The "map charged" column also takes what a server holds for the row-order map (its lookup index:
2 bits a table row and each placed row's slot in the bits the slots need,
`format.order.lookup_index_bytes`) out of its resident budget; `--index-bits ROW PLACED` charges an
index of another size instead (not built: what a smaller index of the same rows would buy, down to
the bits any map of them needs).

--duplicates adds what duplicating shared rows would buy (not built: measured to decide): every
seen n-gram's 8 rows on its own page, 3 groups a page in hotness order, so each seen n-gram costs
one page read at most, and a row of an unseen n-gram is read from the page of the hottest group
holding it (or from the tail in source order); the file grows by the rows copied.

--group-keyed G adds a layout with no per-row map (not built: measured to decide): the hottest
seen groups, as many as copying their 8 rows grows the file by the fraction G, each on its own
page (3 groups a page, hottest first), then the whole table in source order (25 rows a page). A
token's group is found by its key in a map of the placed groups (12 bytes a group, charged: a
64-bit key of its rows and its number), else its rows are read from the table's copy.

--split-copies G adds the per-row layout with copies (not built: measured to decide): the seen
groups the plan splits over more than one page, most page reads saved per copied row first (the
profile's count times the pages beyond one, over the rows not on the group's home page), get their
missing rows copied onto their home page as far as a file growth of G, found by a map of the
copied groups (--group-map-bytes a group, default 12: a 64-bit key and a slot), charged with the
per-row map's index. Optimistic: the home page is taken to have room for the copies. With
--make-room it has none: a home takes at most 3 copied groups, and each copy pushes one of the
page's other rows (the last by slot) out to pages after the table's.

--hashed-copies G adds the per-row layout with whole copies of the split groups in a region of
their own (not built: measured to decide): as many as a file growth of G holds, 3 a page, each on
one of two pages its key hashes to, found exactly through a table of the copies' keys (8 bytes a
place, charged with the per-row map's index); nothing is pushed out (HashedCopiesLayout).
--copy-key-bytes K charges K bytes a place instead: a fingerprint of the key in RAM, the full keys on
the copy page, where a false positive (about 6 in 2**(8K) of the split groups looked up) would cost
a read of the copy page and a second round for the plan's pages, which is not counted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_corpus  # noqa: E402

from ple_prep.format.header import ORDER_BYTES_PER_PLACED  # noqa: E402
from ple_prep.format.order import lookup_index_bytes  # noqa: E402
from ple_prep.ngram import NgramSpec, mixed_values, rows_of_mixed, splitmix64  # noqa: E402
from ple_prep.offline.planner import DEFAULT_MAP_FRACTION, _group_rows, _hot_groups, max_placed_rows, plan_order  # noqa: E402
from ple_prep.offline.profile import PARTS, Profiler  # noqa: E402
from ple_prep.tools.fixtures import fixture_config  # noqa: E402

ROW_BYTES = 160
PAGE_SIZE = 4096
ROWS_PER_PAGE = PAGE_SIZE // ROW_BYTES
BUDGETS = (0.01, 0.05, 0.10)
CHUNK_TOKENS = 1 << 20


def evaluation_row_ids(spec: NgramSpec, tokens: np.ndarray, starts: np.ndarray):
    """(mixed hashes `(n, 2)`, row ids `(n, 16)`) of chunks of tokens, request boundaries respected,
    in chunks of documents."""
    first = 0
    while first < len(starts) - 1:
        last = first + 1
        while last < len(starts) - 1 and starts[last + 1] - starts[first] <= CHUNK_TOKENS:
            last += 1
        chunk = tokens[starts[first]:starts[last]]
        mixed = mixed_values(chunk, spec, request_starts=starts[first:last] - starts[first])
        rows = np.concatenate([rows_of_mixed(mixed[:, j], j + 2, spec) for j in range(mixed.shape[1])],
                              axis=1)
        yield mixed, rows
        first = last


def find_keys(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(where, found): each of `keys`' index in `sorted_keys`, and whether it is there."""
    if not len(sorted_keys):
        return np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=bool)
    where = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return where, sorted_keys[where] == keys


class KnownGroups:
    """Groups by order and key, to find a token's n-grams among them."""

    def __init__(self, keys: np.ndarray, orders: np.ndarray):
        self.groups = len(keys)
        self.by_order = {}
        for order in np.unique(orders):
            chosen = np.flatnonzero(orders == order)
            by_key = np.argsort(keys[chosen])
            self.by_order[int(order)] = (keys[chosen][by_key], chosen[by_key])

    def find(self, mixed: np.ndarray, column: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(group, found) of each token's n-gram in `column` of `mixed` (its mixed hash), or None
        where no group has that order; `group` counts only where `found`."""
        if column + 2 not in self.by_order:
            return None
        sorted_keys, group = self.by_order[column + 2]
        where, found = find_keys(sorted_keys, mixed[:, column])
        return group[where], found

    def seen(self, mixed: np.ndarray) -> np.ndarray:
        """bool (tokens, orders): whether each n-gram (its mixed hash) is one of the groups."""
        seen = np.zeros(mixed.shape, dtype=bool)
        for column in range(mixed.shape[1]):
            found = self.find(mixed, column)
            if found is not None:
                seen[:, column] = found[1]
        return seen


class GroupPages(KnownGroups):
    """Seen groups (hottest first) on pages of their own, 3 a page: each group's page, and the
    groups by their key for a token's lookup."""

    def __init__(self, keys: np.ndarray, orders: np.ndarray, spec: NgramSpec):
        super().__init__(keys, orders)
        groups_per_page = ROWS_PER_PAGE // spec.heads_per_ngram
        self.group_page = (np.arange(self.groups) // groups_per_page).astype(np.int32)
        self.grouped_pages = -(-self.groups // groups_per_page)

    def read_groups_from_their_pages(self, pages: np.ndarray, mixed: np.ndarray) -> np.ndarray:
        """`pages` (per token, each of its 16 rows' page) with the rows of each placed group the
        token's n-grams are read from that group's page."""
        heads = pages.shape[1] // mixed.shape[1]
        for column in range(mixed.shape[1]):
            found = self.find(mixed, column)
            if found is not None:
                group, seen = found
                pages[seen, column * heads:(column + 1) * heads] = self.group_page[group[seen]][:, None]
        return pages


class DuplicatedLayout(GroupPages):
    """The --duplicates layout: every seen group's 8 rows on the page of the group, 3 groups a
    page in hotness order; rows of no seen group follow in source order."""

    def __init__(self, profile, spec: NgramSpec, num_rows: int):
        keys, orders = _hot_groups(profile, PARTS)
        super().__init__(keys, orders, spec)
        # A row of an unseen n-gram is read from the hottest group's page holding it: assign the
        # coldest chunks first so hotter ones overwrite (and, inside a chunk, the hottest last).
        self.page_of_row = np.full(num_rows, -1, dtype=np.int32)
        step = 1 << 18
        for start in reversed(range(0, self.groups, step)):
            stop = min(start + step, self.groups)
            rows = np.empty((stop - start, spec.heads_per_ngram), dtype=np.int64)
            for order in np.unique(orders[start:stop]):
                chosen = np.flatnonzero(orders[start:stop] == order)
                rows[chosen] = rows_of_mixed(keys[start:stop][chosen], int(order), spec)
            pages = np.repeat(self.group_page[start:stop], spec.heads_per_ngram)
            self.page_of_row[rows[::-1].reshape(-1)] = pages.reshape(-1, spec.heads_per_ngram)[::-1].reshape(-1)
        unseen = self.page_of_row < 0
        self.distinct_seen_rows = int(num_rows - np.count_nonzero(unseen))
        tail = int(np.count_nonzero(unseen))
        self.page_of_row[unseen] = self.grouped_pages + np.arange(tail, dtype=np.int32) // ROWS_PER_PAGE
        self.num_pages = self.grouped_pages + -(-tail // ROWS_PER_PAGE)

    def pages(self, mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per token, the page of each of its 16 rows as this layout reads them."""
        return self.read_groups_from_their_pages(self.page_of_row[rows], mixed)


class GroupKeyedLayout(GroupPages):
    """The --group-keyed layout: the hottest groups copied onto pages of their own, then the table."""

    def __init__(self, profile, spec: NgramSpec, num_rows: int, growth: float):
        keys, orders = _hot_groups(profile, PARTS)
        placed = int(growth * num_rows) // spec.heads_per_ngram
        super().__init__(keys[:placed], orders[:placed], spec)
        self.table_pages = -(-num_rows // ROWS_PER_PAGE)
        self.map_bytes = 12 * self.groups

    def pages(self, mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per token, the page of each of its 16 rows as this layout reads them."""
        return self.read_groups_from_their_pages((self.grouped_pages + rows // ROWS_PER_PAGE).astype(np.int64),
                                                 mixed)


class SplitCopiesLayout(GroupPages):
    """The --split-copies layout: the planned per-row order, and copies of the rows of the seen
    groups it splits over pages, most page reads saved a copy first, as far as a file growth of
    `growth`: each copied group read from one page, its home (the page holding most of its rows).
    By default the home is taken to have room for its copies (optimistic); with `make_room`, a
    home takes at most as many copied groups as a page holds whole groups, and each copy pushes
    one of the page's other rows (the last by slot) to pages after the table's, where every read
    of it then goes."""

    def __init__(self, profile, spec: NgramSpec, slot_of_row: np.ndarray, growth: float, map_bytes: float,
                 make_room: bool = False):
        keys, orders, counts = _hot_groups(profile, PARTS, with_counts=True)
        rows = np.empty((len(keys), spec.heads_per_ngram), dtype=np.int64)
        for order in np.unique(orders):
            chosen = orders == order
            rows[chosen] = rows_of_mixed(keys[chosen], int(order), spec)
        unsorted_pages = slot_of_row[rows] // ROWS_PER_PAGE
        pages = np.sort(unsorted_pages, axis=1)
        if not make_room:  # only pushing rows out needs the groups' rows and pages again
            del rows, unsorted_pages
        # Each group's longest run of one page in its sorted pages: its home and the rows there.
        fresh = np.ones(pages.shape, dtype=bool)
        fresh[:, 1:] = pages[:, 1:] != pages[:, :-1]
        home, at_home = pages[:, 0].copy(), np.zeros(len(keys), dtype=np.int64)
        current, length = home.copy(), np.zeros(len(keys), dtype=np.int64)
        for column in range(pages.shape[1]):
            current = np.where(fresh[:, column], pages[:, column], current)
            length = np.where(fresh[:, column], 1, length + 1)
            longer = length > at_home
            home, at_home = np.where(longer, current, home), np.where(longer, length, at_home)
        distinct = np.count_nonzero(fresh, axis=1)
        copies = spec.heads_per_ngram - at_home
        split = np.flatnonzero(distinct > 1)
        saved_per_copy = counts[split] * (distinct[split] - 1) / copies[split]
        by_saving = split[np.argsort(-saved_per_copy, kind="stable")]
        if make_room:  # at most this many whole groups on a home page, the best first
            by_home = np.argsort(home[by_saving], kind="stable")
            homes = home[by_saving][by_home]
            run_start = np.flatnonzero(np.diff(homes, prepend=-1))
            rank = np.arange(len(homes)) - np.repeat(run_start, np.diff(np.append(run_start, len(homes))))
            fits = np.empty(len(by_saving), dtype=bool)
            fits[by_home] = rank < ROWS_PER_PAGE // spec.heads_per_ngram
            by_saving = by_saving[fits]
        copied = by_saving[:int(np.searchsorted(np.cumsum(copies[by_saving]), growth * len(slot_of_row),
                                                side="right"))]
        super().__init__(keys[copied], orders[copied], spec)
        self.group_page = home[copied]
        self.copied_rows = int(copies[copied].sum())
        self.split_groups = len(split)
        self.map_bytes = int(map_bytes * self.groups)
        self.page_of_row = None
        if make_room:
            self.page_of_row = self._pushed_out(slot_of_row, rows[copied], unsorted_pages[copied], home[copied],
                                                copies[copied])

    def _pushed_out(self, slot_of_row, group_rows, group_pages, homes, copies) -> np.ndarray:
        """Each row's page once every home page has pushed out as many of its other rows (the last
        by slot) as it takes copies: those go, 25 a page, after the table's pages."""
        page_of_row = (slot_of_row // ROWS_PER_PAGE).astype(np.int64)
        kept = np.zeros(len(slot_of_row), dtype=bool)  # the copied groups' rows already at home
        kept[group_rows[group_pages == homes[:, None]]] = True
        room = np.bincount(homes, weights=copies).astype(np.int64)
        pages = np.flatnonzero(room)
        row_of_slot = np.empty(len(slot_of_row), dtype=np.int64)
        row_of_slot[slot_of_row] = np.arange(len(slot_of_row))
        # The page's last slots first: the planner fills a page hottest first. (Its least-read rows
        # first, by the profile, did worse: docs/benchmark-history.md.)
        slots = pages[:, None] * ROWS_PER_PAGE + np.arange(ROWS_PER_PAGE - 1, -1, -1)
        inside = slots < len(slot_of_row)  # the table's last page may be short
        candidates = row_of_slot[np.minimum(slots, len(slot_of_row) - 1)]
        movable = inside & ~kept[candidates]
        order = np.cumsum(movable, axis=1)
        pushed = candidates[movable & (order <= room[pages][:, None])]
        self.pushed_rows = len(pushed)
        page_of_row[pushed] = -(-len(slot_of_row) // ROWS_PER_PAGE) + np.arange(len(pushed)) // ROWS_PER_PAGE
        return page_of_row

    def pages(self, slot_of_row: np.ndarray, mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per token, the page of each of its 16 rows as this layout reads them."""
        pages = slot_of_row[rows] // ROWS_PER_PAGE if self.page_of_row is None else self.page_of_row[rows]
        return self.read_groups_from_their_pages(pages, mixed)


class HashedCopiesLayout(KnownGroups):
    """The --hashed-copies layout: the planned per-row order, and whole copies of the seen groups it
    splits over pages, most page reads saved first, in a region of their own after the table's
    pages as far as a file growth of `growth`: 3 groups a page (24 of its 25 rows), each group in
    the emptier of two pages its key hashes to, a group whose two pages are full not copied. A
    table in RAM of every copy place's 64-bit mixed hash (8 bytes a place, empty ones too, charged;
    `key_bytes` charges a fingerprint of it instead) says exactly which group a place holds: a
    reader computes the group's 8 rows from it and compares them with a token's, so no other
    group's rows are ever read from a copy. A token's copied group is read from its copy only
    where the plan would read it from 2 pages or more that are not resident (so never a page more
    than the plan)."""

    def __init__(self, profile, spec: NgramSpec, slot_of_row: np.ndarray, growth: float, key_bytes: float = 8):
        keys, orders, counts = _hot_groups(profile, PARTS, with_counts=True)
        distinct = np.empty(len(keys), dtype=np.int64)
        step = 1 << 20
        for start in range(0, len(keys), step):
            rows = _group_rows(keys[start:start + step], orders[start:start + step], spec, 0, len(slot_of_row))
            _, fresh = first_of_each_page(slot_of_row[rows] // ROWS_PER_PAGE)
            distinct[start:start + step] = np.count_nonzero(fresh, axis=1)
        split = np.flatnonzero(distinct > 1)
        by_saving = split[np.argsort(-(counts[split] * (distinct[split] - 1)), kind="stable")]
        per_page = ROWS_PER_PAGE // spec.heads_per_ngram
        self.copy_pages = int(growth * len(slot_of_row)) // ROWS_PER_PAGE
        keyed = keys[by_saving] ^ orders[by_saving].astype(np.uint64)
        with np.errstate(over="ignore"):  # splitmix64 wraps, as uint64 arithmetic does
            first_choice, second_choice = (splitmix64(keyed ^ np.uint64(salt)) % np.uint64(self.copy_pages)
                                           for salt in (0, 0xC2B2AE3D27D4EB4F))
        load = np.zeros(self.copy_pages, dtype=np.int64)
        page_of = np.full(len(by_saving), -1, dtype=np.int64)
        free = self.copy_pages * per_page
        for k, (one, two) in enumerate(zip(first_choice.tolist(), second_choice.tolist())):
            page = one if load[one] <= load[two] else two
            if load[page] < per_page:
                load[page] += 1
                page_of[k] = page
                free -= 1
                if not free:
                    break
        copied = page_of >= 0
        super().__init__(keys[by_saving[copied]], orders[by_saving[copied]])
        self.split_groups = len(split)
        self.group_page = -(-len(slot_of_row) // ROWS_PER_PAGE) + page_of[copied]  # after the table's pages
        self.map_bytes = int(key_bytes * per_page * self.copy_pages)

    def pages(self, slot_of_row: np.ndarray, mixed: np.ndarray, rows: np.ndarray, resident_pages: int) -> np.ndarray:
        """Per token, the page of each of its 16 rows as this layout reads them."""
        pages = (slot_of_row[rows] // ROWS_PER_PAGE).astype(np.int64)
        heads = pages.shape[1] // mixed.shape[1]
        for column in range(mixed.shape[1]):
            found = self.find(mixed, column)
            if found is None:
                continue
            group, seen = found
            ours = pages[seen, column * heads:(column + 1) * heads]
            sorted_pages, fresh = first_of_each_page(ours)
            from_copy = np.count_nonzero(fresh & (sorted_pages >= resident_pages), axis=1) > 1
            ours[from_copy] = self.group_page[group[seen][from_copy]][:, None]
            pages[seen, column * heads:(column + 1) * heads] = ours
        return pages


def first_of_each_page(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token (a row of `pages`; -1 = no page), its pages sorted and a mask of each distinct one."""
    pages = np.sort(pages, axis=1)
    fresh = np.ones(pages.shape, dtype=bool)
    fresh[:, 1:] = pages[:, 1:] != pages[:, :-1]
    return pages, fresh & (pages >= 0)


def reads_by_ngram(pages: np.ndarray, seen: np.ndarray, resident_pages: int) -> tuple[int, int, int]:
    """Of the tokens' reads (`pages` per row, `seen` per n-gram), those of a page holding a row of a
    seen n-gram, the others, and the seen n-grams with a row not resident."""
    heads = pages.shape[1] // seen.shape[1]
    row_seen = np.repeat(seen, heads, axis=1)
    # Sorted by page with a seen row first: the first of each page says whether any row was seen.
    keys = np.sort(pages.astype(np.int64) * 2 + ~row_seen, axis=1)
    first = np.ones(keys.shape, dtype=bool)
    first[:, 1:] = keys[:, 1:] // 2 != keys[:, :-1] // 2
    read = first & (keys // 2 >= resident_pages)
    of_seen = int(np.count_nonzero(read & (keys % 2 == 0)))
    not_resident = (pages >= resident_pages).reshape(len(pages), seen.shape[1], heads).any(axis=2)
    return of_seen, int(np.count_nonzero(read)) - of_seen, int(np.count_nonzero(not_resident & seen))


def dense_slots(order) -> np.ndarray:
    """int32 slot of every row: placed rows where the map puts them, the rest in source order."""
    slots = np.empty(order.num_rows, dtype=np.int32)
    unplaced = np.ones(order.num_rows, dtype=bool)
    unplaced[order.slot_rows] = False
    slots[order.slot_rows] = np.arange(order.num_placed, dtype=np.int32)
    slots[unplaced] = np.arange(order.num_placed, order.num_rows, dtype=np.int32)
    return slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--map-fraction", type=float, default=DEFAULT_MAP_FRACTION)
    parser.add_argument("--base", type=int, default=20_000_000)
    parser.add_argument("--duplicates", action="store_true")
    parser.add_argument("--group-keyed", type=float, metavar="GROWTH")
    parser.add_argument("--split-copies", type=float, metavar="GROWTH")
    parser.add_argument("--group-map-bytes", type=float, default=12.0)
    parser.add_argument("--hashed-copies", type=float, metavar="GROWTH")
    parser.add_argument("--copy-key-bytes", type=float,
                        help="with --hashed-copies: bytes a copy place costs in RAM (default 8: its whole key)")
    parser.add_argument("--index-bits", type=float, nargs=2, metavar=("ROW", "PLACED"),
                        help="charge a lookup index of ROW bits a table row and PLACED bits a placed row")
    parser.add_argument("--make-room", action="store_true",
                        help="with --split-copies: home pages push rows out for their copies")
    args = parser.parse_args()
    for name in ("group_keyed", "split_copies", "hashed_copies"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} takes a file growth between 0 and 1")
    if args.make_room and args.split_copies is None:
        parser.error("--make-room applies to --split-copies")
    if args.copy_key_bytes is not None and args.hashed_copies is None:
        parser.error("--copy-key-bytes applies to --hashed-copies")
    if args.copy_key_bytes is not None and not 0 < args.copy_key_bytes <= 8:
        parser.error("--copy-key-bytes takes the bytes a copy place costs, above 0 and at most 8")
    if args.index_bits is not None and min(args.index_bits) < 0:
        parser.error("--index-bits takes bits a table row and bits a placed row, neither negative")
    started = time.perf_counter()
    corpus = real_corpus.load()
    spec = NgramSpec.from_config(fixture_config(base=args.base))
    num_rows = spec.rows_stored
    table_bytes = num_rows * ROW_BYTES
    timings = {}

    clock = time.perf_counter()
    profiler = Profiler(spec)
    for request in real_corpus.requests(*corpus["profile"]):
        profiler.add_request(request)
    profile = profiler.finish(model="real-geometry", tokenizer_sha256=None, inputs=[])
    timings["profile_s"] = round(time.perf_counter() - clock, 1)

    clock = time.perf_counter()
    limit = max_placed_rows(num_rows, ROW_BYTES, args.map_fraction)
    plan = plan_order(profile, num_rows, ROWS_PER_PAGE, max_placed=limit, parts=PARTS)
    order = plan.order
    timings["plan_s"] = round(time.perf_counter() - clock, 1)
    map_bytes = ORDER_BYTES_PER_PLACED[2] * order.num_placed
    index_bytes = lookup_index_bytes(num_rows, order.num_placed)
    if args.index_bits is not None:
        index_bytes = int((args.index_bits[0] * num_rows + args.index_bits[1] * order.num_placed) / 8)

    # A dense slot of every row (1.28 GB, bench only: random lookups into it are ~10x faster
    # than the runtime's compact map, whose answers it must equal).
    clock = time.perf_counter()
    slot_of_row = dense_slots(order)
    sample = np.random.default_rng(0).integers(0, num_rows, size=1_000_000)
    sample = np.concatenate([sample, order.slot_rows[:100_000].astype(np.int64)])
    assert np.array_equal(slot_of_row[sample], order.slot_of(sample))
    timings["dense_map_s"] = round(time.perf_counter() - clock, 1)

    # The checkpoint's hottest pages by the profile half's row reads (both pages of a straddler).
    clock = time.perf_counter()
    rows, counts = (np.concatenate(arrays) for arrays in zip(*(profile.parts[part].rows(spec) for part in PARTS)))
    num_pages = -(-table_bytes // PAGE_SIZE)
    heat = np.bincount(rows * ROW_BYTES // PAGE_SIZE, weights=counts, minlength=num_pages)
    heat += np.bincount((rows * ROW_BYTES + ROW_BYTES - 1) // PAGE_SIZE,
                        weights=counts * ((rows * ROW_BYTES) // PAGE_SIZE
                                          != (rows * ROW_BYTES + ROW_BYTES - 1) // PAGE_SIZE),
                        minlength=num_pages)
    hottest_pages = np.argsort(-heat, kind="stable")
    timings["checkpoint_heat_s"] = round(time.perf_counter() - clock, 1)

    budgets = {}
    for fraction in BUDGETS:
        resident_pages = int(fraction * table_bytes) // PAGE_SIZE
        charged_pages = max(0, int(fraction * table_bytes) - index_bytes) // PAGE_SIZE
        checkpoint_resident = np.zeros(num_pages, dtype=bool)
        checkpoint_resident[hottest_pages[:resident_pages]] = True
        budgets[fraction] = {"resident_pages": resident_pages, "charged_pages": charged_pages,
                             "checkpoint_resident": checkpoint_resident,
                             "prepared": 0, "prepared_charged": 0, "checkpoint": 0,
                             "seen": 0, "unseen": 0, "seen_groups_not_resident": 0,
                             "prepared_row_hits": 0, "checkpoint_row_hits": 0}

    clock = time.perf_counter()
    tokens = ngrams = unseen_ngrams = 0
    seen_ngrams = KnownGroups(*_hot_groups(profile, PARTS))
    duplicated = DuplicatedLayout(profile, spec, num_rows) if args.duplicates else None
    keyed = None if args.group_keyed is None else GroupKeyedLayout(profile, spec, num_rows, args.group_keyed)
    copies = None if args.split_copies is None else SplitCopiesLayout(profile, spec, slot_of_row, args.split_copies,
                                                                     args.group_map_bytes, args.make_room)
    hashed = None if args.hashed_copies is None else HashedCopiesLayout(profile, spec, slot_of_row, args.hashed_copies,
                                                                      args.copy_key_bytes or 8)
    for mixed, row_ids in evaluation_row_ids(spec, *corpus["evaluation"]):
        tokens += len(row_ids)
        if hashed is not None:
            for fraction, budget in budgets.items():
                resident = max(0, int(fraction * table_bytes) - index_bytes - hashed.map_bytes) // PAGE_SIZE
                hashed_sorted, hashed_fresh = first_of_each_page(hashed.pages(slot_of_row, mixed, row_ids, resident))
                budget["hashed_copies"] = budget.get("hashed_copies", 0) + int(
                    np.count_nonzero(hashed_fresh & (hashed_sorted >= resident)))
        if duplicated is not None:
            dup_sorted, dup_fresh = first_of_each_page(duplicated.pages(mixed, row_ids))
            for budget in budgets.values():
                budget["duplicated"] = budget.get("duplicated", 0) + int(
                    np.count_nonzero(dup_fresh & (dup_sorted >= budget["charged_pages"])))
        if keyed is not None:
            keyed_sorted, keyed_fresh = first_of_each_page(keyed.pages(mixed, row_ids))
            for fraction, budget in budgets.items():
                resident = max(0, int(fraction * table_bytes) - keyed.map_bytes) // PAGE_SIZE
                budget["group_keyed"] = budget.get("group_keyed", 0) + int(
                    np.count_nonzero(keyed_fresh & (keyed_sorted >= resident)))
        if copies is not None:
            copies_sorted, copies_fresh = first_of_each_page(copies.pages(slot_of_row, mixed, row_ids))
            for fraction, budget in budgets.items():
                resident = max(0, int(fraction * table_bytes) - index_bytes - copies.map_bytes) // PAGE_SIZE
                budget["split_copies"] = budget.get("split_copies", 0) + int(
                    np.count_nonzero(copies_fresh & (copies_sorted >= resident)))
        prepared_page = slot_of_row[row_ids] // ROWS_PER_PAGE
        prepared_sorted, prepared_fresh = first_of_each_page(prepared_page.reshape(row_ids.shape))
        seen = seen_ngrams.seen(mixed)
        ngrams += seen.size
        unseen_ngrams += int(np.count_nonzero(~seen))
        for budget in budgets.values():
            split = reads_by_ngram(prepared_page, seen, budget["charged_pages"])
            for key, count in zip(("seen", "unseen", "seen_groups_not_resident"), split):
                budget[key] += count
        byte = row_ids * ROW_BYTES
        first_page = (byte // PAGE_SIZE).astype(np.int32)
        last_page = ((byte + ROW_BYTES - 1) // PAGE_SIZE).astype(np.int32)
        checkpoint_sorted, checkpoint_fresh = first_of_each_page(
            np.concatenate([first_page, np.where(last_page == first_page, -1, last_page)], axis=1))
        for budget in budgets.values():
            for key, resident in (("prepared", budget["resident_pages"]),
                                  ("prepared_charged", budget["charged_pages"])):
                budget[key] += int(np.count_nonzero(prepared_fresh & (prepared_sorted >= resident)))
            budget["prepared_row_hits"] += int(np.count_nonzero(prepared_page < budget["resident_pages"]))
            resident = budget["checkpoint_resident"]
            budget["checkpoint_row_hits"] += int(np.count_nonzero(resident[first_page] & resident[last_page]))
            budget["checkpoint"] += int(np.count_nonzero(checkpoint_fresh & ~resident[checkpoint_sorted]))
    timings["evaluate_s"] = round(time.perf_counter() - clock, 1)

    result = {
        "corpus": corpus["info"], "evaluation_tokens": tokens,
        "profile": profile.summary(),
        "geometry": {"base": args.base, "rows": num_rows, "table_bytes": table_bytes},
        "layout": {"num_placed": order.num_placed, "map_bytes": map_bytes,
                   "map_bytes_per_placed_row": round(map_bytes / max(order.num_placed, 1), 3),
                   "lookup_index_bytes": index_bytes,
                   "lookup_index_bytes_per_placed_row": round(index_bytes / max(order.num_placed, 1), 3),
                   "lookup_index_fraction_of_table": round(index_bytes / table_bytes, 5),
                   "groups_seen": plan.groups_seen, "groups_placed": plan.groups_placed,
                   "groups_split": plan.groups_split},
        "unseen_ngram_fraction": round(unseen_ngrams / max(ngrams, 1), 4),
        "budgets": [], "timings": timings, "seconds": round(time.perf_counter() - started, 1),
    }
    if duplicated is not None:
        prepared_pages = -(-num_rows // ROWS_PER_PAGE)
        result["duplicated"] = {"groups": duplicated.groups, "distinct_seen_rows": duplicated.distinct_seen_rows,
                                "copied_rows": 8 * duplicated.groups - duplicated.distinct_seen_rows,
                                "file_growth": round(duplicated.num_pages / prepared_pages - 1, 4)}
    if keyed is not None:
        result["group_keyed"] = {"groups": keyed.groups, "map_bytes": keyed.map_bytes,
                                 "file_growth": round(keyed.grouped_pages / keyed.table_pages, 4)}
    if copies is not None:
        result["split_copies"] = {"split_groups": copies.split_groups, "copied_groups": copies.groups,
                                  "copied_rows": copies.copied_rows, "group_map_bytes": copies.map_bytes,
                                  "file_growth": round(copies.copied_rows / num_rows, 4),
                                  **({"pushed_out_rows": copies.pushed_rows} if args.make_room else {})}
    if hashed is not None:
        result["hashed_copies"] = {"split_groups": hashed.split_groups, "copied_groups": hashed.groups,
                                   "copy_pages": hashed.copy_pages, "copy_table_bytes": hashed.map_bytes,
                                   "file_growth": round(hashed.copy_pages * ROWS_PER_PAGE / num_rows, 4)}
    for fraction, budget in budgets.items():
        per_k = {key: round(1000 * budget[key] / tokens, 1)
                 for key in ("prepared", "prepared_charged", "checkpoint", "duplicated", "group_keyed",
                             "split_copies", "hashed_copies")
                 if key in budget}
        result["budgets"].append({
            "budget": f"{fraction:.0%}", "resident_bytes": budget["resident_pages"] * PAGE_SIZE,
            "page_reads_per_1000_tokens": per_k,
            "ratio_prepared_to_checkpoint": round(budget["prepared"] / budget["checkpoint"], 3),
            "ratio_map_charged": round(budget["prepared_charged"] / budget["checkpoint"], 3),
            "by_ngram": {"seen_per_1000_tokens": round(1000 * budget["seen"] / tokens, 1),
                         "unseen_per_1000_tokens": round(1000 * budget["unseen"] / tokens, 1),
                         "seen_groups_not_resident_per_1000_tokens":
                             round(1000 * budget["seen_groups_not_resident"] / tokens, 1),
                         "ratio_unseen": round(budget["unseen"] / budget["checkpoint"], 3),
                         "ratio_one_page_a_seen_group": round(
                             (budget["unseen"] + budget["seen_groups_not_resident"]) / budget["checkpoint"], 3)},
            **({"ratio_duplicated_map_charged": round(budget["duplicated"] / budget["checkpoint"], 3)}
               if "duplicated" in budget else {}),
            **({"ratio_group_keyed_map_charged": round(budget["group_keyed"] / budget["checkpoint"], 3)}
               if "group_keyed" in budget else {}),
            **({"ratio_split_copies_maps_charged": round(budget["split_copies"] / budget["checkpoint"], 3)}
               if "split_copies" in budget else {}),
            **({"ratio_hashed_copies_maps_charged": round(budget["hashed_copies"] / budget["checkpoint"], 4)}
               if "hashed_copies" in budget else {}),
            "row_hit_fraction": {"prepared": round(budget["prepared_row_hits"] / (16 * tokens), 4),
                                 "checkpoint": round(budget["checkpoint_row_hits"] / (16 * tokens), 4)},
        })
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
