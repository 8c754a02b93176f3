"""Check a prepared table: its checksums, and (given the source) every row byte for byte."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..converters import open_source
from ..core.errors import BadInput
from ..core.fileio import open_regular, read_exactly
from ..format.header import header_region_crc
from ..format.manifest import load_table_manifest, manifest_path, validate_with_schema
from ..runtime import open_table
from .direct_io import DIRECT_IO_ALIGNMENT, aligned_zeros, set_direct
from .staleness import converted_elsewhere, source_changes

CHUNK_ROWS = 1 << 16
CHECKSUM_READ_BYTES = 8 << 20
MAX_REPORTED = 10


@dataclasses.dataclass
class VerifyReport:
    path: str
    checksum_blocks: int = 0
    bad_blocks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    header_ok: bool = True
    rows_compared: int = 0
    mismatched_rows: int = 0
    first_mismatches: list[int] = dataclasses.field(default_factory=list)
    source_problems: list[str] = dataclasses.field(default_factory=list)
    # Where the table came from, when the checkpoint given is another one (None otherwise).
    converted_from: str | None = None
    file_problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.header_ok and not self.bad_blocks and not self.mismatched_rows
                and not self.source_problems and not self.file_problems)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ok": self.ok}


def verify(path: str | Path, model: str | Path | None = None, *, sample: int | None = None,
           seed: int = 0, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Checksums always; with `model`, compare all rows (or `sample` random ones) with the source."""
    path = Path(path)
    report = VerifyReport(str(path))
    manifest = load_table_manifest(path)
    validate_with_schema(manifest, manifest_path(path).name)
    # No table at all (missing, a folder, a FIFO) is bad input, not a failed check.
    os.close(open_regular(path, "table"))
    try:
        # Each row is read once: a host cache (populated up front, runtime/hostcache.py) would
        # only add its budget to this process's memory.
        table = open_table(path, host_cache_bytes=0)
    except BadInput as exc:
        # The manifest is sound but the data file is refused (a damaged header or order map, a
        # wrong size): that is a failed check of the file, reported with the header's checksum.
        report.file_problems.append(str(exc))
        report.header_ok = _header_crc(path, manifest) == manifest["checksums"]["header_crc32"]
        return report
    with table:
        _check_checksums(table, report, progress)
        if model is not None:
            with open_source(model) as source:
                # A changed source fails the check; rows are still compared so the report names them.
                changes = source_changes(table.manifest, source)
                if changes:
                    report.converted_from = converted_elsewhere(table.manifest, source)
                # Elsewhere than the table's own source, a difference is another checkpoint, not a change.
                prefix = "changed since conversion" if report.converted_from is None else "another checkpoint"
                report.source_problems += [f"{prefix}: {c}" for c in changes]
                _compare_with_source(table, source, report, sample, seed, progress)
    return report


def _header_crc(path: Path, manifest: dict[str, Any]) -> int | None:
    try:
        descriptor = open_regular(path, "table")
    except (OSError, BadInput):
        return None
    try:
        return header_region_crc(descriptor, manifest["data_offset"])
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _check_checksums(table, report: VerifyReport, progress) -> None:
    checksums = table.manifest["checksums"]
    block_bytes = checksums["block_bytes"]
    data_offset, file_size = table.header.data_offset, table.header.file_size
    blocks = [(data_offset + block * block_bytes, min(data_offset + (block + 1) * block_bytes, file_size))
              for block in range(len(checksums["blocks"]))]
    descriptor = open_regular(table.path, "table")
    try:
        report.header_ok = header_region_crc(descriptor, data_offset) == checksums["header_crc32"]
        # Past the cache: a verify of a table the size of RAM would otherwise push everything else
        # out of the page cache (a serving host's hot rows and weights among it).
        direct = (all(offset % DIRECT_IO_ALIGNMENT == 0 for offset in (data_offset, block_bytes, file_size))
                  and set_direct(descriptor, True))
        pieces = [(position, min(position + CHECKSUM_READ_BYTES, stop))
                  for start, stop in blocks for position in range(start, stop, CHECKSUM_READ_BYTES)]
        read = _PieceReader(descriptor, table.path.name, direct)
        crcs = [0] * len(blocks)
        for (position, _), data in zip(pieces, read.pieces(pieces)):
            block = (position - data_offset) // block_bytes
            crcs[block] = zlib.crc32(data, crcs[block])
        for block, ((start, stop), expected) in enumerate(zip(blocks, checksums["blocks"])):
            report.checksum_blocks += 1
            if crcs[block] != expected:
                first_slot = block * block_bytes // table.page_size * table.rows_per_page
                stop_slot = min(table.num_rows,
                                -(-(stop - data_offset) // table.page_size) * table.rows_per_page)
                rows = table.order.rows_at(first_slot, stop_slot) + table.first_row
                report.bad_blocks.append({"block": block, "bytes": [start, stop],
                                          "first_rows": rows[:MAX_REPORTED].tolist(),
                                          "num_rows": len(rows)})
    finally:
        os.close(descriptor)


class _PieceReader:
    """Pieces of a file read in order into two page-aligned buffers, the next read (on a thread)
    while the caller checks the last; with O_DIRECT (`direct`: every piece aligned to
    DIRECT_IO_ALIGNMENT), a refused read goes back to the page cache."""

    def __init__(self, descriptor: int, name: str, direct: bool):
        self.descriptor, self.name, self.direct = descriptor, name, direct
        self.buffers = [aligned_zeros(CHECKSUM_READ_BYTES) for _ in range(2)]

    def _read(self, position: int, stop: int, buffer: np.ndarray) -> memoryview:
        piece = memoryview(buffer)[:stop - position]
        try:
            read_exactly(self.descriptor, piece, position, self.name)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:  # EINVAL: the flag taken, the read not
                raise
            set_direct(self.descriptor, False)
            self.direct = False
            read_exactly(self.descriptor, piece, position, self.name)
        return piece

    def pieces(self, pieces: list[tuple[int, int]]) -> Iterator[memoryview]:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify-read") as reader:
            pending = reader.submit(self._read, *pieces[0], self.buffers[0]) if pieces else None
            for k in range(len(pieces)):
                data = pending.result()
                if k + 1 < len(pieces):
                    pending = reader.submit(self._read, *pieces[k + 1], self.buffers[(k + 1) % 2])
                yield data


def _compare_with_source(table, source, report: VerifyReport, sample, seed, progress) -> None:
    """Compare rows; a changed scale or row count is already reported by `source_changes`."""
    if source.encoding.label != table.encoding or source.row_bytes != table.row_bytes:
        report.source_problems.append(f"source is {source.encoding.label} with {source.row_bytes}-"
                                      f"byte rows, the table {table.encoding} with {table.row_bytes}")
        return
    if source.num_rows != table.manifest["total_rows"]:
        return  # the rows do not line up; source_changes names the difference
    if sample is None:
        chunks = (np.arange(start, min(start + CHUNK_ROWS, table.num_rows), dtype=np.int64)
                  for start in range(0, table.num_rows, CHUNK_ROWS))
    else:
        rng = np.random.default_rng(seed)
        picked = np.sort(rng.choice(table.num_rows, size=min(sample, table.num_rows), replace=False))
        chunks = (picked[i:i + CHUNK_ROWS] for i in range(0, len(picked), CHUNK_ROWS))
    for local in chunks:
        ids = local + table.first_row
        if len(ids) and ids[-1] - ids[0] == len(ids) - 1:
            expected = source.read_rows(int(ids[0]), int(ids[-1]) + 1)
        else:
            expected = source.gather_rows(ids)
        different = np.flatnonzero(np.any(table.gather(ids) != expected, axis=1))
        report.rows_compared += len(ids)
        report.mismatched_rows += len(different)
        room = MAX_REPORTED - len(report.first_mismatches)
        report.first_mismatches += ids[different[:room]].tolist()
        if progress is not None:
            progress(expected.nbytes)
