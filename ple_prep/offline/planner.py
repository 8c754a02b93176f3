"""Plan an access-ordered layout from a profile, and the residency hints it buys.

The hottest n-gram groups (the `heads_per_ngram` rows one n-gram reads) come first, densely
packed, each group's not-yet-placed rows kept on one page where it fits, so a seen n-gram that is
not resident costs one page read instead of eight. A page's last few slots, too few for the next
hot group, take the coldest groups that fit whole (or, when none does, part of the coldest one);
that keeps hot groups whole without holes. Rows never seen follow in source order (`RowOrder`).

Only the order is computed here: nothing reads or writes rows, so a layout for the real
320M-row geometry can be planned and measured without a 48 GiB file.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..converters.base import TableSource
from ..core.constants import DEFAULT_MAP_FRACTION
from ..core.errors import BadInput
from ..format.header import ORDER_BYTES_PER_PLACED
from ..format.layout import TableLayout
from ..format.order import RowOrder
from ..format.pages import pages_for
from ..ngram import rows_of_mixed
from .profile import Profile

MAX_MAP_FRACTION = 0.02
BUDGETS_GIB = (0.25, 0.5, 1, 2, 4, 8, 16)
BUDGETS_PERCENT = (1, 2, 5, 10, 20)


@dataclasses.dataclass
class Plan:
    order: RowOrder
    groups_placed: int
    groups_split: int  # placed groups spread over more than one run of slots
    groups_seen: int

    def layout(self, profile: Profile, map_fraction: float) -> dict[str, Any]:
        """The manifest's `layout` entry."""
        return {"kind": "access-ordered", "num_placed": self.order.num_placed,
                "map_bytes": ORDER_BYTES_PER_PLACED * self.order.num_placed,
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
    """Placed rows whose order map fits `map_fraction` of the table's bytes."""
    check_map_fraction(map_fraction)
    return min(num_rows, int(map_fraction * num_rows * row_bytes) // ORDER_BYTES_PER_PLACED)


def _hot_groups(profile: Profile, first_row: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The training part's groups, hottest first (ties: lower order, then hash), as local row
    ids `(groups, heads_per_ngram)` with -1 for rows outside [first_row, first_row + num_rows)."""
    spec = profile.spec
    keys, counts, orders = [], [], []
    for order, (values, group_counts) in sorted(profile.parts["train"].groups.items()):
        keys.append(values)
        counts.append(group_counts)
        orders.append(np.full(len(values), order, dtype=np.int64))
    if not keys:
        return np.zeros((0, spec.heads_per_ngram), np.int64), np.zeros(0, np.uint64)
    keys, counts, orders = np.concatenate(keys), np.concatenate(counts), np.concatenate(orders)
    hottest = np.lexsort((keys, orders, ~counts))
    keys, counts, orders = keys[hottest], counts[hottest], orders[hottest]
    rows = np.empty((len(keys), spec.heads_per_ngram), dtype=np.int64)
    for order in np.unique(orders):
        chosen = orders == order
        rows[chosen] = rows_of_mixed(keys[chosen], int(order), spec)
    rows -= first_row
    rows[(rows < 0) | (rows >= num_rows)] = -1
    return rows, counts


def _pack(sizes: list[int], capacity: int, spare: int = 0) -> list[tuple[int, int, int]]:
    """Order groups of `sizes` rows (hottest first) into pages of `capacity` slots.

    Returns (group, first, stop) pieces in slot order. A page's end too small for the next group
    takes, in this order: the coldest group that fits whole; rows of the spare pool (group index
    `len(sizes)`, `spare` rows: rows beyond the map's cap, which would cost a page read each
    anyway); a cut of the coldest group. Groups larger than a page are placed as they come.
    """
    pool = len(sizes)
    remaining = list(sizes) + [spare]
    taken = [0] * (len(sizes) + 1)
    largest = max(sizes, default=0)
    # Per size, group indices ascending: the coldest of a size is popped from the end.
    queues: list[list[int]] = [[] for _ in range(largest + 1)]
    for group, size in enumerate(sizes):
        queues[size].append(group)
    pieces: list[tuple[int, int, int]] = []
    front, back, fill = 0, len(sizes) - 1, 0

    def place(group: int, count: int) -> None:
        nonlocal fill
        pieces.append((group, taken[group], taken[group] + count))
        taken[group] += count
        remaining[group] -= count
        fill = (fill + count) % capacity

    while True:
        while front < pool and remaining[front] == 0:
            front += 1
        if front == pool:
            return pieces
        free = capacity - fill
        if remaining[front] <= free or remaining[front] > capacity:
            place(front, remaining[front])
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
        elif remaining[pool]:
            place(pool, min(free, remaining[pool]))
        else:
            while remaining[back] == 0:
                back -= 1
            if back == front:
                place(front, remaining[front])
                continue
            # Nothing else fits the page's end: cut the coldest group to fill it.
            place(back, free)
            queues[remaining[back]].append(back)


def plan_order(profile: Profile, num_rows: int, rows_per_page: int, *, max_placed: int,
               first_row: int = 0) -> Plan:
    """The access order for rows [first_row, first_row + num_rows) of a table with this geometry."""
    rows, _ = _hot_groups(profile, first_row, num_rows)
    groups_seen = len(rows)
    flat = rows.reshape(-1)
    # A row is new to the group that reads it first in hotness order.
    is_new = np.zeros(len(flat), dtype=bool)
    inside = np.flatnonzero(flat >= 0)
    _, first_seen = np.unique(flat[inside], return_index=True)
    is_new[inside[first_seen]] = True
    new_per_group = is_new.reshape(rows.shape).sum(axis=1)
    # Each group's new rows, contiguous in `new_rows` (flat is group-major); the rows of groups
    # beyond the cap follow as the spare pool.
    new_rows = flat[is_new]
    group_start = np.concatenate([[0], np.cumsum(new_per_group)[:-1]])
    # Spare rows filling page ends count against the cap too: pack once, then again with the
    # groups' share shrunk by the spare rows the first packing used.
    limit = max_placed
    for _ in range(2):
        within_cap = np.cumsum(new_per_group) <= limit
        kept = np.flatnonzero(within_cap & (new_per_group > 0))
        spare = new_rows[~np.repeat(within_cap, new_per_group)]
        pieces = _pack(new_per_group[kept].tolist(), rows_per_page, len(spare))
        spare_used = sum(stop - first for group, first, stop in pieces if group == len(kept))
        if new_per_group[kept].sum() + spare_used <= max_placed:
            break
        limit = max_placed - spare_used
    if not pieces:
        return Plan(RowOrder.from_placed(np.zeros(0, np.int64), num_rows), 0, 0, groups_seen)
    piece_groups = np.array([p[0] for p in pieces], dtype=np.int64)
    piece_first = np.array([p[1] for p in pieces], dtype=np.int64)
    piece_length = np.array([p[2] - p[1] for p in pieces], dtype=np.int64)
    from_pool = piece_groups == len(kept)
    starts = np.where(from_pool, len(new_rows) + piece_first,
                      group_start[kept[np.minimum(piece_groups, len(kept) - 1)]] + piece_first)
    offsets = np.concatenate([[0], np.cumsum(piece_length)[:-1]])
    positions = np.repeat(starts - offsets, piece_length) + np.arange(piece_length.sum())
    # Whatever still passes the cap is the coldest tail: it goes.
    placed = np.concatenate([new_rows, spare])[positions][:max_placed]
    whole = np.cumsum(piece_length) <= max_placed
    groups = piece_groups[~from_pool]
    pieces_per_group = np.bincount(groups, minlength=len(kept))
    cut_off = np.bincount(groups[~whole[~from_pool]], minlength=len(kept)) > 0
    return Plan(RowOrder.from_placed(placed, num_rows), int(np.count_nonzero(~cut_off)),
                int(np.count_nonzero((pieces_per_group > 1) & ~cut_off)), groups_seen)


def budget_rows(budget_bytes: int, *, num_rows: int, rows_per_page: int, page_size: int) -> int:
    """Leading rows that whole pages within `budget_bytes` hold."""
    return min(num_rows, budget_bytes // page_size * rows_per_page)


def residency_hints(order: RowOrder, profile: Profile, *, row_bytes: int, rows_per_page: int,
                    page_size: int, first_row: int = 0) -> list[dict[str, Any]]:
    """For each budget, the leading rows to keep resident and the fraction of held-out row reads
    they serve. Measured on the profile's held-out requests, which never shaped the order."""
    num_rows = order.num_rows
    rows, counts = profile.parts["heldout"].rows(profile.spec)
    local = rows - first_row
    inside = (local >= 0) & (local < num_rows)
    slots = order.slot_of(local[inside])
    by_slot = np.argsort(slots, kind="stable")
    sorted_slots = slots[by_slot]
    served = np.concatenate([[0], np.cumsum(counts[inside][by_slot], dtype=np.uint64)])
    total = int(served[-1])
    table_bytes = num_rows * row_bytes
    budgets = [(f"{gib:g} GiB", int(gib * 2**30)) for gib in BUDGETS_GIB]
    budgets += [(f"{percent}%", table_bytes * percent // 100) for percent in BUDGETS_PERCENT]
    hints = []
    for label, budget in budgets:
        resident = budget_rows(budget, num_rows=num_rows, rows_per_page=rows_per_page,
                               page_size=page_size)
        hits = int(served[np.searchsorted(sorted_slots, resident)])
        hints.append({"budget": label, "budget_bytes": budget, "rows": resident,
                      "pages": pages_for(resident, rows_per_page),
                      "hit_fraction": round(hits / total, 6) if total else None})
    return hints


def plan_for_source(source: TableSource, profile: Profile, *, page_size: int,
                    map_fraction: float = DEFAULT_MAP_FRACTION, first_row: int = 0,
                    num_rows: int | None = None) -> TableLayout:
    """The layout `writer.convert` writes for rows [first_row, first_row + num_rows) of this source
    (all rows by default): the access order, its manifest entry and the residency hints."""
    num_rows = source.num_rows - first_row if num_rows is None else num_rows
    limit = max_placed_rows(num_rows, source.row_bytes, map_fraction)
    if profile.spec != source.spec:
        raise BadInput("the profile was made with another model's hash (its spec differs from "
                       "this checkpoint's); profile with this --model")
    if not 0 < source.row_bytes <= page_size:
        raise BadInput(f"a {source.row_bytes}-byte row does not fit a {page_size}-byte page")
    rows_per_page = page_size // source.row_bytes
    plan = plan_order(profile, num_rows, rows_per_page, max_placed=limit, first_row=first_row)
    residency = residency_hints(plan.order, profile, row_bytes=source.row_bytes,
                                rows_per_page=rows_per_page, page_size=page_size, first_row=first_row)
    return TableLayout(plan.order, plan.layout(profile, map_fraction), tuple(residency))
