"""The prepared file v1 on disk: header bytes, page geometry, row-order map, manifest, writing."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import uuid
import zlib

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.core.constants import CHECKSUM_BLOCK_BYTES, HEADER_SIZE, MAGIC, Encoding
from ple_prep.core.errors import BadInput
from ple_prep.format.header import Header
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder, lookup_index_bytes
from ple_prep.offline.writer import WriteOptions, convert
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS


@pytest.fixture(scope="module")
def converted(fp8_checkpoint, tmp_path_factory, converted_table):
    """(table path, manifest, source rows) of the FP8 fixture in its default layout."""
    made = converted_table(fp8_checkpoint, tmp_path_factory.mktemp("layout") / "t.bin", with_rows=True)
    return made.path, made.manifest, made.rows


def test_convert_header_fields(converted):
    out, manifest, _ = converted
    raw = out.read_bytes()
    fields = struct.unpack_from("<8sIIIIIIQQQQQ16s32s", raw)
    magic, version, page_size, row_bytes, rows_per_page, encoding, values_per_row = fields[:7]
    num_rows, first_row, num_placed, order_offset, data_offset, file_id, digest = fields[7:]
    assert (magic, version, page_size, row_bytes, rows_per_page) == (b"PLEPREP\0", 2, 4096, 160, 25)
    assert (encoding, values_per_row) == (Encoding.FP8_E4M3.value, 160) == (1, 160)
    assert (num_rows, first_row, num_placed, order_offset, data_offset) == (FIXTURE_ROWS, 0, 0, 128, 4096)
    assert file_id.hex() == manifest["file_id"] and uuid.UUID(bytes=file_id).version == 4
    # The spec digest: SHA-256 of the canonical JSON of the scale's dtype and bytes and the hash spec.
    covered = {"scale": {"dtype": manifest["scale"]["dtype"], "hex": manifest["scale"]["hex"]},
               "ngram": manifest["ngram"]}
    assert digest == hashlib.sha256(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()).digest()
    used = struct.calcsize("<8sIIIIIIQQQQQ16s32s")
    assert used == 120 and raw[used:HEADER_SIZE] == bytes(HEADER_SIZE - used)
    assert not any(raw[HEADER_SIZE:data_offset])


def test_convert_rows_never_straddle_pages(converted):
    out, manifest, rows = converted
    raw = np.fromfile(out, dtype=np.uint8)
    data = raw[4096:]
    pages = -(-FIXTURE_ROWS // 25)
    assert len(raw) == manifest["file_size"] == 4096 + pages * 4096
    assert len(data) % 4096 == 0
    for slot in (0, 1, 24, 25, 26, 16895):
        page, position = divmod(slot, 25)
        offset = page * 4096 + position * 160
        assert offset // 4096 == (offset + 159) // 4096
        assert np.array_equal(data[offset:offset + 160], rows[slot])
    # Every page's tail after its 25 rows is zero padding, the last page's after its 21 rows.
    by_page = data.reshape(pages, 4096)
    assert not by_page[:, 25 * 160:].any()
    assert not by_page[-1, (FIXTURE_ROWS - (pages - 1) * 25) * 160:].any()


def test_convert_page_size_changes_geometry(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "t.bin", WriteOptions(page_size=8192))
        rows = source.read_rows(0, source.num_rows)
    with open_table(tmp_path / "t.bin") as table:
        assert (table.page_size, table.rows_per_page, table.header.data_offset) == (8192, 51, 8192)
        assert np.array_equal(table.gather(np.arange(FIXTURE_ROWS)), rows)


@pytest.mark.parametrize("page_size", [100, 1000, 256, 1 << 27])
def test_convert_refuses_bad_page_size(fp8_checkpoint, tmp_path, page_size):
    with open_source(fp8_checkpoint) as source, pytest.raises(BadInput, match="page size"):
        convert(source, tmp_path / "t.bin", WriteOptions(page_size=page_size))
    assert list(tmp_path.iterdir()) == []


def test_convert_identity_order_map(converted):
    out, manifest, _ = converted
    assert manifest["layout"] == {"kind": "source-order", "num_placed": 0}
    with open_table(out) as table:
        ids = np.arange(FIXTURE_ROWS)
        assert np.array_equal(table.slot_of(ids), ids)
        assert np.array_equal(table.page_of(ids), ids // 25)
        assert table.order.num_placed == 0


def test_convert_checksums_match_independent_crc(converted):
    out, manifest, rows = converted
    data = out.read_bytes()
    checksums = manifest["checksums"]
    assert checksums["algorithm"] == "crc32" and checksums["block_bytes"] == CHECKSUM_BLOCK_BYTES
    assert checksums["header_crc32"] == zlib.crc32(data[:4096])
    assert checksums["blocks"] == [zlib.crc32(data[4096 + i:4096 + i + CHECKSUM_BLOCK_BYTES])
                                   for i in range(0, len(data) - 4096, CHECKSUM_BLOCK_BYTES)]
    import hashlib
    assert manifest["source"]["table_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()


def test_convert_checksum_blocks_span_chunks(fp8_checkpoint, tmp_path, monkeypatch):
    # Small checksum blocks make the table span several blocks and write chunks.
    monkeypatch.setattr("ple_prep.offline.writer.CHECKSUM_BLOCK_BYTES", 64 << 10)
    with open_source(fp8_checkpoint) as source:
        manifest = convert(source, tmp_path / "t.bin")
        rows = source.read_rows(0, source.num_rows)
    data = (tmp_path / "t.bin").read_bytes()[4096:]
    assert manifest["checksums"]["block_bytes"] == 64 << 10
    assert manifest["checksums"]["blocks"] == [zlib.crc32(data[i:i + (64 << 10)])
                                               for i in range(0, len(data), 64 << 10)]
    # 169 chunks of 4 pages through the reused buffers: every row in place, every padding zero.
    pages = np.frombuffer(data, dtype=np.uint8).reshape(-1, 4096)
    assert not pages[:, 4000:].any() and not pages[-1, 21 * 160:].any()
    with open_table(tmp_path / "t.bin") as table:
        assert np.array_equal(table.gather(np.arange(FIXTURE_ROWS)), rows)


def test_convert_falls_back_when_direct_io_refused(fp8_checkpoint, tmp_path, monkeypatch):
    real_write, refused = os.write, []

    def write(descriptor, data):
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", write)
    with open_source(fp8_checkpoint) as source:
        manifest = convert(source, tmp_path / "t.bin")
        rows = source.read_rows(0, source.num_rows)
    monkeypatch.undo()
    if not refused:
        pytest.skip("this filesystem takes no O_DIRECT, so there is nothing to fall back from")
    assert refused == [4096]  # the first write, then the descriptor went back to buffered writes
    data = (tmp_path / "t.bin").read_bytes()
    assert manifest["checksums"]["header_crc32"] == zlib.crc32(data[:4096])
    with open_table(tmp_path / "t.bin") as table:
        assert np.array_equal(table.gather(np.arange(FIXTURE_ROWS)), rows)


def test_convert_manifest_fields(converted, fp8_checkpoint):
    out, returned, _ = converted
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["file_id"] == returned["file_id"]
    assert manifest_path(out) == out.with_name("t.bin.json")
    assert manifest["encoding"] == "fp8_e4m3" and manifest["row_bytes"] == 160
    assert manifest["scale"] == {"dtype": "BF16", "hex": "5339", "value": manifest["scale"]["value"]}
    assert manifest["ngram"]["multipliers"] == [23703573157769, 20109073645365, 8052911324071]
    assert manifest["ngram"]["rows_stored"] == FIXTURE_ROWS
    files = manifest["source"]["files"]
    assert files[0]["name"] == "config.json"
    assert {f["name"]: f["size"] for f in files[1:]} == {
        p.name: p.stat().st_size for p in fp8_checkpoint.glob("*.safetensors")}
    assert manifest["tool_version"] and manifest["data_file"] == "t.bin"


def test_convert_refuses_existing_output_and_force_replaces(fp8_checkpoint, tmp_path):
    out = tmp_path / "t.bin"
    with open_source(fp8_checkpoint) as source:
        first = convert(source, out)
        with pytest.raises(BadInput, match="--force"):
            convert(source, out)
        assert open_table(out).manifest["file_id"] == first["file_id"]
        second = convert(source, out, WriteOptions(force=True))
    assert second["file_id"] != first["file_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]
    with open_table(out) as table:
        assert table.manifest["file_id"] == second["file_id"]


def test_convert_free_space_checked_before_writing(fp8_checkpoint, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    with open_source(fp8_checkpoint) as source, pytest.raises(BadInput, match="not enough free space"):
        convert(source, tmp_path / "t.bin")
    assert list(tmp_path.iterdir()) == []


def test_convert_failure_leaves_nothing(fp8_checkpoint, tmp_path, monkeypatch):
    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ple_prep.offline.writer.write_all", fail)
    with open_source(fp8_checkpoint) as source, pytest.raises(BadInput, match="filled up"):
        convert(source, tmp_path / "t.bin")
    assert list(tmp_path.iterdir()) == []


def test_header_pack_unpack_round_trip():
    header = Header.for_table(page_size=4096, row_bytes=90, encoding=Encoding.NVFP4_PACKED,
                              values_per_row=160, num_rows=1000, first_row=7, num_placed=1000,
                              file_id=bytes(range(16)))
    # 1000 placed rows take 4000 bytes of map after the 128-byte header: data starts at page 2
    # (format v1 took 12,000 bytes: data at page 3).
    assert (header.rows_per_page, header.order_offset, header.data_offset) == (45, 128, 8192)
    assert header.file_size == 8192 + 23 * 4096
    v1 = Header.for_table(page_size=4096, row_bytes=90, encoding=Encoding.NVFP4_PACKED, values_per_row=160,
                          num_rows=1000, first_row=7, num_placed=1000, file_id=bytes(16), version=1)
    assert v1.data_offset == 12288 and Header.unpack(v1.pack(), v1.file_size) == v1
    raw = header.pack()
    assert len(raw) == HEADER_SIZE and raw.startswith(MAGIC)
    assert Header.unpack(raw, header.file_size) == header
    with pytest.raises(BadInput, match="truncated or extended"):
        Header.unpack(raw, header.file_size - 1)
    with pytest.raises(BadInput, match="magic"):
        Header.unpack(b"GGUF" + raw[4:], header.file_size)
    with pytest.raises(BadInput, match="format version 3"):
        Header.unpack(raw[:8] + struct.pack("<I", 3) + raw[12:], header.file_size)
    with pytest.raises(BadInput, match="reserved"):
        Header.unpack(raw[:-1] + b"\1", header.file_size)
    with pytest.raises(BadInput, match="geometry"):
        Header.unpack(raw[:20] + struct.pack("<I", 44) + raw[24:], header.file_size)


@pytest.fixture(params=["compiled", "numpy"])
def index_builder(request, monkeypatch):
    """The rank index built by the compiled helper, or by its numpy fallback."""
    from ple_prep.format import order as order_module

    if request.param == "compiled" and order_module._native is None:
        pytest.skip("the compiled helper is not built here")
    if request.param == "numpy":
        monkeypatch.setattr(order_module, "_native", None)
    return request.param


def test_row_order_slot_arithmetic(index_builder):
    order = RowOrder.from_placed(np.array([9, 2, 5]), 12)
    # Slots 0-2 hold rows 9, 2, 5; the rest follow in source order: 0, 1, 3, 4, 6, 7, 8, 10, 11.
    assert order.rows_at(0, 12).tolist() == [9, 2, 5, 0, 1, 3, 4, 6, 7, 8, 10, 11]
    assert order.slot_of(np.arange(12)).tolist() == [3, 4, 1, 5, 6, 2, 7, 8, 9, 0, 10, 11]
    restored = RowOrder.from_buffer(order.map_bytes(), 3, 12)
    assert restored.rows_at(0, 12).tolist() == order.rows_at(0, 12).tolist()
    with pytest.raises(BadInput, match="twice"):
        RowOrder.from_placed(np.array([1, 1]), 12)
    # A stored map is checked when its index is built (at open): a row outside, or one twice.
    with pytest.raises(BadInput, match="places row 15 of a 12-row table"):
        RowOrder.from_buffer(RowOrder.from_placed(np.array([1, 12 + 3]), 20).map_bytes(), 2, 12).build_rank_index()
    with pytest.raises(BadInput, match="twice"):
        RowOrder.from_buffer(np.array([4, 1, 4], dtype="<u4").tobytes(), 3, 12).build_rank_index()
    # Format v2 stores the slots' rows alone: 4 bytes a placed row.
    assert order.map_bytes().tobytes() == np.array([9, 2, 5], dtype="<u4").tobytes()


@pytest.mark.parametrize("chunk_slots", [1, 3, 1000, 1 << 20])
def test_rank_index_and_chunks_by_rank_are_the_same_from_the_helper_and_numpy(chunk_slots, monkeypatch):
    from ple_prep.format import order as order_module

    compiled_helper = order_module._native
    if compiled_helper is None:
        pytest.skip("the compiled helper is not built here")
    rows = np.random.default_rng(chunk_slots).permutation(3_000_017)[:1_100_003].astype(np.uint32)
    compiled = RowOrder(3_000_017, rows)
    built = compiled.rank_index, compiled.chunks_by_rank(chunk_slots)
    monkeypatch.setattr(order_module, "_native", None)
    fallback = RowOrder(3_000_017, rows)
    expected = fallback.rank_index, fallback.chunks_by_rank(chunk_slots)
    assert np.array_equal(built[0].rank_words, expected[0].rank_words)
    assert np.array_equal(built[0].packed_slots, expected[0].packed_slots)
    assert built[1].dtype == expected[1].dtype and np.array_equal(built[1], expected[1])
    # Each placed row's slot, rows ascending: what the index promises, checked without it.
    assert np.array_equal(compiled.sorted_slots, np.argsort(rows, kind="stable"))
    assert np.array_equal(built[1], np.argsort(rows, kind="stable") // chunk_slots)
    poisoned = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)  # every entry must be written
    monkeypatch.setattr(order_module, "_native", compiled_helper)
    assert np.array_equal(RowOrder(3_000_017, rows).chunks_by_rank(chunk_slots, poisoned),
                          np.argsort(rows, kind="stable") // chunk_slots)


@pytest.mark.parametrize("num_placed", [1, 2, 3, 63, 64, 65, 4096, 4097, 70_001])
def test_packed_slots_take_just_the_bits_the_slots_need(num_placed, index_builder, monkeypatch):
    from ple_prep.format import order as order_module

    allocate = order_module._huge_page_array

    def poisoned(shape, dtype):  # every byte of the index must be written, none left as found
        array = allocate(shape, dtype)
        array.view(np.uint8)[...] = 0xA5
        return array

    monkeypatch.setattr(order_module, "_huge_page_array", poisoned)
    num_rows = 200_003
    rows = np.random.default_rng(num_placed).permutation(num_rows)[:num_placed]
    order = RowOrder.from_placed(rows, num_rows)
    bits = max(1, (num_placed - 1).bit_length())
    index = order.rank_index
    assert index.rank_words.shape == (-(-num_rows // 64), 2)
    assert len(index.packed_slots) == 8 * -(-num_placed * bits // 64) + 8  # whole words, then one more
    assert lookup_index_bytes(num_rows, num_placed) == index.rank_words.nbytes + index.packed_slots.nbytes
    # Every row, placed or not, against the slots the map spells out.
    expected = np.empty(num_rows, dtype=np.int64)
    expected[rows] = np.arange(num_placed)
    unplaced = np.ones(num_rows, dtype=bool)
    unplaced[rows] = False
    expected[unplaced] = np.arange(num_placed, num_rows)
    assert np.array_equal(order.slot_of(np.arange(num_rows)), expected)
    assert np.array_equal(order.rows_at(0, num_rows)[expected], np.arange(num_rows))
    assert np.array_equal(order.placed_mask(0, num_rows), ~unplaced)
    assert np.array_equal(order.placed_mask(63, 1_000), ~unplaced[63:1_000])


def test_building_the_index_gives_back_the_memory_past_the_packed_slots(index_builder, monkeypatch):
    import mmap

    from ple_prep.format import order as order_module

    allocate = order_module._huge_page_array

    def poisoned(shape, dtype):
        array = allocate(shape, dtype)
        array.view(np.uint8)[...] = 0xA5
        return array

    monkeypatch.setattr(order_module, "_huge_page_array", poisoned)
    rows = np.random.default_rng(9).permutation(1_000_003)[:300_007]
    packed = RowOrder.from_placed(rows, 1_000_003).rank_index.packed_slots
    area = packed.base  # the 4 bytes a slot the ranks were written to, packed in place at its start
    assert area.nbytes == 4 * len(rows) > len(packed) + 2 * mmap.PAGESIZE
    # Pages given back read as zeros; kept ones would still hold slots or the poison.
    tail = -(-(area.ctypes.data + len(packed)) // mmap.PAGESIZE) * mmap.PAGESIZE - area.ctypes.data
    assert not area[tail:].any()
