"""Tensor-parallel rank files (docs/MODEL.md): rank r of T owns global rows [r*P, (r+1)*P), P = rows/T.

Each rank's file is a whole prepared table of its own (header `first_row` and the manifest's
`first_row`/`total_rows` carry the global range), written by the same atomic writer. Names put
`.tp{r}of{T}` before the suffix: `ple.bin` -> `ple.tp0of2.bin`, `ple.tp1of2.bin`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..converters.base import TableSource
from ..core.errors import BadInput
from ..format.header import Header
from ..format.layout import TableLayout
from .writer import RowRange, WriteOptions, check_convertible, check_free_space, convert


def rank_rows(total_rows: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first_row, num_rows) owned by `tp_rank` of `tp_size`; BadInput when T does not divide the rows."""
    if tp_size < 1:
        raise BadInput(f"--tp-size must be at least 1, not {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise BadInput(f"--tp-rank {tp_rank} is outside 0..{tp_size - 1} for --tp-size {tp_size}")
    if total_rows % tp_size:
        raise BadInput(f"{total_rows} rows do not split evenly over {tp_size} ranks "
                       f"(every rank owns rows/T rows); choose a divisor")
    per_rank = total_rows // tp_size
    return tp_rank * per_rank, per_rank


def rank_path(out: str | Path, tp_rank: int, tp_size: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.tp{tp_rank}of{tp_size}{out.suffix}")


def convert_ranks(source: TableSource, out: str | Path, tp_size: int,
                  tp_ranks: list[int] | None = None, options: WriteOptions | None = None, *,
                  progress: Callable[[int], None] | None = None,
                  layout_for: Callable[[int, int], TableLayout] | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Write one prepared file per rank in `tp_ranks` (all ranks by default); returns (path, manifest).

    `layout_for(first_row, num_rows)`, when given, returns a rank's layout
    (`offline.planner.plan_for_source`). Every rank's outputs, and free space for all of them, are
    checked before the first is written; each rank file is atomic on its own, published when done.
    """
    options = options or WriteOptions()
    # Checked before listing the ranks: --tp-size 2**62 must be refused, not allocated.
    rank_rows(source.num_rows, tp_size, 0)
    ranks = list(range(tp_size)) if tp_ranks is None else list(tp_ranks)
    ranges = [rank_rows(source.num_rows, tp_size, rank) for rank in ranks]
    out = Path(out)
    paths = [rank_path(out, rank, tp_size) for rank in ranks]
    for path in paths:
        check_convertible(source, path, options)
    sizes = [Header.for_table(page_size=options.page_size, row_bytes=source.row_bytes,
                              encoding=source.encoding, values_per_row=source.values_per_row,
                              num_rows=num_rows, first_row=first_row, num_placed=0,
                              file_id=bytes(16)).file_size
             for first_row, num_rows in ranges]
    check_free_space(out.parent, sum(sizes))
    written = []
    for rank, path, (first_row, num_rows) in zip(ranks, paths, ranges):
        layout = layout_for(first_row, num_rows) if layout_for is not None else None
        manifest = convert(source, path, options, layout=layout, progress=progress,
                           rows=RowRange(first_row, num_rows, tp_rank=rank, tp_size=tp_size))
        written.append((path, manifest))
    return written
