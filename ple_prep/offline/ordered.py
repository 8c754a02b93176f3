"""Write an access-ordered table in one sequential pass over the source, in bounded memory.

Reading the placed rows where the source keeps them would cost one random read each (tens of
millions for the real table, whose source does not fit the page cache). Instead the source is read
once, in order:

1. Each chunk's unplaced rows go straight to their slots: they follow the placed ones in source
   order, so they fill the file's pages after the placed region in order. Its placed rows are
   appended, packed back to back, to their bucket: one write chunk of slots, staged in the very
   bytes of the file its pages will take (a bucket's rows take fewer bytes packed than in pages),
   so no spill file costs disk space. A bucket's rows arrive in ascending row order.
2. Then each bucket is read back, put in slot order (an argsort of its part of the map) and
   written over itself as pages.

The page where the placed region ends, when it is shared with the first unplaced rows, may hold
staged bytes of the last bucket: step 1 keeps that first chunk of unplaced rows in memory and step
2 writes it with the last bucket. The checksum block holding that page is written by both steps:
its CRC is read back from the file at the end. Memory: the map and its rank bits, a bucket number
per placed row, a few chunks of rows and the buckets' staging buffers (STAGE_BUFFER_BYTES); the
placed rows cost one more write and read.

The source is read with O_DIRECT where it allows (`DirectRows`), staging and pages are written with
it: on a virtio disk the page cache costs the kernel more CPU than the hashes cost (BENCHMARKS.md,
"The model's whole table, offline").
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..converters.base import TableSource
from ..core.fileio import read_exactly
from ..format.header import Header
from ..format.order import RowOrder
from ..format.pages import pack_rows
from .direct_io import DIRECT_IO_ALIGNMENT, DirectRows, aligned_zeros, pwrite_all, set_direct

# Source chunks read ahead of the thread that splits them, and page chunks written behind it.
READ_AHEAD = 2
WRITE_BEHIND = 2
PREFETCH_AHEAD = 3
# Chunks whose placed rows wait to be staged on the staging thread, which copies them into their
# buckets' buffers and writes the full ones (the split goes on meanwhile).
STAGE_BEHIND = 4
# The buckets' staging buffers together (`_Staging`), and the most one bucket's may take. A full
# buffer is one write at its bucket's place: with hundreds of buckets, smaller shares mean many
# small writes scattered over the file, which kept the staging thread writing most of the time.
STAGE_BUFFER_BYTES = 64 << 20
STAGE_BUFFER_MAX = 1 << 20
# Full staging buffers written at once, and spare buffers that take a bucket's next rows meanwhile:
# written one at a time (scattered over the file beside the pages' writes), they kept the staging
# thread waiting and the split waiting on it (docs/benchmark-history.md, "What moved the convert,
# 2026-12-03").
STAGE_WRITERS = 4
STAGE_SPARE_BUFFERS = 16


class _PageSink:
    """Pages written at their place in the file, each chunk's CRC folded into its checksum block
    (chunks of one block arrive in file order); the block `skip_block` is left for the caller."""

    def __init__(self, descriptor: int, header: Header, pages_per_chunk: int, block_bytes: int,
                 skip_block: int, writer: concurrent.futures.Executor):
        self.descriptor, self.header, self.writer = descriptor, header, writer
        self.pages_per_block = block_bytes // header.page_size
        self.skip_block = skip_block
        self.crcs: dict[int, int] = {}
        self.buffers = [aligned_zeros(pages_per_chunk * header.page_size).reshape(pages_per_chunk, -1)
                        for _ in range(WRITE_BEHIND + 1)]
        self.pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self.count = 0

    def write(self, first_page: int, rows: np.ndarray) -> None:
        while len(self.pending) >= len(self.buffers):
            self.pending.popleft().result()
        pages = pack_rows(rows, self.buffers[self.count % len(self.buffers)], self.header.rows_per_page)
        self.count += 1
        self.pending.append(self.writer.submit(self._checksum_and_write, first_page, pages))

    def _checksum_and_write(self, first_page: int, pages: np.ndarray) -> None:
        """On the writer's one thread, so the CRCs of a block's chunks fold in file order; the CRC
        takes the CPU there rather than on the thread splitting the source."""
        block = first_page // self.pages_per_block
        if block != self.skip_block:
            self.crcs[block] = zlib.crc32(pages, self.crcs.get(block, 0))
        pwrite_all(self.descriptor, pages, self.header.data_offset + first_page * self.header.page_size)

    def finish(self) -> None:
        while self.pending:
            self.pending.popleft().result()


def write_access_ordered(source: TableSource, order: RowOrder, header: Header, descriptor: int,
                         path: Path, pages_per_chunk: int, block_bytes: int,
                         progress: Callable[[int], None] | None,
                         head: tuple[Any, int] | None = None) -> tuple[dict[int, int], str]:
    """Write the data region of `header`'s file (its header and map already written through
    `descriptor`, the file at `path`, as long as the header says); returns the CRC of every checksum
    block of `block_bytes` and the SHA-256 of the rows in source order (continuing `head`, a SHA-256
    already fed that many of the first rows, read through the page cache, where given)."""
    chunk_rows = pages_per_chunk * header.rows_per_page
    boundary_page = order.num_placed // header.rows_per_page
    meeting_block = min(boundary_page, header.num_pages - 1) * header.page_size // block_bytes
    bucket = order.chunks_by_rank(chunk_rows)  # each placed row's bucket, rows ascending
    # A descriptor of its own for staging (its writes and reads are aligned, so O_DIRECT where the
    # page size allows): the page cache would take every staged byte, written once and read once.
    staging = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    if _staging_alignment(header) > 1:
        set_direct(staging, True)
    stages = [concurrent.futures.ThreadPoolExecutor(max_workers=STAGE_WRITERS if name == "stage-write" else 1,
                                                    thread_name_prefix=f"convert-{name}")
              for name in ("prefetch", "read", "hash", "stage", "stage-write", "write")]
    prefetcher, reader, hasher, stager, flusher, writer = stages
    sink = _PageSink(descriptor, header, pages_per_chunk, block_bytes, meeting_block, writer)
    digest, cached_rows = head or (hashlib.sha256(), 0)
    try:
        with DirectRows(source) as direct:
            held = _stream_source(source, direct, order, header, sink, staging, bucket, chunk_rows,
                                  (prefetcher, reader, hasher, stager, flusher), (digest, cached_rows),
                                  progress)
        del bucket
        _write_placed(order, header, sink, staging, chunk_rows, held, reader)
        sink.finish()
        os.fsync(descriptor)
    finally:
        for stage in stages:
            stage.shutdown(wait=True, cancel_futures=True)
        os.close(staging)
    sink.crcs[meeting_block] = _read_back_crc(path, header, meeting_block, block_bytes)
    return sink.crcs, digest.hexdigest()


def _stream_source(source: TableSource, direct: DirectRows, order: RowOrder, header: Header, sink: _PageSink,
                   staging: int, bucket: np.ndarray, chunk_rows: int, threads, hashing,
                   progress: Callable[[int], None] | None) -> np.ndarray | None:
    """Step 1; returns the first chunk of unplaced rows when the placed region ends inside its
    first page (the chunk's rows from its first slot, placed ones zero), for step 2 to write."""
    prefetcher, reader, hasher, stager, flusher = threads
    digest, cached_rows = hashing
    num_placed, num_rows, rows_per_page = order.num_placed, header.num_rows, header.rows_per_page
    first_row = header.first_row
    boundary_page, head = divmod(num_placed, rows_per_page)
    row_bytes = header.row_bytes
    # Source chunks of half a write chunk: the read-ahead ring is the largest of the buffers.
    read_rows = max(1, chunk_rows // 2)
    starts = range(0, num_rows, read_rows)
    buffers = [direct.buffer(read_rows) for _ in range(READ_AHEAD + 2)]

    def read(index: int) -> np.ndarray:
        ahead = index + PREFETCH_AHEAD
        if ahead < len(starts) and not direct.direct:
            # Read-ahead hints are for the page cache: a direct read bypasses it.
            prefetcher.submit(source.prefetch, first_row + starts[ahead],
                              first_row + min(starts[ahead] + read_rows, num_rows))
        start = starts[index]
        stop = min(start + read_rows, num_rows)
        buffer = buffers[index % len(buffers)]
        if stop > cached_rows:
            return direct.read(first_row + start, first_row + stop, buffer)
        # Left in the page cache while the layout was planned: read from memory, then let go.
        rows = source.read_rows(first_row + start, first_row + stop,
                                out=buffer[:(stop - start) * row_bytes].reshape(stop - start, row_bytes))
        source.drop_cached(first_row + start, first_row + stop)
        return rows

    # The page chunk being filled: pages [page, page_stop), `filled` of its rows set. The first one
    # starts at the page the placed region ends in, its first `head` slots left to step 2.
    pending_rows = np.zeros((chunk_rows, row_bytes), dtype=np.uint8)
    page = boundary_page
    page_stop = min(header.num_pages, (page // sink.buffers[0].shape[0] + 1) * sink.buffers[0].shape[0])
    filled = head
    held = None
    staged = _Staging(staging, header, sink.buffers[0].shape[0], -(-num_placed // chunk_rows), flusher)
    placed_so_far = 0
    reads = collections.deque(reader.submit(read, i) for i in range(min(READ_AHEAD, len(starts))))
    hashes: collections.deque[concurrent.futures.Future] = collections.deque()
    stagings: collections.deque[concurrent.futures.Future] = collections.deque()
    for index, start in enumerate(starts):
        rows = reads.popleft().result()
        if start + len(rows) > cached_rows:
            hashes.append(hasher.submit(digest.update, rows[max(0, cached_rows - start):]))
        while len(hashes) > 2:
            hashes.popleft().result()
        if index + READ_AHEAD < len(starts):
            reads.append(reader.submit(read, index + READ_AHEAD))
        placed = order.placed_mask(start, start + len(rows))
        chosen = np.flatnonzero(placed)
        if len(chosen):
            while len(stagings) >= STAGE_BEHIND:
                stagings.popleft().result()
            # Grouped by bucket here (the read buffer is reused), appended on the staging thread.
            buckets = bucket[placed_so_far:placed_so_far + len(chosen)]
            by_bucket = np.argsort(buckets, kind="stable")
            stagings.append(stager.submit(staged.append, rows[chosen[by_bucket]], buckets[by_bucket]))
            placed_so_far += len(chosen)
        # Unplaced rows are copied once, straight into the page chunk being filled.
        kept = np.flatnonzero(~placed) if len(chosen) else None
        done, count = 0, len(rows) if kept is None else len(kept)
        while done < count:
            capacity = min(page_stop * rows_per_page, num_rows) - page * rows_per_page
            taken = min(capacity - filled, count - done)
            if kept is None:
                pending_rows[filled:filled + taken] = rows[done:done + taken]
            else:
                np.take(rows, kept[done:done + taken], axis=0, out=pending_rows[filled:filled + taken],
                        mode="clip")  # the positions are in range; "raise" would copy twice
            filled += taken
            done += taken
            if filled == capacity:
                if page == boundary_page and head:
                    held = pending_rows[:filled].copy()
                else:
                    sink.write(page, pending_rows[:filled])
                page, filled = page_stop, 0
                page_stop = min(header.num_pages, page + sink.buffers[0].shape[0])
        if progress is not None:
            progress(rows.nbytes)
    stagings.append(stager.submit(staged.finish))
    for pending in (*hashes, *stagings):
        pending.result()
    return held


def _stage_offset(header: Header, bucket: int, pages_per_chunk: int) -> int:
    """Where bucket `bucket` is staged: the first byte of its pages."""
    return header.data_offset + bucket * pages_per_chunk * header.page_size


def _staging_alignment(header: Header) -> int:
    """What staged writes and reads are rounded to: O_DIRECT's block where pages are whole blocks
    (a bucket's pages then end on one), else nothing (the bytes past a bucket's rows may be the next
    region's)."""
    return DIRECT_IO_ALIGNMENT if header.page_size % DIRECT_IO_ALIGNMENT == 0 else 1


class _Staging:
    """Placed rows appended, packed back to back, to their buckets' staging (`_stage_offset`),
    through a buffer a bucket: a full buffer is one aligned write, so staging takes a few large
    writes instead of one small write per bucket per chunk. The writes run on `flusher`, the bucket
    going on in a spare buffer; a written buffer becomes a spare. `finish` writes what the buffers
    hold, rounded up to `_staging_alignment` (the bytes past a bucket's rows lie in its own pages,
    which step 2 writes whole), and waits for every write. Called from the staging thread alone."""

    def __init__(self, descriptor: int, header: Header, pages_per_chunk: int, buckets: int,
                 flusher: concurrent.futures.Executor):
        self.descriptor, self.header, self.pages_per_chunk = descriptor, header, pages_per_chunk
        self.flusher = flusher
        share = STAGE_BUFFER_BYTES // max(1, buckets) // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT
        self.capacity = min(STAGE_BUFFER_MAX, max(DIRECT_IO_ALIGNMENT, share))
        count = max(1, buckets) + STAGE_SPARE_BUFFERS
        self.buffers = aligned_zeros(count * self.capacity).reshape(count, self.capacity)
        self.current = list(range(buckets))  # the buffer each bucket fills
        self.spare = collections.deque(range(buckets, count))
        self.flushes: collections.deque[tuple[concurrent.futures.Future, int]] = collections.deque()
        self.filled = [0] * buckets   # bytes in each bucket's buffer
        self.written = [0] * buckets  # bytes of each bucket already in the file or being written

    def append(self, rows: np.ndarray, buckets: np.ndarray) -> None:
        """Rows grouped by bucket (ascending row order within each), with their buckets."""
        edges = np.flatnonzero(np.diff(buckets.astype(np.int64), prepend=-1, append=-1)).tolist()
        data = rows.reshape(-1)
        row_bytes = self.header.row_bytes
        for low, high in zip(edges[:-1], edges[1:]):
            number, piece = int(buckets[low]), data[low * row_bytes:high * row_bytes]
            while len(piece):
                filled = self.filled[number]
                taken = min(self.capacity - filled, len(piece))
                self.buffers[self.current[number], filled:filled + taken] = piece[:taken]
                piece = piece[taken:]
                self.filled[number] = filled + taken
                if filled + taken == self.capacity:
                    self._flush(number, self.capacity)

    def finish(self) -> None:
        for number, filled in enumerate(self.filled):
            if filled:
                align = _staging_alignment(self.header)
                self._flush(number, -(-filled // align) * align)
        while self.flushes:
            self.flushes.popleft()[0].result()

    def _flush(self, number: int, length: int) -> None:
        offset = _stage_offset(self.header, number, self.pages_per_chunk) + self.written[number]
        buffer = self.current[number]
        self.flushes.append((self.flusher.submit(pwrite_all, self.descriptor, self.buffers[buffer, :length], offset),
                             buffer))
        self.written[number] += self.filled[number]
        self.filled[number] = 0
        if not self.spare:
            done, free = self.flushes.popleft()
            done.result()
            self.spare.append(free)
        self.current[number] = self.spare.popleft()


def _write_placed(order: RowOrder, header: Header, sink: _PageSink, staging: int, chunk_rows: int,
                  held: np.ndarray | None, reader: concurrent.futures.Executor) -> None:
    """Step 2: each bucket in slot order, written over its staged bytes as pages; the next
    bucket's staged bytes are read on `reader` meanwhile (a bucket's staging lies in its own pages,
    which no other bucket's write touches)."""
    num_placed, row_bytes = order.num_placed, header.row_bytes
    pages_per_chunk = sink.buffers[0].shape[0]
    # Read back into aligned buffers, rounded as the staging wrote them.
    align = _staging_alignment(header)
    staged = [aligned_zeros(-(-chunk_rows * row_bytes // align) * align) for _ in range(2)]
    in_slot_order = np.empty((chunk_rows, row_bytes), dtype=np.uint8)
    starts = range(0, num_placed, chunk_rows)

    def read(bucket: int) -> np.ndarray:
        count = min(chunk_rows, num_placed - starts[bucket])
        length = -(-count * row_bytes // align) * align
        buffer = staged[bucket % 2]
        read_exactly(staging, memoryview(buffer)[:length], _stage_offset(header, bucket, pages_per_chunk), "table")
        return buffer[:count * row_bytes].reshape(count, row_bytes)

    ahead = reader.submit(read, 0) if len(starts) else None
    for bucket, start in enumerate(starts):
        rows = ahead.result()
        if bucket + 1 < len(starts):
            ahead = reader.submit(read, bucket + 1)
        count = len(rows)
        # The bucket's rows arrived in ascending row order: the k-th smallest row of its slots.
        by_row = np.argsort(order.slot_rows[start:start + count], kind="stable")
        in_slot_order[by_row] = rows
        if start + count == num_placed and held is not None:
            # The first unplaced rows share the last placed page: one chunk from here on.
            first = count % header.rows_per_page
            in_slot_order[count:count + len(held) - first] = held[first:]
            count += len(held) - first
        sink.write(bucket * pages_per_chunk, in_slot_order[:count])


def _read_back_crc(path: Path, header: Header, block: int, block_bytes: int) -> int:
    """CRC-32 of checksum block `block` as written (both steps wrote pages of it)."""
    reader = os.open(path, os.O_RDONLY)
    try:
        start = header.data_offset + block * block_bytes
        stop = min(start + block_bytes, header.file_size)
        crc, buffer = 0, bytearray(8 << 20)
        for position in range(start, stop, len(buffer)):
            piece = memoryview(buffer)[:min(len(buffer), stop - position)]
            read_exactly(reader, piece, position, path.name)
            crc = zlib.crc32(piece, crc)
        return crc
    finally:
        os.close(reader)
