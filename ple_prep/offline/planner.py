"""Plan an access-ordered layout from a profile, and the residency hints it buys.

The hottest n-gram groups (the `heads_per_ngram` rows one n-gram reads) come first, densely
packed, each group's not-yet-placed rows kept on one page where it fits, so a seen n-gram that is
not resident costs one page read instead of eight. A page's last few slots, too few for the next
hot group, take the coldest groups that fit whole (or, when none does, part of the coldest one);
that keeps hot groups whole without holes. Rows never seen follow in source order (`RowOrder`).

Only the order is computed here: nothing reads or writes rows, so a layout for the real
320M-row geometry can be planned and measured without a 48 GiB file. Memory stays a few bytes a
seen group and a placed row: groups are hashed into rows a chunk at a time against a bitmap of the
rows already taken, and the packing keeps its state in compact arrays.
"""
from __future__ import annotations

import array
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ..converters.base import TableSource
from ..core.constants import DEFAULT_MAP_FRACTION, ORDER_DTYPE
from ..core.errors import BadInput
from ..format.header import ORDER_BYTES_PER_PLACED
from ..format.layout import TableLayout
from ..format.order import RowOrder, lookup_index_bytes
from ..format.pages import pages_for
from ..ngram import rows_of_mixed
from .profile import PARTS, Profile, load_profile

try:
    from ..core import _native
except ImportError:  # built without a C compiler: the numpy and Python code does the same
    _native = None

MAX_MAP_FRACTION = 0.02
BUDGETS_GIB = (0.25, 0.5, 1, 2, 4, 8, 16)
BUDGETS_PERCENT = (1, 2, 5, 10, 20)
# Groups hashed into rows per step (bounds the temporaries: 8 int64 rows a group).
GROUP_CHUNK = 1 << 14
# Pieces turned into slot positions per step.
PIECE_CHUNK = 1 << 18


@dataclasses.dataclass
class Plan:
    order: RowOrder
    groups_placed: int
    groups_split: int  # placed groups spread over more than one run of slots
    groups_seen: int

    def layout(self, profile: Profile, map_fraction: float) -> dict[str, Any]:
        """The manifest's `layout` entry."""
        return {"kind": "access-ordered", "num_placed": self.order.num_placed,
                "map_bytes": ORDER_BYTES_PER_PLACED[2] * self.order.num_placed,
                "lookup_index_bytes": lookup_index_bytes(self.order.num_rows, self.order.num_placed),
                "map_fraction_limit": map_fraction, "groups_seen": self.groups_seen,
                "groups_placed": self.groups_placed, "groups_split": self.groups_split,
                "profile": {"model": profile.model, "requests": profile.requests,
                            "tokens": profile.tokens,
                            "train_tokens": profile.parts["train"].tokens,
                            "heldout_tokens": profile.parts["heldout"].tokens,
                            "inputs": [entry["name"] for entry in profile.inputs][:100]}}


def check_map_fraction(map_fraction: float) -> None:
    if not 0 <= map_fraction < MAX_MAP_FRACTION:
        raise BadInput(f"the row-order map must stay below {MAX_MAP_FRACTION:.0%} of the table; "
                       f"{map_fraction} is out of range")


def max_placed_rows(num_rows: int, row_bytes: int, map_fraction: float = DEFAULT_MAP_FRACTION) -> int:
    """Placed rows whose lookup index (what a server holds for the map, `lookup_index_bytes`) fits
    `map_fraction` of the table's bytes."""
    check_map_fraction(map_fraction)
    allowed = int(map_fraction * num_rows * row_bytes)
    # The index's bytes grow with the placed rows (their slots' bits too): the most that fit, by bisection.
    low, high = 0, num_rows
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if lookup_index_bytes(num_rows, middle) <= allowed else (low, middle - 1)
    return low


def _summed(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One order's groups from several parts (each part's keys distinct): the first part's keys,
    then the others' new ones, counts summed (uint64). A lookup into the first part's keys, not a
    sort of them all: planning is the memory peak of a convert."""
    values, counts = pieces[0]
    if len(pieces) > 1:
        counts = counts.astype(np.uint64)  # a copy: the sums must not write into the profile
    for other_values, other_counts in pieces[1:]:
        if len(values) > 1 and np.any(values[1:] < values[:-1]):
            by_key = np.argsort(values, kind="stable")
            values, counts = values[by_key], counts[by_key]
        where = np.minimum(np.searchsorted(values, other_values), max(len(values) - 1, 0))
        found = values[where] == other_values if len(values) else np.zeros(len(other_values), dtype=bool)
        counts[where[found]] += other_counts[found].astype(np.uint64)
        values = np.concatenate([values, other_values[~found]])
        counts = np.concatenate([counts, other_counts[~found].astype(np.uint64)])
    return values, counts


def _hot_groups(profile: Profile, parts: tuple[str, ...] = ("train",), *,
                with_counts: bool = False) -> tuple[np.ndarray, ...]:
    """The groups of these parts of the profile, their counts summed, hottest first (ties: lower
    order, then hash): their mixed hashes (uint64) and orders (uint8), and their counts if asked."""
    keys, counts, orders = [], [], []
    for order in sorted({order for part in parts for order in profile.parts[part].groups}):
        values, group_counts = _summed([profile.parts[part].groups[order] for part in parts
                                        if order in profile.parts[part].groups])
        keys.append(values)
        counts.append(group_counts)
        orders.append(np.full(len(values), order, dtype=np.uint8))
    if not keys:
        return (np.zeros(0, np.uint64), np.zeros(0, np.uint8)) + ((np.zeros(0, np.uint64),) if with_counts else ())
    keys, counts, orders = np.concatenate(keys), np.concatenate(counts), np.concatenate(orders)
    hottest = np.lexsort((keys, orders, ~counts))
    counts = (counts[hottest],) if with_counts else ()  # else freed before the keys are reordered
    return (keys[hottest], orders[hottest]) + counts


def _group_rows(keys: np.ndarray, orders: np.ndarray, spec, first_row: int, num_rows: int) -> np.ndarray:
    """Local row ids `(groups, heads_per_ngram)` of these groups, -1 for rows outside the slice."""
    rows = np.empty((len(keys), spec.heads_per_ngram), dtype=np.int64)
    for order in np.unique(orders):
        chosen = orders == order
        rows[chosen] = rows_of_mixed(keys[chosen], int(order), spec)
    rows -= first_row
    rows[(rows < 0) | (rows >= num_rows)] = -1
    return rows


def _new_rows(keys: np.ndarray, orders: np.ndarray, spec, first_row: int,
              num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's rows not read by a hotter group, in head order, the groups' runs back to back
    (uint32), and how many each group has (uint8). A bitmap of the rows taken so far replaces a
    sort of all of them."""
    taken = np.zeros(-(-num_rows // 64), dtype=np.uint64)
    new_rows = np.empty(min(num_rows, spec.heads_per_ngram * len(keys)), dtype=ORDER_DTYPE)
    new_per_group = np.zeros(len(keys), dtype=np.uint8)
    take = _take_new_rows if _native is None else _native.take_new_rows
    filled = 0
    for start in range(0, len(keys), GROUP_CHUNK):
        rows = _group_rows(keys[start:start + GROUP_CHUNK], orders[start:start + GROUP_CHUNK], spec,
                           first_row, num_rows)
        filled = take(rows.reshape(-1), spec.heads_per_ngram, taken, new_rows, filled,
                      new_per_group[start:start + len(rows)])
    return new_rows[:filled], new_per_group


def _take_new_rows(flat: np.ndarray, heads: int, taken: np.ndarray, new_rows: np.ndarray, filled: int,
                   new_per_group: np.ndarray) -> int:
    """`_new_rows`'s step over a chunk of groups (`flat`: their rows, `heads` a group, -1 outside the
    slice): the rows not set in `taken` set there and appended to `new_rows` from `filled`, each
    group's count of them into `new_per_group`; returns the new `filled`. The numpy fallback of
    core/native/pack.c's `take_new_rows`."""
    inside = np.flatnonzero(flat >= 0)
    inside_rows = flat[inside]
    held = (taken[inside_rows >> 6] >> (inside_rows & 63).astype(np.uint64)) & np.uint64(1)
    candidates = inside[held == 0]
    # A row read by two groups of this chunk is new to the hotter one (the earlier position):
    # one sort of row and position packed in an int64 puts each row's first position first
    # (a stable argsort of the rows, as np.unique does, costs several times more).
    # Local rows are below 2**32 and a step's positions far below 2**31: the key fits.
    position_bits = max(1, (len(flat) - 1).bit_length())
    keyed = np.sort((flat[candidates] << position_bits) | candidates)
    ascending = keyed >> position_bits
    first = np.ones(len(keyed), dtype=bool)
    np.not_equal(ascending[1:], ascending[:-1], out=first[1:])
    is_new = np.zeros(len(flat), dtype=bool)
    is_new[keyed[first] & ((1 << position_bits) - 1)] = True
    _mark_taken(taken, ascending[first])
    fresh = flat[is_new]
    new_rows[filled:filled + len(fresh)] = fresh
    new_per_group[:] = np.count_nonzero(is_new.reshape(-1, heads), axis=1)
    return filled + len(fresh)


def _mark_taken(taken: np.ndarray, rows: np.ndarray) -> None:
    """Set the bits of `rows` (distinct, ascending) in the bitmap `taken`: the bits of one word
    OR-ed together first, so each word is written once (ufunc.at is many times slower)."""
    if not len(rows):
        return
    words = rows >> 6
    bits = np.left_shift(np.uint64(1), (rows & 63).astype(np.uint64))
    starts = np.flatnonzero(np.diff(words, prepend=-1))
    taken[words[starts]] |= np.bitwise_or.reduceat(bits, starts)


def _pack(sizes: np.ndarray, capacity: int, spare: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order groups of `sizes` rows (hottest first) into pages of `capacity` slots.

    Returns the pieces in slot order as three arrays: group, first row taken of it, rows taken.
    A page's end too small for the next group takes, in this order: the coldest group that fits
    whole; rows of the spare pool (group index `len(sizes)`, `spare` rows: rows beyond the map's
    cap, which would cost a page read each anyway); a cut of the coldest group. Groups larger than
    a page are placed as they come. State is kept in byte arrays (sizes are at most a group's
    rows), so millions of groups cost a few bytes each.
    """
    sizes = np.asarray(sizes, dtype=np.uint8)
    if _native is not None:
        return _pack_native(sizes, capacity, spare)
    pool = len(sizes)
    remaining = bytearray(sizes.tobytes())
    taken = bytearray(len(sizes))
    pool_left, pool_taken = spare, 0
    largest = int(sizes.max(initial=0))
    # Per size, group indices ascending: the coldest of a size is popped from the end. Built from
    # bytes, not lists: millions of Python ints would stay in the heap after they are freed.
    queues = [array.array("q", np.flatnonzero(sizes == size).astype(np.int64).tobytes() if size <= capacity else b"")
              for size in range(largest + 1)]
    # Pieces: a group index, its first row (the spare pool's can be large) and a count of at most
    # a page's rows (a byte where pages hold fewer than 256 rows, as they do for this model).
    piece_group, piece_first = array.array("i"), array.array("q")
    piece_count = array.array("B" if capacity < 256 else "q")
    front, back, fill = 0, len(sizes) - 1, 0

    def place(group: int, count: int) -> None:
        nonlocal fill, pool_left, pool_taken
        piece_group.append(group)
        if group == pool:
            piece_first.append(pool_taken)
            pool_taken += count
            pool_left -= count
        else:
            piece_first.append(taken[group])
            taken[group] += count
            remaining[group] -= count
        piece_count.append(count)
        fill = (fill + count) % capacity

    add_group, add_first, add_count = piece_group.append, piece_first.append, piece_count.append
    while True:
        while front < pool and remaining[front] == 0:
            front += 1
        if front == pool:
            return tuple(np.frombuffer(a, dtype=np.dtype(a.typecode).newbyteorder("=")) if len(a)
                         else np.zeros(0, np.int64) for a in (piece_group, piece_first, piece_count))
        free = capacity - fill
        size = remaining[front]
        if size <= free or size > capacity:
            # `place(front, size)` spelled out: the path nearly every group takes.
            add_group(front)
            add_first(taken[front])
            add_count(size)
            taken[front] += size
            remaining[front] = 0
            fill = (fill + size) % capacity
            front += 1
            continue
        filler = None
        for size in range(min(free, largest), 0, -1):
            queue = queues[size]
            while queue and (remaining[queue[-1]] != size or queue[-1] <= front):
                queue.pop()
            if queue:
                filler = queue.pop()
                break
        if filler is not None:
            place(filler, remaining[filler])
        elif pool_left:
            place(pool, min(free, pool_left))
        else:
            while remaining[back] == 0:
                back -= 1
            if back == front:
                place(front, remaining[front])
                continue
            # Nothing else fits the page's end: cut the coldest group to fill it.
            place(back, free)
            queues[remaining[back]].append(back)


def _pack_native(sizes: np.ndarray, capacity: int, spare: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_pack` in C (core/native/pack.c). Pieces are the groups plus at most a cut or a spare piece
    a page; pieces arrays too short for them (a page end filled from the pool nearly every page)
    are made longer and the packing run again."""
    pages = int(sizes.sum(dtype=np.int64)) // capacity + 1
    extra = 2 * pages + 16
    while True:
        bound = len(sizes) + extra
        pieces = (np.empty(bound, np.int32), np.empty(bound, np.int64),
                  np.empty(bound, np.uint8 if capacity < 256 else np.int64))
        count = _native.pack_groups(sizes, capacity, spare, *pieces)
        if count >= 0:
            return tuple(piece[:count] for piece in pieces)
        extra *= 2


def plan_order(profile: Profile, num_rows: int, rows_per_page: int, *, max_placed: int,
               first_row: int = 0, parts: tuple[str, ...] = ("train",), release_counts: bool = False) -> Plan:
    """The access order for rows [first_row, first_row + num_rows) of a table with this geometry,
    from the groups of these parts of the profile. With `release_counts` (a profile loaded for this
    plan alone), their counts are dropped from `profile` once sorted, so they are not held through
    the packing (the planner's peak)."""
    keys, orders = _hot_groups(profile, parts)
    if release_counts:
        for part in parts:
            profile.parts[part].groups.clear()
    groups_seen = len(keys)
    new_rows, new_per_group = _new_rows(keys, orders, profile.spec, first_row, num_rows)
    del keys, orders
    ends = np.cumsum(new_per_group, dtype=np.int64)
    # Spare rows filling page ends count against the cap too: pack once, then again with the
    # groups' share shrunk by the spare rows the first packing used. Groups within the cap are a
    # prefix (the ends ascend); the rows of the groups beyond it follow them as the spare pool.
    limit = max_placed
    for _ in range(2):
        within = int(np.searchsorted(ends, limit, side="right"))
        kept = np.flatnonzero(new_per_group[:within] > 0).astype(np.int32)
        within_rows = int(ends[within - 1]) if within else 0
        groups, firsts, counts = _pack(new_per_group[kept], rows_per_page, len(new_rows) - within_rows)
        spare_used = int(counts[groups == len(kept)].sum())
        if within_rows + spare_used <= max_placed:
            break
        limit = max_placed - spare_used
    # Where each kept group's rows start in `new_rows` (int32: fewer rows than 2**32 a table).
    kept_start = (ends[kept] - new_per_group[kept]).astype(np.int32)
    del ends
    if not len(groups):
        return Plan(RowOrder.identity(num_rows), 0, 0, groups_seen)
    # Whatever still passes the cap is the coldest tail: it goes.
    num_placed = min(max_placed, int(counts.sum()))
    placed = np.empty(num_placed, dtype=ORDER_DTYPE)
    piece_ends = np.cumsum(counts, dtype=np.int64)
    for start in range(0, len(groups), PIECE_CHUNK):
        stop = min(start + PIECE_CHUNK, len(groups))
        from_pool = groups[start:stop] == len(kept)
        starts = np.where(from_pool, within_rows + firsts[start:stop],
                          kept_start[np.minimum(groups[start:stop], len(kept) - 1)] + firsts[start:stop])
        lengths = counts[start:stop].astype(np.int64)
        offsets = piece_ends[start:stop] - lengths
        positions = np.repeat(starts - offsets, lengths) + np.arange(offsets[0], piece_ends[stop - 1])
        first_slot, last_slot = int(offsets[0]), min(num_placed, int(piece_ends[stop - 1]))
        if first_slot < last_slot:
            placed[first_slot:last_slot] = new_rows[positions[:last_slot - first_slot]]
    del new_rows, kept_start
    whole = piece_ends <= max_placed
    is_group = groups != len(kept)
    pieces_per_group = np.bincount(groups[is_group], minlength=len(kept))
    cut_off = np.bincount(groups[is_group & ~whole], minlength=len(kept)) > 0
    placed_whole = int(np.count_nonzero(~cut_off))
    split = int(np.count_nonzero((pieces_per_group > 1) & ~cut_off))
    del groups, firsts, counts, piece_ends, whole, is_group, pieces_per_group, cut_off
    return Plan(RowOrder.from_placed(placed, num_rows), placed_whole, split, groups_seen)


def budget_rows(budget_bytes: int, *, num_rows: int, rows_per_page: int, page_size: int) -> int:
    """Leading rows that whole pages within `budget_bytes` hold."""
    return min(num_rows, budget_bytes // page_size * rows_per_page)


def residency_hints(order: RowOrder, profile: Profile, *, row_bytes: int, rows_per_page: int,
                    page_size: int, first_row: int = 0) -> list[dict[str, Any]]:
    """For each budget, the leading rows to keep resident and the fraction of held-out row reads
    they serve. Measured on the profile's held-out requests, which never shaped the order; one
    head's rows at a time, and the lookup index's slots freed after (offline memory stays small)."""
    num_rows = order.num_rows
    table_bytes = num_rows * row_bytes
    budgets = [(f"{gib:g} GiB", int(gib * 2**30)) for gib in BUDGETS_GIB]
    budgets += [(f"{percent}%", table_bytes * percent // 100) for percent in BUDGETS_PERCENT]
    resident = [budget_rows(budget, num_rows=num_rows, rows_per_page=rows_per_page, page_size=page_size)
                for _, budget in budgets]
    hits, total = [0] * len(budgets), 0
    for rows, counts in profile.parts["heldout"].rows_by_head(profile.spec):
        local = rows - first_row
        inside = (local >= 0) & (local < num_rows)
        slots, counts = order.slot_of(local[inside]), counts[inside]
        total += int(counts.sum(dtype=np.uint64))
        for index, leading in enumerate(resident):
            hits[index] += int(counts[slots < leading].sum(dtype=np.uint64))
    order.drop_slots()
    return [{"budget": label, "budget_bytes": budget, "rows": leading, "pages": pages_for(leading, rows_per_page),
             "hit_fraction": round(hit / total, 6) if total else None}
            for (label, budget), leading, hit in zip(budgets, resident, hits)]


def plan_for_source(source: TableSource, profile: Profile | Path, *, page_size: int,
                    map_fraction: float = DEFAULT_MAP_FRACTION, first_row: int = 0,
                    num_rows: int | None = None) -> TableLayout:
    """The layout `writer.convert` writes for rows [first_row, first_row + num_rows) of this source
    (all rows by default): the access order, its manifest entry and the residency hints.

    The written order is planned from both parts of the profile (every n-gram it saw: unseen ones
    cost 8 page reads, so the held-out part's groups are worth placing). The hints are measured on
    the held-out requests against an order planned from the training part alone, which never saw
    them: an honest estimate, a little below what the written order serves. Given a profile file,
    each plan's counts are dropped once sorted: what is in memory at a time is one plan's, or the
    training order and the counts of both parts while the hints are measured."""
    num_rows = source.num_rows - first_row if num_rows is None else num_rows
    limit = max_placed_rows(num_rows, source.row_bytes, map_fraction)
    if not 0 < source.row_bytes <= page_size:
        raise BadInput(f"a {source.row_bytes}-byte row does not fit a {page_size}-byte page")
    rows_per_page = page_size // source.row_bytes

    def load(parts: tuple[str, ...]) -> Profile:
        loaded = load_profile(profile, parts=parts) if isinstance(profile, Path) else profile
        if loaded.spec != source.spec:
            raise BadInput("the profile was made with another model's hash (its spec differs from "
                           "this checkpoint's); profile with this --model")
        return loaded

    release = isinstance(profile, Path)
    order = plan_order(load(("train",)), num_rows, rows_per_page, max_placed=limit, first_row=first_row,
                       release_counts=release).order
    # Both parts read once more: the hints read the held-out part, the written order both (each
    # read decompresses the whole file, per-row arrays and all).
    both = load(PARTS)
    residency = residency_hints(order, both, row_bytes=source.row_bytes, rows_per_page=rows_per_page,
                                page_size=page_size, first_row=first_row)
    del order
    plan = plan_order(both, num_rows, rows_per_page, max_placed=limit, first_row=first_row, parts=PARTS,
                      release_counts=release)
    return TableLayout(plan.order, plan.layout(both, map_fraction), tuple(residency))
