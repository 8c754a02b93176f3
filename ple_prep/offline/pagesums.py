"""Write a table's page-sums file (format/pagesums.py), which `open_table(verify_reads=True)` checks
the disk tier's reads against. Every byte is read once, in the manifest's checksum blocks, and the
sums are written only if each block's crc32 is the manifest's: they are sums of the converted
bytes, never of a disk's corruption."""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.constants import HEADER_SIZE
from ..core.errors import BadInput
from ..core.fileio import check_output, open_regular, read_exactly, write_atomic
from ..format.header import Header
from ..format.manifest import load_table_manifest
from ..format.pagesums import pack, page_sums, pagesums_path

# Bytes read per step: a few MiB, so the memory used stays small whatever the table's size.
READ_BYTES = 8 << 20


def write_page_sums(table_path: str | Path, progress: Callable[[int], None] = lambda _: None) -> Path:
    """The page-sums file of the table at `table_path`, written beside it (replacing an older one;
    a folder, FIFO or device there is refused before the table is read)."""
    table_path = Path(table_path)
    manifest = load_table_manifest(table_path)
    out = pagesums_path(table_path)
    check_output(out, force=True)
    checksums = manifest["checksums"]
    block_bytes = checksums["block_bytes"]
    descriptor = open_regular(table_path, "table")
    try:
        header = Header.unpack(os.pread(descriptor, HEADER_SIZE, 0), os.fstat(descriptor).st_size, table_path.name)
        if header.file_id.hex() != manifest["file_id"]:
            raise BadInput(f"{table_path.name} and its manifest come from different conversions")
        page_size, data_offset = header.page_size, header.data_offset
        step = max(page_size, READ_BYTES // page_size * page_size)
        sums = np.empty(header.num_pages, dtype=np.uint32)
        buffer = np.empty(step, dtype=np.uint8)
        end = data_offset + header.num_pages * page_size
        for block, expected in enumerate(checksums["blocks"]):
            start = data_offset + block * block_bytes
            stop, crc = min(start + block_bytes, end), 0
            for position in range(start, stop, step):
                length = min(step, stop - position)
                piece = memoryview(buffer)[:length]
                read_exactly(descriptor, piece, position, table_path.name)
                crc = zlib.crc32(piece, crc)
                first = (position - data_offset) // page_size
                sums[first:first + length // page_size] = page_sums(buffer[:length].reshape(-1, page_size))
                progress(length)
            if crc != expected:
                raise BadInput(f"{table_path.name}: checksum block {block} (bytes {start}-{stop}) differs from its "
                               f"manifest's crc32: the file is damaged; no page sums written (run ple-prep verify)")
    finally:
        os.close(descriptor)
    write_atomic(out, pack(header, sums))
    return out
