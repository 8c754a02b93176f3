"""The row stream every converter yields: where each row's bytes lie in the source files.

A converter parses and validates its format, then describes the table as column parts, each a list
of segments (a run of rows at one file offset, or zero rows where the path is None: the padding
rows a split-head GGUF table does not store). A row is the concatenation of its parts' bytes: one
part for FP8, BF16 and GGUF, two for NVFP4 (codes, then block scales). Reading is then the same for
every format: positioned reads into caller-sized buffers, so memory stays bounded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..core.constants import Encoding
from ..core.fileio import open_regular, read_exactly
from ..ngram import NgramSpec

# Rows read to fingerprint a source: enough to touch every shard, cheap enough for open time.
FINGERPRINT_SAMPLE_ROWS = 256


# Bytes per read-ahead hint: no more than the read-ahead size of common block devices.
PREFETCH_STEP_BYTES = 512 << 10
# Rows this close in a file are fetched by one read; rows per batch of a gather (bounds its buffer).
GATHER_GAP_BYTES = 4096
GATHER_BATCH = 1 << 14


@dataclasses.dataclass(frozen=True)
class Segment:
    """`num_rows` rows of `row_bytes` each, stored back to back at `offset` in `path`.

    A segment without a path stands for rows of zero bytes that no file holds.
    """

    path: Path | None
    offset: int
    first_row: int
    num_rows: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class Scale:
    """A scalar scale exactly as stored: its dtype, little-endian bytes, and value."""

    dtype: str
    raw: bytes
    value: float

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "hex": self.raw.hex(), "value": self.value}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    name: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size}


class TableSource:
    """A validated source table: its encoding, geometry, scale, hash spec and row locations."""

    def __init__(self, *, format: str, model_dir: Path, encoding: Encoding, values_per_row: int,
                 parts: list[list[Segment]], spec: NgramSpec, files: list[SourceFile],
                 scale: Scale | None = None, extra: dict[str, Any] | None = None):
        self.format = format
        self.model_dir = model_dir
        self.encoding = encoding
        self.values_per_row = values_per_row
        self.parts = parts
        self.part_bytes = [part[0].row_bytes for part in parts]
        self.row_bytes = sum(self.part_bytes)
        self.num_rows = sum(segment.num_rows for segment in parts[0])
        self.spec = spec
        self.files = files
        self.scale = scale
        self.extra = extra or {}
        self._descriptors: dict[Path, int] = {}
        self._segment_starts = [np.array([s.first_row for s in part], dtype=np.int64) for part in parts]

    def __enter__(self) -> "TableSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def _descriptor(self, path: Path) -> int:
        if path not in self._descriptors:
            self._descriptors[path] = open_regular(path, "source file")
        return self._descriptors[path]

    def _pread_into(self, path: Path, buffer: memoryview, offset: int) -> None:
        read_exactly(self._descriptor(path), buffer, offset, path.name)

    def read_rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) in source order as uint8 `(stop - start, row_bytes)`."""
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"rows [{start}, {stop}) outside the table of {self.num_rows}")
        count = stop - start
        if out is None:
            out = np.empty((count, self.row_bytes), dtype=np.uint8)
        column = 0
        for part, width in zip(self.parts, self.part_bytes):
            # One part spanning the whole row reads straight into `out`; otherwise via a buffer.
            target = out if width == self.row_bytes else np.empty((count, width), dtype=np.uint8)
            for segment in part:
                low = max(start, segment.first_row)
                high = min(stop, segment.first_row + segment.num_rows)
                if low >= high:
                    continue
                if segment.path is None:
                    target[low - start:high - start] = 0
                    continue
                view = memoryview(target[low - start:high - start]).cast("B")
                offset = segment.offset + (low - segment.first_row) * width
                self._pread_into(segment.path, view, offset)
            if target is not out:
                out[:, column:column + width] = target
            column += width
        return out

    def prefetch(self, start: int, stop: int) -> None:
        """Ask the kernel to start reading rows [start, stop) in the background; only a hint.

        A streaming reader calls it for the chunk after the one it reads next, so the disk always
        has a request queued while the reader and its consumers are busy.
        """
        for segment, first, length in self._byte_ranges(start, stop):
            descriptor = self._descriptor(segment.path)
            # Linux reads at most the device's read-ahead size per hint (the rest of a longer
            # range is dropped): one hint a step.
            for offset in range(first, first + length, PREFETCH_STEP_BYTES):
                os.posix_fadvise(descriptor, offset, min(PREFETCH_STEP_BYTES, first + length - offset),
                                 os.POSIX_FADV_WILLNEED)

    def _byte_ranges(self, start: int, stop: int):
        """(segment, offset, length) of the file bytes holding rows [start, stop), clipped to the
        table; padding segments (no file) left out."""
        start, stop = max(0, start), min(stop, self.num_rows)
        for part, width in zip(self.parts, self.part_bytes):
            for segment in part:
                low = max(start, segment.first_row)
                high = min(stop, segment.first_row + segment.num_rows)
                if low < high and segment.path is not None:
                    yield segment, segment.offset + (low - segment.first_row) * width, (high - low) * width

    def drop_cached(self, start: int, stop: int) -> None:
        """Tell the kernel rows [start, stop) are not needed again soon (their clean pages may
        go from the page cache); only a hint."""
        for segment, offset, length in self._byte_ranges(start, stop):
            os.posix_fadvise(self._descriptor(segment.path), offset, length, os.POSIX_FADV_DONTNEED)

    def gather_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows at arbitrary source ids, in request order.

        Ids are sorted and rows closer than `GATHER_GAP_BYTES` share one positioned read (the disk
        reads whole pages anyway), in batches of `GATHER_BATCH` distinct rows to bound memory.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise IndexError(f"row id outside the table of {self.num_rows} rows")
        out = np.empty((len(ids), self.row_bytes), dtype=np.uint8)
        distinct, inverse = np.unique(ids, return_inverse=True)
        rows = np.empty((len(distinct), self.row_bytes), dtype=np.uint8)
        for first in range(0, len(distinct), GATHER_BATCH):
            batch = distinct[first:first + GATHER_BATCH]
            column = 0
            for index, width in enumerate(self.part_bytes):
                rows[first:first + len(batch), column:column + width] = self._gather_part(index, batch)
                column += width
        out[:] = rows[inverse.reshape(-1)]
        return out

    def _gather_part(self, index: int, ids: np.ndarray) -> np.ndarray:
        """One column part of sorted distinct rows: coalesced reads into one buffer, then a take."""
        part, width = self.parts[index], self.part_bytes[index]
        segment_of = np.searchsorted(self._segment_starts[index], ids, side="right") - 1
        offsets = (np.array([s.offset for s in part], dtype=np.int64)[segment_of]
                   + (ids - self._segment_starts[index][segment_of]) * width)
        # A new read starts where the segment changes or the gap to the previous row is large.
        gap = np.diff(offsets) - width
        starts_read = np.concatenate([[True], (np.diff(segment_of) != 0) | (gap > GATHER_GAP_BYTES)])
        read_first = np.flatnonzero(starts_read)
        read_last = np.concatenate([read_first[1:], [len(ids)]]) - 1
        read_offset = offsets[read_first]
        read_length = offsets[read_last] + width - read_offset
        buffer_start = np.concatenate([[0], np.cumsum(read_length)[:-1]])
        buffer = np.empty(int(read_length.sum()), dtype=np.uint8)
        view = memoryview(buffer)
        for segment, offset, length, start in zip(segment_of[read_first].tolist(), read_offset.tolist(),
                                                  read_length.tolist(), buffer_start.tolist()):
            if part[segment].path is None:  # rows no file stores (padding) read as zeros
                buffer[start:start + length] = 0
            else:
                self._pread_into(part[segment].path, view[start:start + length], offset)
        read_of_row = np.cumsum(starts_read) - 1
        positions = buffer_start[read_of_row] + offsets - read_offset[read_of_row]
        return buffer[positions[:, None] + np.arange(width)]

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this source: its files' names and sizes, and a digest of sampled rows.

        The sample (rows spread evenly over the table, all shards) catches a re-export with the same
        shapes but other values; mtimes are left out on purpose: copies change them, not the bytes.
        """
        count = min(FINGERPRINT_SAMPLE_ROWS, self.num_rows)
        ids = np.unique(np.linspace(0, self.num_rows - 1, count).astype(np.int64))
        digest = hashlib.sha256(self.gather_rows(ids)).hexdigest()
        return {"format": self.format, "files": [f.to_json() for f in self.files],
                "sample_rows": len(ids), "sample_sha256": digest}
