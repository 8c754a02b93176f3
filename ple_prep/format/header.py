"""The prepared file's fixed header and page geometry (docs/FORMAT.md). Standard library only."""
from __future__ import annotations

import dataclasses
import os
import zlib

from ..core.constants import (
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    MAX_ROWS,
    ORDER_OFFSET,
    READ_VERSIONS,
    Encoding,
    row_bytes_for,
)
from ..core.errors import BadInput

# Bytes per placed row in the stored order map, by format version: v2 stores the row id of each
# slot; v1 also stored the sorted ids and their slots (format/order.py derives those).
ORDER_BYTES_PER_PLACED = {1: 12, 2: 4}
# Bytes a pread while the bytes before the data are summed (the real table's map is 126 MB).
HEADER_REGION_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class Header:
    page_size: int
    row_bytes: int
    rows_per_page: int
    encoding: Encoding
    values_per_row: int
    num_rows: int
    first_row: int
    num_placed: int
    order_offset: int
    data_offset: int
    file_id: bytes
    # SHA-256 of the manifest's scale bytes and hash spec (format/manifest.py: spec_digest).
    spec_digest: bytes = bytes(32)
    version: int = FORMAT_VERSION

    @classmethod
    def for_table(cls, *, page_size: int, row_bytes: int, encoding: Encoding, values_per_row: int,
                  num_rows: int, first_row: int, num_placed: int, file_id: bytes,
                  spec_digest: bytes = bytes(32), version: int = FORMAT_VERSION) -> "Header":
        """The header of a new file; raises BadInput on geometry the format cannot hold."""
        if page_size < 512 or page_size & (page_size - 1) or page_size > 1 << 26:
            raise BadInput(f"page size {page_size} must be a power of two from 512 to 64 MiB")
        if not 0 < row_bytes <= page_size:
            raise BadInput(f"a {row_bytes}-byte row does not fit a {page_size}-byte page")
        if not 0 < num_rows <= MAX_ROWS or not 0 <= num_placed <= num_rows:
            raise BadInput(f"{num_rows} rows ({num_placed} placed) is outside what the format holds")
        if not 0 <= first_row <= MAX_ROWS - num_rows:
            raise BadInput(f"global rows [{first_row}, +{num_rows}) are outside what the format holds")
        order_end = ORDER_OFFSET + ORDER_BYTES_PER_PLACED[version] * num_placed
        data_offset = -(-order_end // page_size) * page_size
        return cls(page_size, row_bytes, page_size // row_bytes, encoding, values_per_row, num_rows,
                   first_row, num_placed, ORDER_OFFSET, data_offset, file_id, spec_digest, version)

    @property
    def num_pages(self) -> int:
        return -(-self.num_rows // self.rows_per_page)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.num_pages * self.page_size

    def pack(self) -> bytes:
        packed = HEADER_STRUCT.pack(MAGIC, self.version, self.page_size, self.row_bytes,
                                    self.rows_per_page, int(self.encoding), self.values_per_row,
                                    self.num_rows, self.first_row, self.num_placed,
                                    self.order_offset, self.data_offset, self.file_id, self.spec_digest)
        return packed.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, file_size: int, name: str = "file") -> "Header":
        """Parse and check a header against the size of the file it came from."""
        if len(raw) < HEADER_SIZE or file_size < HEADER_SIZE:
            raise BadInput(f"{name}: {file_size} bytes is too short for a ple-prep table")
        (magic, version, page_size, row_bytes, rows_per_page, encoding, values_per_row, num_rows,
         first_row, num_placed, order_offset, data_offset, file_id,
         spec_digest) = HEADER_STRUCT.unpack_from(raw)
        if magic != MAGIC:
            # The bytes themselves are not printed: they failed validation.
            raise BadInput(f"{name}: not a ple-prep table (wrong magic bytes)")
        if version not in READ_VERSIONS:
            raise BadInput(f"{name}: format version {version}; this ple-prep reads versions "
                           f"{', '.join(map(str, READ_VERSIONS))}")
        if any(raw[HEADER_STRUCT.size:HEADER_SIZE]):
            raise BadInput(f"{name}: reserved header bytes are not zero")
        try:
            encoding = Encoding(encoding)
        except ValueError:
            raise BadInput(f"{name}: unknown encoding {encoding}") from None
        try:
            expected_row_bytes = row_bytes_for(encoding, values_per_row) if values_per_row else 0
        except ValueError:
            expected_row_bytes = 0
        if expected_row_bytes != row_bytes:
            raise BadInput(f"{name}: {row_bytes}-byte rows cannot hold {values_per_row} "
                           f"{encoding.label} values")
        header = cls.for_table(page_size=page_size, row_bytes=row_bytes, encoding=encoding,
                               values_per_row=values_per_row, num_rows=num_rows,
                               first_row=first_row, num_placed=num_placed, file_id=file_id,
                               spec_digest=spec_digest, version=version)
        stored = (rows_per_page, order_offset, data_offset)
        derived = (header.rows_per_page, header.order_offset, header.data_offset)
        if stored != derived:
            raise BadInput(f"{name}: header geometry (rows per page, order offset, data offset) "
                           f"{stored} disagrees with its own fields {derived}")
        if file_size != header.file_size:
            raise BadInput(f"{name}: {file_size} bytes but the header describes {header.file_size} "
                           f"(truncated or extended)")
        return header


def header_region_crc(descriptor: int, data_offset: int) -> int | None:
    """CRC-32 of a table file's bytes before its data (header, row-order map, padding), as the
    manifest's `checksums.header_crc32` holds it; None where the file ends before `data_offset`."""
    crc = done = 0
    while done < data_offset:
        chunk = os.pread(descriptor, min(HEADER_REGION_CHUNK, data_offset - done), done)
        if not chunk:
            return None
        crc, done = zlib.crc32(chunk, crc), done + len(chunk)
    return crc
