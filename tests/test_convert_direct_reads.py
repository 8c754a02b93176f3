"""convert reads its source with O_DIRECT where it can: the same rows, checksums and digest as
reading through the page cache, and the page cache wherever O_DIRECT cannot serve a read."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import zlib

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.format.layout import TableLayout
from ple_prep.format.order import RowOrder
from ple_prep.offline.direct_io import O_DIRECT, DirectRows
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import make_gguf


@pytest.fixture(scope="module")
def gguf_joined(tmp_path_factory):
    """One IQ4_NL table in one file: its rows start at an offset no page boundary divides."""
    return make_gguf(tmp_path_factory.mktemp("gguf-joined"), "iq4_nl") / "model.gguf"


@pytest.fixture(scope="module")
def gguf_split_files(tmp_path_factory):
    """The head tensors spread over two files among other tensors: many segments."""
    return make_gguf(tmp_path_factory.mktemp("gguf-split"), "q8_0", layout="split", num_files=2)


def _ranges(num_rows: int) -> list[tuple[int, int]]:
    """Reads at the table's start and end, one row, odd lengths, and every segment's edge."""
    rng = np.random.default_rng(3)
    starts = rng.integers(0, num_rows - 1, size=40)
    ranges = [(0, num_rows), (0, 1), (num_rows - 1, num_rows), (num_rows - 777, num_rows), (5, 5)]
    ranges += [(int(start), int(min(num_rows, start + length)))
               for start, length in zip(starts, rng.integers(1, 3000, size=40))]
    return ranges


@pytest.mark.parametrize("variant", ["gguf_joined", "gguf_split_files", "fp8_checkpoint", "nvfp4_checkpoint"])
def test_direct_rows_read_the_rows_the_source_reads(variant, request):
    with open_source(request.getfixturevalue(variant)) as source, DirectRows(source) as direct:
        expected = source.read_rows(0, source.num_rows)
        edges = [segment.first_row for segment in source.parts[0]]
        ranges = _ranges(source.num_rows) + [(max(0, edge - 3), min(source.num_rows, edge + 3)) for edge in edges]
        for start, stop in ranges:
            rows = direct.read(start, stop, direct.buffer(stop - start))
            assert rows.shape == (stop - start, source.row_bytes)
            assert np.array_equal(rows, expected[start:stop]), (start, stop)


def test_direct_rows_go_back_to_the_page_cache_when_a_read_is_refused(gguf_joined, monkeypatch):
    real_preadv, refused = os.preadv, []

    def preadv(descriptor, buffers, offset):
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(descriptor, buffers, offset)

    with open_source(gguf_joined) as source, DirectRows(source) as direct:
        expected = source.read_rows(0, source.num_rows)
        monkeypatch.setattr(os, "preadv", preadv)
        for start, stop in [(0, 100), (100, source.num_rows)]:
            assert np.array_equal(direct.read(start, stop, direct.buffer(stop - start)), expected[start:stop])
    if not O_DIRECT or not refused:
        pytest.skip("this filesystem takes no O_DIRECT, so there is nothing to fall back from")
    assert len(refused) == 1 and not direct.direct


def test_direct_rows_of_a_truncated_source_say_so(gguf_joined, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(gguf_joined.read_bytes())
    with open_source(model) as source, DirectRows(source) as direct:
        os.truncate(model, model.stat().st_size - 5000)
        with pytest.raises(BadInput, match="ended early"):
            direct.read(0, source.num_rows, direct.buffer(source.num_rows))


@pytest.mark.parametrize("variant", ["gguf_joined", "gguf_split_files"])
def test_convert_access_ordered_gguf_writes_every_row_and_its_checksums(variant, request, tmp_path, monkeypatch):
    # 64 KiB checksum blocks: many write chunks and buckets of placed rows on this small table.
    monkeypatch.setattr("ple_prep.offline.writer.CHECKSUM_BLOCK_BYTES", 64 << 10)
    with open_source(request.getfixturevalue(variant)) as source:
        rows = source.read_rows(0, source.num_rows)
        placed = np.random.default_rng(7).permutation(source.num_rows)[:source.num_rows // 3 + 5]
        layout = TableLayout(RowOrder.from_placed(placed, source.num_rows))
        manifest = convert(source, tmp_path / "t.bin", layout=layout)
        planned = convert(source, tmp_path / "planned.bin", plan=lambda: layout)
    raw = (tmp_path / "t.bin").read_bytes()
    offset, block = manifest["data_offset"], manifest["checksums"]["block_bytes"]
    data = raw[offset:]
    assert manifest["checksums"]["blocks"] == [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]
    assert manifest["source"]["table_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()
    assert planned["source"]["table_sha256"] == manifest["source"]["table_sha256"]
    assert (tmp_path / "planned.bin").read_bytes()[offset:] == data
    with open_table(tmp_path / "t.bin") as table:
        assert np.array_equal(table.gather(np.arange(source.num_rows)), rows)
        assert np.array_equal(table.slot_of(placed), np.arange(len(placed)))


@pytest.mark.parametrize("variant", ["gguf_joined", "gguf_split_files"])
def test_convert_source_order_gguf_writes_every_row_and_its_digest(variant, request, tmp_path):
    with open_source(request.getfixturevalue(variant)) as source:
        rows = source.read_rows(0, source.num_rows)
        manifest = convert(source, tmp_path / "t.bin")
    assert manifest["source"]["table_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()
    raw = (tmp_path / "t.bin").read_bytes()
    assert manifest["checksums"]["header_crc32"] == zlib.crc32(raw[:manifest["data_offset"]])
    with open_table(tmp_path / "t.bin") as table:
        assert np.array_equal(table.gather(np.arange(source.num_rows)), rows)


def test_direct_rows_leave_a_source_with_reads_of_its_own_to_them(gguf_joined):
    """A source that computes its rows (bench/synthetic.py's, a subclass's `read_rows`) is read
    through that method, never from the files its segments name."""
    with open_source(gguf_joined) as opened:
        class Inverted(type(opened)):
            def read_rows(self, start, stop, out=None):
                return 255 - super().read_rows(start, stop, out)

        opened.__class__ = Inverted
        with DirectRows(opened) as direct:
            rows = direct.read(10, 500, direct.buffer(490))
        opened.__class__ = Inverted.__mro__[1]
        assert np.array_equal(rows, 255 - opened.read_rows(10, 500))


def test_preallocate_gives_the_file_its_blocks(tmp_path):
    from ple_prep.offline.direct_io import preallocate

    descriptor = os.open(tmp_path / "t.bin", os.O_RDWR | os.O_CREAT)
    try:
        preallocate(descriptor, 3 << 20)
        found = os.fstat(descriptor)
    finally:
        os.close(descriptor)
    if found.st_size == 0:
        pytest.skip("this file system has no fallocate")
    assert found.st_size == 3 << 20 and found.st_blocks * 512 >= 3 << 20


def test_aligned_zeros_are_zeros_at_a_page_boundary_each_of_its_own():
    from ple_prep.offline.direct_io import DIRECT_IO_ALIGNMENT, aligned_zeros

    first, second = aligned_zeros(3 << 20), aligned_zeros(3 << 20)
    assert first.ctypes.data % DIRECT_IO_ALIGNMENT == 0 and not first.any()
    first[:] = 7
    assert not second.any() and (first == 7).all()
