"""The O_DIRECT disk tier: source bytes in request order, nothing left cached, clear fallbacks."""
from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest
from support.file_systems import skip_unless_on_a_block_file_system

from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.format.layout import TableLayout
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder
from ple_prep.offline.writer import WriteOptions, convert
from ple_prep.runtime import direct, open_table
from ple_prep.runtime.gather import Gatherer
from ple_prep.tools.benchmark import cached_fraction, evict

POISON = 0xA5


@pytest.fixture(scope="module")
def ordered_table(fp8_checkpoint, tmp_path_factory):
    """An access-ordered table (slots differ from row ids); skips where O_DIRECT is refused."""
    path = tmp_path_factory.mktemp("direct") / "t.bin"
    with open_source(fp8_checkpoint) as source:
        placed = np.random.default_rng(3).permutation(source.num_rows)[:2000]
        convert(source, path, layout=TableLayout(RowOrder.from_placed(placed, source.num_rows)))
    try:
        with open_table(path, read_path="direct"):
            pass
    except BadInput as exc:
        pytest.skip(str(exc))
    return path


def request_ids(num_rows: int, count: int, seed: int) -> np.ndarray:
    """Ids with repeats (a few hot rows) and neighbours, like a chunk of text."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_rows, count)
    repeated = rng.random(count) < 0.3
    ids[repeated] = rng.choice(rng.integers(0, num_rows, 20), int(repeated.sum()))
    ids[1::7] = np.minimum(ids[0:-1:7] + 1, num_rows - 1)
    return ids


@pytest.mark.parametrize("read_path", ["direct", "pread"])
@pytest.mark.parametrize("queue_depth", [1, 3, 64])
def test_direct_gather_writes_every_position_with_its_source_row(ordered_table, source_rows, queue_depth,
                                                                 read_path, monkeypatch):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: False)
    with open_table(ordered_table, read_path=read_path, queue_depth=queue_depth) as table:
        assert table.read_path == read_path
        out = np.full((3000, table.row_bytes), POISON, dtype=np.uint8)
        for seed, count in ((0, 3000), (1, 3000), (2, 1), (3, 64), (4, 20)):
            ids = request_ids(table.num_rows, count, seed)
            got = table.gather(ids, out=out[:count])
            assert got is out[:count].base or np.shares_memory(got, out)
            assert np.array_equal(out[:count], source_rows[ids])
            assert np.array_equal(table.gather(ids), source_rows[ids])
        assert table.gather(np.zeros(0, dtype=np.int64)).shape == (0, table.row_bytes)


def test_direct_values_equal_the_mapped_paths(ordered_table):
    with open_table(ordered_table, read_path="mapped") as mapped, \
            open_table(ordered_table, read_path="direct") as direct_table:
        ids = request_ids(mapped.num_rows, 4000, 9)
        evict(ordered_table)
        assert np.array_equal(direct_table.values(ids), mapped.values(ids))


@pytest.mark.parametrize("page_size", [512, 1024, 16384])
def test_direct_gather_with_other_page_sizes(fp8_checkpoint, source_rows, tmp_path, page_size, monkeypatch):
    """Pages smaller than the 4 KiB O_DIRECT block share a block; larger ones are one block each."""
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: False)
    with open_source(fp8_checkpoint) as source:
        convert(source, tmp_path / "t.bin", WriteOptions(page_size=page_size))
    try:
        table = open_table(tmp_path / "t.bin", read_path="direct", queue_depth=8)
    except BadInput as exc:
        pytest.skip(str(exc))
    with table:
        ids = request_ids(table.num_rows, 2000, 4)
        ids[-1] = table.num_rows - 1  # the last page, whose block may run past the file's end
        assert np.array_equal(table.gather(ids), source_rows[ids])


def test_direct_gather_leaves_nothing_in_the_page_cache(ordered_table, source_rows):
    evict(ordered_table)
    with open_table(ordered_table, read_path="direct") as table:
        # The header and the order map are read at open; the data region must stay uncached.
        before = cached_fraction(ordered_table)
        ids = np.arange(table.num_rows)
        assert np.array_equal(table.gather(ids), source_rows[ids])
        assert cached_fraction(ordered_table) == before
        assert not table._gatherer.cached(table.slot_of(ids))


def test_direct_gather_serves_a_cached_request_from_the_mapping(ordered_table, source_rows, monkeypatch):
    """A request whose pages are in the page cache is copied from memory, not read from the disk."""
    with open_table(ordered_table, read_path="mapped") as mapped:
        ids = request_ids(mapped.num_rows, 500, 2)
        mapped.gather(ids)  # through the page cache
    with open_table(ordered_table, read_path="direct") as table:
        monkeypatch.setattr(table._gatherer.direct, "gather_slots", None)
        assert np.array_equal(table.gather(ids), source_rows[ids])


def test_direct_read_of_a_file_that_shrank_raises(ordered_table, tmp_path, monkeypatch):
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: False)
    path = tmp_path / "t.bin"
    shutil.copyfile(ordered_table, path)
    shutil.copyfile(manifest_path(ordered_table), manifest_path(path))
    with open_table(path, read_path="direct") as table:
        os.truncate(path, table.header.data_offset + table.page_size)
        with pytest.raises(OSError, match="shrank"):
            table.gather(np.arange(table.num_rows))
        # The reader stays usable: the rows still in the file read back.
        slots = np.arange(table.rows_per_page)
        with open_table(ordered_table, read_path="mapped") as original:
            assert np.array_equal(table.gather_slots(slots), original.gather_slots(slots))


def test_refused_o_direct_falls_back_by_default_and_fails_clearly_when_asked_for(ordered_table, source_rows,
                                                                                monkeypatch):
    """tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT at open with EINVAL."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", refusing_open)
    with open_table(ordered_table) as table:
        # Not the mapping: a failing disk must raise, not fault (docs/RELIABILITY.md).
        assert table.read_path == "pread"
        assert "O_DIRECT unavailable" in table.read_path_note
        ids = request_ids(table.num_rows, 1000, 5)
        evict(ordered_table)
        assert np.array_equal(table.gather(ids), source_rows[ids])
    with pytest.raises(BadInput, match="read_path='pread'"):
        open_table(ordered_table, read_path="direct")
    with pytest.raises(ValueError, match="read_path must be one of"):
        open_table(ordered_table, read_path="uring")


def test_refused_native_aio_falls_back_to_pread(ordered_table, source_rows, monkeypatch):
    """fs.aio-max-nr used up by other processes, or a kernel without native AIO."""
    monkeypatch.setattr(direct, "_SYSCALL", None)
    with open_table(ordered_table) as table:
        assert table.read_path == "pread" and "no native AIO" in table.read_path_note
        ids = request_ids(table.num_rows, 3000, 6)
        evict(ordered_table)
        assert np.array_equal(table.gather(ids), source_rows[ids])


def test_direct_tables_share_one_aio_context_and_a_forked_child_makes_its_own(ordered_table, source_rows,
                                                                              monkeypatch):
    """Contexts count against the host-wide fs.aio-max-nr, so tables share the process's one."""
    monkeypatch.setattr(Gatherer, "cached", lambda self, slots: False)
    try:
        first, second = (open_table(ordered_table, read_path="direct") for _ in range(2))
    except BadInput as exc:  # fs.aio-max-nr used up by other processes on this host
        pytest.skip(str(exc))
    with first, second:
        assert first._gatherer.direct._context is second._gatherer.direct._context
        ids = request_ids(first.num_rows, 2000, 8)
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # the child inherits the tables but not the parent's AIO context
            try:
                os.write(writer, b"equal" if np.array_equal(second.gather(ids), source_rows[ids]) else b"differ")
            except BaseException as exc:
                os.write(writer, repr(exc).encode())
            finally:
                os._exit(0)
        os.close(writer)
        answer = os.read(reader, 4096).decode()
        os.waitpid(child, 0)
        os.close(reader)
        if "Resource temporarily unavailable" in answer:  # fs.aio-max-nr used up on this host
            pytest.skip(answer)
        assert answer == "equal"
        assert np.array_equal(first.gather(ids), source_rows[ids])


def test_the_default_path_reads_with_o_direct_on_a_block_file_system_however_fast_the_disk(ordered_table):
    """A fast disk (a virtual disk answering from its host's cache) can complete the probe's reads the
    moment io_submit returns, as FUSE does: on ext4, xfs, btrfs or f2fs AIO is asynchronous all the
    same, and the default stays O_DIRECT at every open."""
    skip_unless_on_a_block_file_system(ordered_table)
    paths = set()
    for _ in range(40):
        with open_table(ordered_table) as table:
            paths.add(table.read_path)
    assert paths == {"direct"}
