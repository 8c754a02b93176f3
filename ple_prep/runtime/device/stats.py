"""What an EmbeddingSource has served, counted since it was made (`EmbeddingSource.stats()`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SourceStats:
    """Counts since the source was made; `later - earlier` gives a window's counts.

    Rows are counted per position served, except `rows_read` and `rows_host_cache`, which count the
    distinct rows of the cold requests read through the table's read path (a cold request reads
    each distinct row once) and those its host cache held instead (`Table.host_cache`).
    """

    starts: int = 0            # requests started (start, or a call of the source)
    ids: int = 0               # their ids (positions)
    lookups: int = 0           # host lookups run (slots found, rows staged), wherever they ran
    rows_resident: int = 0     # positions served by the resident tier on the device
    rows_page_cache: int = 0   # disk-tier positions copied from the page cache (the request was cached)
    rows_disk: int = 0         # disk-tier positions served by rows read through the read path
    rows_read: int = 0         # rows read through the read path
    rows_host_cache: int = 0   # rows of those requests the table's host cache held (not read)
    starts_from_device: int = 0  # requests whose ids were given on the device
    helper_lookups: int = 0    # of those, looked up on a helper thread as soon as the ids landed
    helper_copies: int = 0     # of those, whose staged rows the helper thread copied to the device
    behind_copy: int = 0       # of those, whose ids and flags were queued behind the span's last copy
    host_copies: int = 0       # copies of the staged span launched from Python, outside a graph
    graph_captures: int = 0    # device halves captured as graphs (once per size)
    graph_replays: int = 0     # replays of those graphs through torch by an eager finish
    one_call_finishes: int = 0  # small device-ids finishes done in one call of the compiled helper

    def __sub__(self, other: "SourceStats") -> "SourceStats":
        return SourceStats(**{field.name: getattr(self, field.name) - getattr(other, field.name)
                              for field in dataclasses.fields(self)})
