"""Write a prepared table: stream rows from a source into pages, checksum, and publish atomically."""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import errno
import glob
import hashlib
import os
import secrets
import shutil
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..converters.base import TableSource
from ..core.constants import (
    CHECKSUM_BLOCK_BYTES,
    DEFAULT_PAGE_SIZE,
    GGML_TYPES,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
)
from ..core.errors import BadInput
from ..core.fileio import (
    check_output,
    create_exclusive,
    load_json,
    open_input,
    output_lock,
    partial_owner,
    partial_path,
    publish,
)
from ..format.header import Header
from ..format.layout import TableLayout
from ..format.manifest import MANIFEST_FORMAT, manifest_path, spec_digest, write_manifest
from ..format.order import RowOrder
from ..format.pages import pack_rows, rows_in_block
from .direct_io import DIRECT_IO_ALIGNMENT, DirectRows, aligned_zeros, preallocate, set_direct, write_all
from .ordered import write_access_ordered
from .progress import Journal, Resumable, progress_name, truncate_after, verify_prefix
from .progress import identity as run_identity
from .progress import load as load_journal

# Pages per write: a quarter checksum block (16 MiB of 4 KiB pages) keeps memory small and the
# disk busy; it divides the checksum block so each block's CRC is accumulated over whole chunks.
CHUNKS_PER_CHECKSUM_BLOCK = 4
# Chunks read ahead of the packing thread and written behind it: slack so that a stall in one
# stage does not stop the others. Memory: (READ_AHEAD + 2 + WRITE_BEHIND + 1) chunks of 16 MiB.
READ_AHEAD = 3
WRITE_BEHIND = 2
# Chunks past the one being read that the kernel is asked to fetch (page cache, not our memory):
# the disk keeps a deep queue while the reading thread copies. Measured: 3 beats 1 on a busy host.
PREFETCH_AHEAD = 3
# Slack beyond the file size so the free-space check does not pass with zero bytes to spare.
FREE_SPACE_MARGIN = 16 << 20
# Source bytes read and hashed per step while a layout is planned (`_HeadHasher`), and the share
# of the memory the kernel reports available that the rows it leaves in the page cache may take
# (a half: at the model's geometry about what the disk reads while the plan runs).
WARM_STEP_BYTES = 8 << 20
WARM_SHARE_OF_AVAILABLE = 2
# glibc's mallopt: blocks of at least this many bytes get a mapping of their own (`bound_heap`).
# Just above the planner's per-step temporaries (at most 8 MiB: RANK_BUILD_ROWS int64 values), so
# the heap reuses them instead of each step faulting fresh zeroed pages in (system time that grows
# with the table).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 9 << 20


def bound_heap() -> None:
    """Have malloc give every block of MMAP_THRESHOLD_BYTES or more a mapping of its own, unmapped
    when freed. glibc's default threshold rises to the largest block freed so far (up to 32 MiB):
    after the planner frees its first large arrays, the next ones of a few MB land in the heap,
    whose freed middle is never returned, and the peak grows with the run's history. A no-op
    where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none: then nothing is kept cached)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _HeadHasher:
    """While a layout is planned (CPU only, the disk idle), a thread reads rows from `first_row`
    on in source order through the page cache and folds them into the table's SHA-256, so the
    write hashes only the rest. It reads no more than the page cache may keep for the write, half
    of the memory the kernel reports available: the write reads those rows back from memory (the
    disk time of the plan is not lost; the write is bound by the disk, which its reads and writes
    share), and no source byte is read from the disk twice."""

    def __init__(self, source: TableSource, first_row: int, num_rows: int):
        self.source, self.first_row = source, first_row
        cached_rows = _available_memory() // WARM_SHARE_OF_AVAILABLE // max(1, source.row_bytes)
        self.num_rows = min(num_rows, cached_rows)
        self.digest, self.rows = hashlib.sha256(), 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="convert-head", daemon=True)

    def __enter__(self) -> "_HeadHasher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        row_bytes = max(1, self.source.row_bytes)
        step = max(1, WARM_STEP_BYTES // row_bytes)
        end = self.first_row + self.num_rows
        buffers = [aligned_zeros(step * row_bytes).reshape(step, row_bytes) for _ in range(2)]

        def read(start: int) -> np.ndarray:
            stop = min(start + step, end)
            self.source.prefetch(stop, min(stop + step, end))
            buffer = buffers[(start - self.first_row) // step % 2]
            return self.source.read_rows(start, stop, out=buffer[:stop - start])

        # The next step is copied on a thread of its own while this one is hashed. It stops before
        # the source closes.
        reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert-head-read")
        try:
            ahead = reader.submit(read, self.first_row)
            while self.rows < self.num_rows and not self._stop.is_set():
                rows = ahead.result()
                following = self.first_row + self.rows + len(rows)
                if following < end:
                    ahead = reader.submit(read, following)  # into the other buffer
                self.digest.update(rows)
                self.rows += len(rows)
        except BaseException as exc:  # the write reads and reports the source itself
            self._error = exc
        finally:
            reader.shutdown(wait=True, cancel_futures=True)

    def hashed(self) -> tuple[Any, int]:
        """(the running SHA-256, how many of the first rows it was fed, all read through the page
        cache); call after the block. Nothing is kept where the thread failed: the write reads the
        source again and raises there."""
        return (hashlib.sha256(), 0) if self._error is not None else (self.digest, self.rows)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _dead_partials(final: Path) -> list[Path]:
    """Temporary files of `final` (`.{name}.{pid}-{token}.partial`) whose writer is no longer running."""
    found = []
    for candidate in final.parent.glob(f".{glob.escape(final.name)}.*.partial"):
        pid = partial_owner(final, candidate)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            found.append(candidate)
    return sorted(found)


def remove_stale_partials(final: Path, keep: tuple[Path, ...] | None = None) -> list[Path]:
    """Delete the temporary files of `final` left by writers that died (killed, crashed, power cut).

    Only names of the form `.{name}.{pid}-{token}.partial` whose pid is no longer running are removed, so a
    convert still writing the same destination is left alone; `keep` spares a run being resumed.
    """
    removed = [path for path in _dead_partials(final) if path not in (keep or ())]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _find_resumable(out: Path) -> Resumable | None:
    """The most advanced dead run of `out` that left both its data and its journal."""
    best = None
    for journal in _dead_partials(progress_name(out)):
        pid = journal.name.rsplit(".", 2)[-2]
        data = out.with_name(f".{out.name}.{pid}.partial")
        if data.exists() and (found := load_journal(data, journal)) is not None:
            if best is None or len(found.block_crcs) > len(best.block_crcs):
                best = found
    return best


def is_interrupted_publish(out: Path, manifest_out: Path) -> bool:
    """True when `out` is a ple-prep data file without its manifest: a writer died between renames.

    Such a file can never open as a table (open_table needs the matching manifest), so a rerun may
    replace it without --force.
    """
    try:
        with open_input(out, "table") as handle:
            raw = handle.read(HEADER_SIZE)
    except (OSError, BadInput):
        return False
    if len(raw) < HEADER_SIZE or not raw.startswith(MAGIC):
        return False
    file_id = HEADER_STRUCT.unpack_from(raw)[-2].hex()
    if not os.path.lexists(manifest_out):
        return True
    try:
        recorded = load_json(manifest_out, "manifest").get("file_id")
    except (OSError, BadInput, AttributeError):
        return False
    return recorded != file_id


def check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + FREE_SPACE_MARGIN:
        raise BadInput(f"not enough free space in {folder}: the table needs "
                       f"{needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB is free")


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How `convert` writes: the page size, whether an existing table may be replaced, and whether a
    killed run of the same output is continued (offline/progress.py)."""

    page_size: int = DEFAULT_PAGE_SIZE
    force: bool = False
    resume: bool = False


@dataclasses.dataclass(frozen=True)
class RowRange:
    """The source rows one file holds, [first_row, first_row + num_rows) (all rows when num_rows is
    None), and for a tensor-parallel rank's file, its rank and the number of ranks."""

    first_row: int = 0
    num_rows: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None


def convert(source: TableSource, out: str | Path, options: WriteOptions | None = None, *,
            layout: TableLayout | None = None, rows: RowRange | None = None,
            progress: Callable[[int], None] | None = None,
            plan: Callable[[], TableLayout] | None = None) -> dict[str, Any]:
    """Write `rows` of `source` (all by default) to `out` and its manifest, in `layout`'s order
    (source order by default), or in the order `plan()` returns: the source's head is then read
    and hashed while it plans. Returns the manifest.

    Both files appear at their names only when complete (temporary names, fsync, rename); on any
    failure nothing is left behind, and a rerun removes what a killed run left. With
    `options.resume`, a killed run's verified blocks are kept instead (offline/progress.py).
    """
    options, rows = options or WriteOptions(), rows or RowRange()
    out = Path(out)
    manifest_out = manifest_path(out)
    check_outputs(source, (out, manifest_out))
    head = None
    if plan is not None:
        if layout is not None:
            raise ValueError("convert takes a layout or a plan, not both")
        num_rows = source.num_rows - rows.first_row if rows.num_rows is None else rows.num_rows
        with _HeadHasher(source, rows.first_row, num_rows) as hasher:
            layout = plan()
        head = hasher.hashed()
    with output_lock(out):
        return _convert_locked(source, out, manifest_out, options, layout, rows, progress, head)


def _is_ple_prep_output(path: Path) -> bool:
    """A prepared table (its magic) or a manifest (its format field): what convert may replace."""
    try:
        with open_input(path) as handle:
            if handle.read(len(MAGIC)) == MAGIC:
                return True
        manifest = load_json(path, "manifest")
    except (OSError, BadInput):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT


def check_outputs(source: TableSource, targets: tuple[Path, ...]) -> None:
    """Outputs never replace inputs, --force or not: a target that is a file the source reads, or
    any file in the checkpoint's folder that is not a ple-prep table or manifest, is refused."""
    folder = source.model_dir if source.model_dir.is_dir() else source.model_dir.parent
    inputs = {segment.path for part in source.parts for segment in part if segment.path is not None}
    inputs |= {folder / entry.name for entry in source.files} | {source.model_dir}
    for target in targets:
        # force=True: whether an existing table may be replaced is decided under the output lock,
        # where a killed run's files are told apart (_check_replaceable).
        check_output(target, force=True, inputs=inputs, protected_folder=folder,
                     replaceable=_is_ple_prep_output, what="conversion")


def check_convertible(source: TableSource, out: Path, options: WriteOptions) -> None:
    """What `convert` refuses about `out` and its manifest, checked without writing anything: for
    a caller that writes several tables and must refuse before the first (convert checks again)."""
    check_outputs(source, (out, manifest_path(out)))
    _check_replaceable(out, manifest_path(out), options)


def _convert_locked(source: TableSource, out: Path, manifest_out: Path, options: WriteOptions,
                    layout: TableLayout | None, rows: RowRange,
                    progress: Callable[[int], None] | None, head: tuple[Any, int] | None) -> dict[str, Any]:
    resumable = _find_resumable(out) if options.resume else None
    for final in (out, manifest_out, progress_name(out)):
        remove_stale_partials(final, keep=resumable and (resumable.data, resumable.journal))
    _check_replaceable(out, manifest_out, options)
    num_rows = source.num_rows - rows.first_row if rows.num_rows is None else rows.num_rows
    layout = layout or TableLayout(RowOrder.identity(num_rows))
    if layout.order.num_rows != num_rows:
        raise BadInput(f"the row order covers {layout.order.num_rows} rows, the table {num_rows}")
    if resumable is not None and layout.order.num_placed:
        # An access-ordered table is written out of file order (offline/ordered.py): no block of a
        # killed run is known complete, so it starts afresh.
        for path in (resumable.data, resumable.journal):
            path.unlink(missing_ok=True)
        resumable = None
    fingerprint = source.fingerprint()
    digest = spec_digest(source.scale.to_json() if source.scale is not None else None, source.spec.to_json())

    def start(file_id: bytes) -> tuple[Header, np.ndarray, dict[str, Any]]:
        header = Header.for_table(page_size=options.page_size, row_bytes=source.row_bytes,
                                  encoding=source.encoding, values_per_row=source.values_per_row,
                                  num_rows=num_rows, first_row=rows.first_row,
                                  num_placed=layout.order.num_placed, file_id=file_id, spec_digest=digest)
        # Header and map in one page-aligned buffer (O_DIRECT writes it), filled in place: the map
        # may be hundreds of MB, so no bytes object copies it.
        prefix = aligned_zeros(header.data_offset)
        packed = header.pack()
        prefix[:len(packed)] = np.frombuffer(packed, dtype=np.uint8)
        map_bytes = layout.order.map_bytes()
        prefix[header.order_offset:header.order_offset + len(map_bytes)] = map_bytes
        return header, prefix, run_identity(header, prefix, fingerprint, CHECKSUM_BLOCK_BYTES)

    if resumable is not None:
        header, prefix, run = start(resumable.file_id)
        if run != resumable.first_line:
            # Another source, order, geometry or block size: nothing of that run can be reused.
            for path in (resumable.data, resumable.journal):
                path.unlink(missing_ok=True)
            resumable = None
    if resumable is None:
        header, prefix, run = start(uuid.uuid4().bytes)
    check_free_space(out.parent, header.file_size - (resumable.data.stat().st_size if resumable else 0))

    # The data and journal share one token, so a resume finds the data file of a journal.
    token = secrets.token_hex(8)
    temporary_data, temporary_journal = partial_path(out, token), partial_path(progress_name(out), token)
    temporary_manifest = None
    try:
        if resumable is not None:
            os.rename(resumable.data, temporary_data)
            os.rename(resumable.journal, temporary_journal)
        output = _Output(temporary_data, temporary_journal, header, prefix, run, resumable)
        del prefix  # the output holds it until the head is written
        checksums, table_sha256 = _write_data(source, layout.order, output, progress, head)
        manifest = _manifest(source, header, checksums, table_sha256, out.name, layout, fingerprint)
        if rows.tp_size is not None:
            manifest["tensor_parallel"] = {"rank": rows.tp_rank, "size": rows.tp_size}
        temporary_manifest = write_manifest(manifest, manifest_out)
        # Data first: a crash between the renames leaves a new table beside an old manifest, whose
        # file id no longer matches, so the pair is refused rather than misread.
        publish(temporary_data, out, sync_folder=False)
        publish(temporary_manifest, manifest_out)
        temporary_journal.unlink()
    except BaseException as exc:
        for path in (temporary_data, temporary_manifest, temporary_journal):
            if path is not None:
                path.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BadInput(f"the disk holding {out.parent} filled up while writing; "
                           f"partial files removed") from None
        raise
    return manifest


def _check_replaceable(out: Path, manifest_out: Path, options: WriteOptions) -> None:
    existing = [p for p in (out, manifest_out) if p.exists()]
    if not existing or options.force or is_interrupted_publish(out, manifest_out):
        return
    if options.resume and out.exists():
        raise BadInput(f"{out} is already complete: nothing to resume (pass --force to write it again)")
    raise BadInput(f"{existing[0]} exists; pass --force to replace it")


@dataclasses.dataclass
class _Output:
    """The partial data file and journal a run writes, and what it resumes from."""

    path: Path
    journal_path: Path
    header: Header
    prefix: np.ndarray | None  # header and map (uint8, page-aligned); dropped once written
    run: dict[str, Any]
    resumable: Resumable | None


class _ChunkReader:
    """Reads chunk `index` (rows_per_chunk slots of a table in source order) into one of a ring of
    reused row buffers, with O_DIRECT where the source allows (`DirectRows`). Reads through the
    page cache keep the kernel PREFETCH_AHEAD chunks ahead, each chunk hinted once, from a thread
    of its own (the hint allocates cache pages and queues I/O: CPU the read needs)."""

    def __init__(self, source: TableSource, direct: DirectRows, header: Header, chunk_starts: range,
                 rows_per_chunk: int, prefetcher: concurrent.futures.Executor):
        self.source, self.direct, self.header = source, direct, header
        self.chunk_starts, self.rows_per_chunk = chunk_starts, rows_per_chunk
        self.prefetcher = prefetcher
        # A row buffer is free again once its chunk is packed and hashed (which may trail by one).
        self.buffers = [direct.buffer(rows_per_chunk) for _ in range(READ_AHEAD + 2)]

    def _stop(self, start: int) -> int:
        return min(start + self.rows_per_chunk, self.header.num_rows)

    def read(self, index: int) -> np.ndarray:
        low = index + 1 if index == 0 else index + PREFETCH_AHEAD
        high = min(index + PREFETCH_AHEAD, len(self.chunk_starts) - 1)
        first_row = self.header.first_row
        if low <= high and not self.direct.direct:
            self.prefetcher.submit(self.source.prefetch, first_row + self.chunk_starts[low],
                                   first_row + self._stop(self.chunk_starts[high]))
        start = self.chunk_starts[index]
        stop = self._stop(start)
        return self.direct.read(first_row + start, first_row + stop, self.buffers[index % len(self.buffers)])


def _write_data(source: TableSource, order: RowOrder, output: _Output,
                progress: Callable[[int], None] | None,
                head: tuple[Any, int] | None = None) -> tuple[dict[str, Any], str]:
    """Stream the rows into the partial file; returns the checksums and the sha256 of the rows read.

    Four stages overlap, each on its own thread so each stays in order: reading runs up to
    READ_AHEAD chunks ahead (and hints the kernel further), sha256 of the rows trails the reads,
    this thread packs rows into pages and CRCs them, and writing runs up to WRITE_BEHIND chunks
    behind. sha256, crc32 and the I/O release the GIL. The slack between stages absorbs stalls in
    any one of them (a busy disk, a busy CPU). Buffers are allocated once and reused, so memory
    stays a few chunks and no time goes to faulting in fresh pages. Pages are written with O_DIRECT
    where the filesystem takes it: a table the size of RAM would otherwise push everything else out
    of the page cache, and copying it through the cache costs as much CPU as hashing it.

    Each finished checksum block is fsynced and then listed in the progress journal, so that
    `resume` can continue after the blocks a killed run wrote (they are re-read and re-checked).
    `head` (`_HeadHasher.hashed`: a SHA-256 already fed the first rows, read through the page
    cache, and their count) is continued by an access-ordered write (a source-order one hashes
    from the start).
    """
    header = output.header
    pages_per_block = CHECKSUM_BLOCK_BYTES // header.page_size
    pages_per_chunk = max(1, pages_per_block // CHUNKS_PER_CHECKSUM_BLOCK)
    header_crc = zlib.crc32(output.prefix)
    if order.num_placed:
        return _write_access_ordered(source, order, output, header_crc, pages_per_chunk, progress, head)
    block_crcs, table_digest = _verified_blocks(output, header_crc, progress)
    first_slot, _ = rows_in_block(header, len(block_crcs), CHECKSUM_BLOCK_BYTES)
    rows_per_chunk = pages_per_chunk * header.rows_per_page
    chunk_starts = range(first_slot, header.num_rows, rows_per_chunk)
    page_buffers = [aligned_zeros(pages_per_chunk * header.page_size).reshape(pages_per_chunk, -1)
                    for _ in range(WRITE_BEHIND + 1)]
    descriptor, journal = _open_output(output)
    stages = [concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"convert-{name}")
              for name in ("prefetch", "read", "hash", "write")]
    prefetcher, reader, hasher, writer = stages
    direct = DirectRows(source)
    chunks = _ChunkReader(source, direct, header, chunk_starts, rows_per_chunk, prefetcher)
    block_crc, block_filled = 0, 0
    try:
        _write_head(descriptor, output, len(block_crcs))
        reads = collections.deque(reader.submit(chunks.read, index)
                                  for index in range(min(READ_AHEAD, len(chunk_starts))))
        hashes: collections.deque[concurrent.futures.Future] = collections.deque()
        writes: collections.deque[concurrent.futures.Future] = collections.deque()
        for index in range(len(chunk_starts)):
            rows = reads.popleft().result()
            hashes.append(hasher.submit(table_digest.update, rows))
            while len(hashes) > 2:
                hashes.popleft().result()
            # The next read reuses the buffer of chunk index-2, packed and now hashed.
            if index + READ_AHEAD < len(chunk_starts):
                reads.append(reader.submit(chunks.read, index + READ_AHEAD))
            while len(writes) >= len(page_buffers):
                writes.popleft().result()
            pages = pack_rows(rows, page_buffers[index % len(page_buffers)], header.rows_per_page)
            block_crc = zlib.crc32(pages, block_crc)
            block_filled += len(pages)
            finished_block = None
            if block_filled == pages_per_block:
                finished_block = (len(block_crcs), block_crc)
                block_crcs.append(block_crc)
                block_crc, block_filled = 0, 0
            writes.append(writer.submit(_write_chunk, descriptor, pages, journal, finished_block))
            if progress is not None:
                progress(rows.nbytes)
        for pending in (*hashes, *writes):
            pending.result()
        if block_filled:
            block_crcs.append(block_crc)
        os.fsync(descriptor)
    finally:
        # Stop the stages before closing: a write still queued must never reach a reused descriptor.
        for stage in stages:
            stage.shutdown(wait=True, cancel_futures=True)
        direct.close()
        os.close(descriptor)
        journal.close()
    checksums = {"algorithm": "crc32", "block_bytes": CHECKSUM_BLOCK_BYTES,
                 "header_crc32": header_crc, "blocks": block_crcs}
    return checksums, table_digest.hexdigest()


def _write_access_ordered(source: TableSource, order: RowOrder, output: _Output, header_crc: int,
                          pages_per_chunk: int, progress: Callable[[int], None] | None,
                          head: tuple[Any, int] | None) -> tuple[dict[str, Any], str]:
    """`_write_data` for a table with placed rows: one pass over the source (offline/ordered.py).
    Its journal names the run but lists no block, so a resume starts afresh."""
    header = output.header
    descriptor, journal = _open_output(output)
    try:
        _write_head(descriptor, output, 0)
        output.prefix = None
        preallocate(descriptor, header.file_size)
        os.ftruncate(descriptor, header.file_size)
        crcs, table_digest = write_access_ordered(source, order, header, descriptor, output.path,
                                                  pages_per_chunk, CHECKSUM_BLOCK_BYTES, progress, head)
    finally:
        os.close(descriptor)
        journal.close()
    blocks = -(-(header.file_size - header.data_offset) // CHECKSUM_BLOCK_BYTES)
    checksums = {"algorithm": "crc32", "block_bytes": CHECKSUM_BLOCK_BYTES,
                 "header_crc32": header_crc, "blocks": [crcs[block] for block in range(blocks)]}
    return checksums, table_digest


def _verified_blocks(output: _Output, header_crc: int,
                     progress: Callable[[int], None] | None) -> tuple[list[int], Any]:
    """The CRCs of the blocks a resumed run keeps (re-read and re-checked) and the running sha256 of
    their rows; nothing for a fresh run."""
    if output.resumable is None:
        return [], hashlib.sha256()
    kept, digest = verify_prefix(output.path, output.header, CHECKSUM_BLOCK_BYTES, header_crc,
                                 output.resumable.block_crcs, progress)
    truncate_after(output.journal_path, kept)
    return output.resumable.block_crcs[:kept], digest


def _open_output(output: _Output) -> tuple[int, Journal]:
    if output.resumable is None:
        descriptor = create_exclusive(output.path)
        return descriptor, Journal(output.journal_path, output.run)
    return os.open(output.path, os.O_WRONLY), Journal(output.journal_path, None)


def _write_head(descriptor: int, output: _Output, kept_blocks: int) -> None:
    """Header and row order (rewritten whatever their state), then the position after the kept
    blocks; O_DIRECT from here on where the page size allows it."""
    header = output.header
    os.ftruncate(descriptor, header.data_offset + kept_blocks * CHECKSUM_BLOCK_BYTES)
    if header.page_size % DIRECT_IO_ALIGNMENT == 0:
        set_direct(descriptor, True)
    write_all(descriptor, output.prefix)
    os.lseek(descriptor, header.data_offset + kept_blocks * CHECKSUM_BLOCK_BYTES, os.SEEK_SET)


def _write_chunk(descriptor: int, pages: np.ndarray, journal: Journal,
                 finished_block: tuple[int, int] | None) -> None:
    write_all(descriptor, pages)
    if finished_block is not None:
        # The block is promised to a resume only once its bytes are on disk.
        os.fsync(descriptor)
        journal.append(*finished_block)


def ggml_type_json(encoding) -> dict[str, Any] | None:
    """The GGML type a GGUF encoding came from, as the manifest records it; None for the others."""
    if encoding not in GGML_TYPES:
        return None
    name, type_id = GGML_TYPES[encoding]
    return {"name": name, "id": type_id}


def _manifest(source: TableSource, header: Header, checksums: dict[str, Any], table_sha256: str,
              data_file: str, layout: TableLayout, fingerprint: dict[str, Any]) -> dict[str, Any]:
    scale = source.scale.to_json() if source.scale is not None else None
    return {
        "format": MANIFEST_FORMAT,
        "format_version": header.version,
        "file_id": header.file_id.hex(),
        "tool_version": __version__,
        "data_file": data_file,
        "file_size": header.file_size,
        "page_size": header.page_size,
        "rows_per_page": header.rows_per_page,
        "data_offset": header.data_offset,
        "encoding": header.encoding.label,
        "ggml_type": ggml_type_json(header.encoding),
        "row_bytes": header.row_bytes,
        "values_per_row": header.values_per_row,
        "num_rows": header.num_rows,
        "first_row": header.first_row,
        "total_rows": source.num_rows,
        "scale": scale,
        "ngram": source.spec.to_json(),
        "source": fingerprint | {"model": str(source.model_dir.resolve()),
                                          "table_sha256": table_sha256, **source.extra},
        "checksums": checksums,
        "layout": layout.entry or {"kind": "source-order", "num_placed": header.num_placed},
        "residency": list(layout.residency),
    }
