"""The progress journal that lets `convert --resume` continue a killed conversion.

Beside its partial data file every convert keeps `.{name}.progress.{pid}-{token}.partial`: JSON lines, the
first naming the run (file id, a digest of the header and row-order bytes, the source fingerprint,
the checksum block size), then one line per checksum block, appended only after the data file was
fsynced past that block. A resume trusts nothing it cannot check: it re-reads every journaled block
and compares its CRC-32 (recomputing the table's SHA-256 on the way), keeps the verified prefix,
and writes the rest. A torn last line or a bad block ends the verified prefix there.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import BadInput
from ..core.fileio import create_exclusive, open_regular, read_bounded, read_exactly
from ..format.header import Header
from ..format.pages import page_rows, rows_in_block

JOURNAL_KIND = "ple-prep-progress"
# One short line per 64 MiB block: a 48 GiB table's journal is under 40 KB.
MAX_JOURNAL_BYTES = 16 << 20


def progress_name(final: Path) -> Path:
    """The name whose partial (`.{name}.progress.{pid}-{token}.partial`) holds the journal of `final`."""
    return final.with_name(final.name + ".progress")


def identity(header: Header, prefix: bytes, fingerprint: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    return {"journal": JOURNAL_KIND, "version": 1, "file_id": header.file_id.hex(),
            "prefix_sha256": hashlib.sha256(prefix).hexdigest(), "header_crc32": zlib.crc32(prefix),
            "source": fingerprint, "block_bytes": block_bytes}


class Journal:
    """Append-only; each line is on disk (fsync) before `append` returns."""

    def __init__(self, path: Path, first_line: dict[str, Any] | None):
        if first_line:
            self._descriptor = create_exclusive(path)
            self._write(first_line)
        else:
            self._descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)

    def _write(self, line: dict[str, Any]) -> None:
        os.write(self._descriptor, json.dumps(line, sort_keys=True).encode() + b"\n")
        os.fsync(self._descriptor)

    def append(self, block: int, crc: int) -> None:
        self._write({"block": block, "crc32": crc})

    def close(self) -> None:
        os.close(self._descriptor)


@dataclasses.dataclass
class Resumable:
    data: Path
    journal: Path
    first_line: dict[str, Any]
    block_crcs: list[int]

    @property
    def file_id(self) -> bytes:
        return bytes.fromhex(self.first_line["file_id"])


def load(data: Path, journal: Path) -> Resumable | None:
    """A dead run's partial and journal, or None when the journal says nothing usable."""
    try:
        lines = read_bounded(journal, MAX_JOURNAL_BYTES, "journal").split(b"\n")
        first_line = json.loads(lines[0])
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(first_line, dict) or first_line.get("journal") != JOURNAL_KIND:
        return None
    if not re.fullmatch(r"[0-9a-f]{32}", str(first_line.get("file_id"))):
        return None
    crcs: list[int] = []
    for raw in lines[1:]:
        try:
            entry = json.loads(raw)
        except ValueError:
            break  # a torn last line: the block was never promised
        if (not isinstance(entry, dict) or entry.get("block") != len(crcs)
                or not isinstance(entry.get("crc32"), int)):
            break
        crcs.append(entry["crc32"])
    return Resumable(data, journal, first_line, crcs)


def verify_prefix(path: Path, header: Header, block_bytes: int, header_crc: int,
                  block_crcs: list[int], progress=None) -> tuple[int, Any]:
    """(blocks whose bytes still match the journal, SHA-256 of their rows) after re-reading them.

    Three stages overlap as in the writer: a thread reads the next block while this one is
    CRC-checked and a third hashes the previous one's rows (all release the GIL). A block's rows
    go into the SHA-256 only once its CRC has matched.
    """
    digest = hashlib.sha256()
    descriptor = open_regular(path, "partial table")
    reader = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    buffers = [np.empty(block_bytes, dtype=np.uint8) for _ in range(3)]
    hashed = None
    try:
        if zlib.crc32(os.pread(descriptor, header.data_offset, 0)) != header_crc:
            return 0, digest
        start = header.data_offset
        reading = reader.submit(_read_block, descriptor, start, buffers[0]) if block_crcs else None
        for block, expected in enumerate(block_crcs):
            raw = reading.result()
            if block + 1 < len(block_crcs):
                # Buffer block+1 % 3 was last hashed for block-2: that hash is done (waited below).
                reading = reader.submit(_read_block, descriptor, start + (block + 1) * block_bytes,
                                        buffers[(block + 1) % 3])
            if raw is None or zlib.crc32(raw) != expected:
                return block, digest
            first_slot, stop_slot = rows_in_block(header, block, block_bytes)
            rows = stop_slot - first_slot
            if hashed is not None:
                hashed.result()
            hashed = hasher.submit(_hash_rows, digest, raw, header, rows)
            if progress is not None:
                progress(rows * header.row_bytes)
        return len(block_crcs), digest
    finally:
        # Wait for every stage before returning the digest or closing the descriptor.
        reader.shutdown(wait=True)
        hasher.shutdown(wait=True)
        os.close(descriptor)


def _read_block(descriptor: int, start: int, buffer: np.ndarray) -> np.ndarray | None:
    """One whole block, or None when the file ends first (a block the killed run never wrote)."""
    try:
        read_exactly(descriptor, memoryview(buffer), start, "the partial table")
    except BadInput:
        return None
    return buffer


def _hash_rows(digest, raw: np.ndarray, header: Header, rows: int) -> None:
    """Add the rows of one block (each page's rows, not its padding) to `digest`."""
    for run in page_rows(raw.reshape(-1, header.page_size), rows, header.rows_per_page, header.row_bytes):
        digest.update(np.ascontiguousarray(run))


def truncate_after(journal: Path, blocks: int) -> None:
    """Cut the journal after its first `blocks` block lines (dropping bad blocks and a torn line)."""
    raw = read_bounded(journal, MAX_JOURNAL_BYTES, "journal")
    end = 0
    for _ in range(blocks + 1):
        end = raw.index(b"\n", end) + 1
    os.truncate(journal, end)
