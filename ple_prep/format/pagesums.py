"""The page-sums file beside a table (`t.bin.pagesums`): one checksum per table page, so that a read
of a few pages can be checked against what was written (the manifest's crc32 covers 64 MiB blocks,
too coarse for a 4 KiB read). docs/FORMAT.md, "Page sums":

    bytes 0-7    b"PLEPSUMS"
    8-11         version (1), little-endian uint32
    12-15        page size
    16-23        number of pages
    24-39        the table's file id (its header's)
    40-43        crc32 of the sums that follow
    44-47        crc32 of bytes 0-43
    48-          one little-endian uint32 per page: the low 32 bits of XXH64 (seed 0) of its bytes

A page's sum is XXH64 for its speed (the compiled helper: several GB/s, a few percent of a cold
read's time; BENCHMARKS.md, "Read verification"); numpy computes the same values without it.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from ..core.errors import BadInput

try:
    from ..core import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

SUFFIX = ".pagesums"
MAGIC = b"PLEPSUMS"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ16sII")
HEAD_BYTES = _HEAD.size

_P1, _P2, _P3, _P4, _P5 = (np.uint64(p) for p in (11400714785074694791, 14029467366897019727,
                                                  1609587929392839161, 9650029242287828579,
                                                  2870177450012600261))


def pagesums_path(table_path: str | Path) -> Path:
    table_path = Path(table_path)
    return table_path.with_name(table_path.name + SUFFIX)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(accumulator: np.ndarray, lane: np.ndarray) -> np.ndarray:
    return _rotl(accumulator + lane * _P2, 31) * _P1


def _sums_numpy(pages: np.ndarray) -> np.ndarray:
    """XXH64 (seed 0) of each row of `pages` (uint8, rows a multiple of 32 bytes), low 32 bits;
    core/native/pagesums.c's loop, run across all pages at once."""
    count, length = pages.shape
    words = np.ascontiguousarray(pages).view("<u8").reshape(count, length // 32, 4)
    with np.errstate(over="ignore"):
        lanes = [np.full(count, value, dtype=np.uint64)
                 for value in (_P1 + _P2, _P2, np.uint64(0), np.uint64(0) - _P1)]
        for stripe in range(length // 32):
            for lane in range(4):
                lanes[lane] = _round(lanes[lane], words[:, stripe, lane])
        value = _rotl(lanes[0], 1) + _rotl(lanes[1], 7) + _rotl(lanes[2], 12) + _rotl(lanes[3], 18)
        for lane in lanes:
            value = (value ^ _round(np.zeros(count, dtype=np.uint64), lane)) * _P1 + _P4
        value += np.uint64(length)
        value ^= value >> np.uint64(33)
        value *= _P2
        value ^= value >> np.uint64(29)
        value *= _P3
        value ^= value >> np.uint64(32)
    return (value & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def page_sums(pages: np.ndarray) -> np.ndarray:
    """uint32 sum of each page of `pages` (uint8 `(count, page_size)`, C-contiguous)."""
    count, page_size = pages.shape
    if _native is None:
        return _sums_numpy(pages)
    out = np.empty(count, dtype=np.uint32)
    _native.page_sums(pages, page_size, out)
    return out


def pack(header, sums: np.ndarray) -> bytes:
    """The page-sums file of a table (its Header) whose pages have these sums."""
    body = np.ascontiguousarray(sums, dtype="<u4").tobytes()
    head = _HEAD.pack(MAGIC, VERSION, header.page_size, header.num_pages, header.file_id, zlib.crc32(body), 0)
    head = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))
    return head + body


def load_page_sums(table_path: str | Path, header) -> np.ndarray:
    """The sums of the table whose Header this is, from its page-sums file; BadInput if missing,
    damaged or another table's."""
    path = pagesums_path(table_path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path.name} is missing: reads can be verified only against a table's page sums "
                       f"(ple-prep pagesums {Path(table_path).name} writes them)") from None
    if len(data) < HEAD_BYTES or data[:8] != MAGIC:
        raise BadInput(f"{path.name} is not a page-sums file")
    _, version, page_size, num_pages, file_id, body_crc, head_crc = _HEAD.unpack(data[:HEAD_BYTES])
    if version != VERSION or zlib.crc32(data[:HEAD_BYTES - 4]) != head_crc:
        raise BadInput(f"{path.name} is not a page-sums file of version {VERSION}, or its header is damaged")
    if file_id != header.file_id or page_size != header.page_size or num_pages != header.num_pages:
        raise BadInput(f"{path.name} belongs to another table (file id or geometry differ): write it again "
                       f"with ple-prep pagesums")
    body = data[HEAD_BYTES:]
    if len(body) != 4 * num_pages or zlib.crc32(body) != body_crc:
        raise BadInput(f"{path.name} is damaged (its size or its sums' crc32 is wrong): write it again")
    return np.frombuffer(body, dtype="<u4")
