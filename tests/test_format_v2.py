"""Format v2: the 4-byte order map, the one-pass access-ordered writer, and v1 tables still served."""
from __future__ import annotations

import hashlib
import json
import zlib

import numpy as np
import pytest

from ple_prep.core.constants import HEADER_SIZE
from ple_prep.core.errors import BadInput
from ple_prep.format.header import Header
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder
from ple_prep.offline.verify import verify
from ple_prep.runtime import open_table


def _placed(num_rows: int, _spec) -> np.ndarray:
    # Enough rows for several write chunks once the chunks are made small, ending mid-page.
    return np.random.default_rng(11).permutation(num_rows)[:5_003]


@pytest.fixture
def small_chunks(monkeypatch):
    """64 KiB checksum blocks: 4-page write chunks, so the placed rows take many spill buckets and
    the placed region ends inside a block written by both passes."""
    monkeypatch.setattr("ple_prep.offline.writer.CHECKSUM_BLOCK_BYTES", 64 << 10)


@pytest.mark.parametrize(("variant", "count"), [
    ("fp8_checkpoint", 5_003),   # the placed region ends inside a page, past several buckets
    ("fp8_checkpoint", 5_000),   # ... at a page's end
    ("fp8_checkpoint", 7),       # inside the first page
    ("fp8_checkpoint", 16_896),  # every row placed
    ("nvfp4_checkpoint", 5_003),
])
def test_access_ordered_convert_places_every_row_in_one_source_pass(variant, count, request, tmp_path,
                                                                     converted_table, small_chunks):
    def placed_rows(num_rows, _spec):
        return np.random.default_rng(11).permutation(num_rows)[:count]

    made = converted_table(request.getfixturevalue(variant), tmp_path / "t.bin", placed=placed_rows,
                           with_rows=True)
    manifest, rows = made.manifest, made.rows
    placed = placed_rows(len(rows), None)
    raw = made.path.read_bytes()
    header = Header.unpack(raw[:HEADER_SIZE], len(raw))
    assert header.version == manifest["format_version"] == 2 and header.num_placed == len(placed)
    # The map: one u32 a slot, then zeros up to the data.
    assert raw[HEADER_SIZE:HEADER_SIZE + 4 * len(placed)] == placed.astype("<u4").tobytes()
    assert not any(raw[HEADER_SIZE + 4 * len(placed):header.data_offset])
    # Every slot holds its row; every page tail is zero.
    slots = np.concatenate([placed, np.setdiff1d(np.arange(len(rows)), placed)])
    pages = np.frombuffer(raw, dtype=np.uint8)[header.data_offset:].reshape(-1, header.page_size)
    used = header.rows_per_page * header.row_bytes
    stored = pages[:, :used].reshape(-1, header.row_bytes)[:len(rows)]
    assert np.array_equal(stored, rows[slots])
    assert not pages[:, used:].any() and not pages[:, :used].reshape(-1, header.row_bytes)[len(rows):].any()
    # Checksums over the bytes as written; the table's SHA-256 is of the rows in source order.
    block = manifest["checksums"]["block_bytes"]
    data = raw[header.data_offset:]
    assert manifest["checksums"]["blocks"] == [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]
    assert manifest["checksums"]["header_crc32"] == zlib.crc32(raw[:header.data_offset])
    assert manifest["source"]["table_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()
    # The journal is gone, and no other file was made.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]
    with open_table(made.path) as table:
        assert np.array_equal(table.gather(np.arange(len(rows))), rows)


def test_open_builds_the_lookup_index_so_no_request_does(fp8_checkpoint, tmp_path, converted_table,
                                                         monkeypatch):
    made = converted_table(fp8_checkpoint, tmp_path / "t.bin", placed=_placed)
    with open_table(made.path) as table:
        assert table.order._rank_index is not None
        monkeypatch.setattr(RowOrder, "build_rank_index", lambda self: pytest.fail("built in a request"))
        table.gather(np.arange(100))
        table.slot_of(np.arange(100))


def write_v1_copy(table_path, out):
    """The same table in format v1 (12 bytes a placed row: slot_rows, sorted_rows, sorted_slots;
    `table_sha256` of the rows in slot order), as ple-prep wrote it before v2."""
    raw = table_path.read_bytes()
    header = Header.unpack(raw[:HEADER_SIZE], len(raw))
    manifest = json.loads(manifest_path(table_path).read_text())
    order = RowOrder.from_buffer(raw[header.order_offset:header.data_offset], header.num_placed, header.num_rows)
    v1 = Header.for_table(page_size=header.page_size, row_bytes=header.row_bytes, encoding=header.encoding,
                          values_per_row=header.values_per_row, num_rows=header.num_rows,
                          first_row=header.first_row, num_placed=header.num_placed,
                          file_id=header.file_id, spec_digest=header.spec_digest, version=1)
    order_bytes = order.slot_rows.tobytes() + order.sorted_rows.tobytes() + order.sorted_slots.tobytes()
    prefix = (v1.pack() + order_bytes).ljust(v1.data_offset, b"\0")
    data = raw[header.data_offset:]
    out.write_bytes(prefix + data)
    pages = np.frombuffer(data, dtype=np.uint8).reshape(-1, header.page_size)
    in_slot_order = pages[:, :header.rows_per_page * header.row_bytes].reshape(-1, header.row_bytes)
    manifest |= {"format_version": 1, "data_offset": v1.data_offset, "file_size": v1.file_size,
                 "data_file": out.name}
    manifest["checksums"]["header_crc32"] = zlib.crc32(prefix)
    manifest["source"]["table_sha256"] = hashlib.sha256(in_slot_order[:header.num_rows].tobytes()).hexdigest()
    manifest_path(out).write_text(json.dumps(manifest))


@pytest.mark.parametrize("placed", [None, _placed], ids=["source order", "access-ordered"])
def test_v1_tables_still_open_and_serve_bit_exactly(fp8_checkpoint, tmp_path, converted_table, placed, loops):
    made = converted_table(fp8_checkpoint, tmp_path / "v2.bin", placed=placed, with_rows=True)
    write_v1_copy(made.path, tmp_path / "v1.bin")
    ids = np.random.default_rng(5).integers(0, len(made.rows), 3000)
    with open_table(tmp_path / "v1.bin") as old, open_table(made.path) as new:
        assert old.header.version == 1 and new.header.version == 2
        assert np.array_equal(old.slot_of(ids), new.slot_of(ids))
        assert np.array_equal(old.gather(np.arange(len(made.rows))), made.rows)
        assert np.array_equal(old.values(ids), new.values(ids))
    report = verify(tmp_path / "v1.bin", fp8_checkpoint)
    assert report.ok and report.rows_compared == len(made.rows)


def test_v1_map_that_disagrees_with_itself_is_refused(fp8_checkpoint, tmp_path, converted_table):
    made = converted_table(fp8_checkpoint, tmp_path / "v2.bin", placed=_placed)
    write_v1_copy(made.path, tmp_path / "v1.bin")
    raw = bytearray((tmp_path / "v1.bin").read_bytes())
    num_placed = len(_placed(16896, None))
    # The last sorted slot points elsewhere: the three arrays no longer describe one map.
    position = HEADER_SIZE + 12 * num_placed - 4
    raw[position:position + 4] = (int.from_bytes(raw[position:position + 4], "little") ^ 1).to_bytes(4, "little")
    (tmp_path / "v1.bin").write_bytes(bytes(raw))
    manifest = json.loads(manifest_path(tmp_path / "v1.bin").read_text())
    manifest["checksums"]["header_crc32"] = zlib.crc32(bytes(raw[:manifest["data_offset"]]))
    manifest_path(tmp_path / "v1.bin").write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="inconsistent"):
        open_table(tmp_path / "v1.bin")
