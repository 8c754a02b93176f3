"""The host cache in front of the disk tier: source bytes always, within its budget, whatever evicts."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ple_prep.core.errors import BadInput
from ple_prep.runtime import hostcache, open_table
from ple_prep.runtime.hostcache import HostCache, default_budget

POISON = 0xA5


@pytest.fixture(params=["compiled", "numpy"])
def cache_loops(request, monkeypatch):
    """runtime/native/hostcache.c, or the numpy fallback of a machine built without a compiler."""
    if request.param == "numpy":
        monkeypatch.setattr(hostcache, "_native", None)
    elif hostcache._native is None:
        pytest.skip("the host cache's compiled helper is not built here")
    return request.param


@pytest.fixture(scope="module")
def ordered(converted_table, fp8_checkpoint, tmp_path_factory):
    """An access-ordered FP8 table (slots differ from row ids) and its source rows."""
    placed = lambda rows, spec: np.random.default_rng(5).permutation(rows)[:3000]  # noqa: E731
    return converted_table(fp8_checkpoint, tmp_path_factory.mktemp("cache") / "t.bin", placed=placed,
                           with_rows=True)


def request_ids(num_rows: int, count: int, seed: int) -> np.ndarray:
    """Ids with repeats and neighbours, like a chunk of text."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_rows, count)
    repeated = rng.random(count) < 0.3
    ids[repeated] = rng.choice(rng.integers(0, num_rows, 20), int(repeated.sum()))
    return ids


def poisoned(count: int, row_bytes: int) -> np.ndarray:
    return np.full((count, row_bytes), POISON, dtype=np.uint8)


class Header:
    """The header fields a HostCache reads."""

    def __init__(self, row_bytes: int, num_rows: int = 1 << 40):
        self.row_bytes = row_bytes
        self.num_rows = num_rows


def test_budget_bounds_rows_words_and_hands():
    for budget in (0, 100, 10_000, 1 << 20, 12_345_678):
        cache = HostCache(Header(160), budget)
        assert cache.bytes <= budget
        assert cache.entries == cache.sets * cache.ways
    assert not HostCache(Header(160), 1000).enabled  # less than one set
    with pytest.raises(ValueError):
        HostCache(Header(160), -1)


def test_default_budget_is_bounded_by_the_table_and_the_host():
    assert default_budget(10 << 20) == 10 << 20
    assert default_budget(1 << 40) <= hostcache.DEFAULT_HOST_CACHE_BYTES


def test_lookup_returns_admitted_rows_and_misses_the_others(cache_loops):
    rng = np.random.default_rng(1)
    cache = HostCache(Header(24), 64 * (24 + 8) * hostcache.WAYS + 64)
    stored = {}
    for _ in range(30):
        slots = rng.integers(0, 5000, 300)
        out = poisoned(len(slots), 24)
        missed = cache.lookup(slots, out)
        hit = np.setdiff1d(np.arange(len(slots)), missed)
        for index in hit:  # every row copied is the row admitted for that slot
            assert bytes(out[index]) == stored[int(slots[index])]
        assert (out[missed] == POISON).all()
        rows = rng.integers(0, 256, (len(missed), 24), dtype=np.uint8)
        distinct, first = np.unique(slots[missed], return_index=True)
        rows = rows[first]
        cache.admit(distinct, rows)
        for slot, row in zip(distinct.tolist(), rows):
            stored[slot] = bytes(row)
    assert cache.hits and cache.misses


def test_a_slot_outside_the_table_is_refused_before_any_row_is_copied(cache_loops, ordered):
    """slot + 1 is what an entry holding that slot stores, and 0 an empty entry's word: -1 matched both."""
    cache = HostCache(Header(8, num_rows=200), 1 * 16 * hostcache.WAYS + 1)
    cache.admit(np.arange(100, 108), np.ones((8, 8), dtype=np.uint8))
    for slot in (-1, 200):
        out = poisoned(2, 8)
        with pytest.raises(IndexError, match=f"slot {slot} is outside the table's 200 slots"):
            cache.lookup(np.array([100, slot]), out)
        assert (out == POISON).all() and cache.hits == 0
    cache.clear()
    with pytest.raises(IndexError, match="slot -1 is outside"):
        cache.lookup(np.array([-1, 100]), poisoned(2, 8))
    assert cache.lookup(np.array([199, 100]), poisoned(2, 8)).tolist() == [0, 1]
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=4 << 20) as table:
        with pytest.raises(IndexError, match="slot -1 is outside"):
            table.host_cache.gather_slots(np.array([-1]))


def test_each_read_ahead_chunk_is_refused_as_a_request_is_and_a_closed_table_says_so(ordered):
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=4 << 20, max_request_rows=1000) as table:
        with pytest.raises(ValueError, match="1000"):
            table.read_ahead([np.zeros(10, dtype=np.int64), np.zeros(2000, dtype=np.int64)])
        with pytest.raises(TypeError, match="integers"):
            table.read_ahead([np.zeros(10, dtype=np.float32)])
        table.read_ahead([np.zeros(1000, dtype=np.int64)]).wait(30)
    for call in (lambda: table.gather(np.arange(4)), lambda: table.read_ahead([np.arange(4)])):
        with pytest.raises(ValueError, match="the table is closed"):
            call()


def test_compiled_and_numpy_loops_agree(monkeypatch):
    if hostcache._native is None:
        pytest.skip("the host cache's compiled helper is not built here")
    rng = np.random.default_rng(2)
    script = []
    for step in range(40):
        slots = rng.integers(0, 3000, 200)
        script.append((slots, rng.integers(0, 256, (200, 16), dtype=np.uint8), step % 5 == 0))
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(hostcache, "_native", None)
        cache = HostCache(Header(16), 40 * 24 * hostcache.WAYS + 40)
        trail = []
        for slots, rows, pin in script:
            out = poisoned(len(slots), 16)
            missed = cache.lookup(slots, out)
            cache.admit(slots[missed], rows[missed], pin=pin)
            trail.append((missed.tolist(), out.tobytes(), cache.probe(slots).tolist(), cache.pinned, cache.dropped))
        results.append((trail, cache._words.tobytes(), cache._data.tobytes(), cache._hands.tobytes()))
    assert results[0] == results[1]


def test_pinned_rows_are_not_evicted_until_looked_up(cache_loops):
    cache = HostCache(Header(8), 4 * 16 * hostcache.WAYS + 4)
    pinned = np.arange(0, 16)
    cache.admit(pinned, np.repeat(pinned[:, None], 8, axis=1).astype(np.uint8), pin=True)
    held = cache.pinned
    assert held > 0
    for base in range(100, 2000, 50):  # a flood of other rows
        others = np.arange(base, base + 50)
        cache.admit(others, np.zeros((50, 8), dtype=np.uint8))
    out = poisoned(len(pinned), 8)
    missed = cache.lookup(pinned, out)
    kept = np.setdiff1d(np.arange(len(pinned)), missed)
    assert len(kept) == held  # every pinned row survived
    assert (out[kept] == pinned[kept, None]).all()
    assert cache.pinned == 0 and cache.read_ahead_hits == held


def test_table_gathers_source_rows_through_a_cache_far_smaller_than_a_request(ordered, cache_loops):
    # Room for ~2 sets of rows: every request evicts most of what the last one admitted.
    budget = 2 * (ordered.manifest["row_bytes"] + 8) * hostcache.WAYS + 2
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=budget) as table:
        assert table.host_cache.cache.entries == 2 * hostcache.WAYS
        for seed in range(6):
            ids = request_ids(table.num_rows, 700, seed)
            out = poisoned(len(ids), table.row_bytes)
            table.gather(ids, out=out)
            assert np.array_equal(out, ordered.rows[ids])
            assert np.array_equal(table.gather(ids), ordered.rows[ids])


def test_rows_read_twice_come_from_the_cache(ordered, cache_loops):
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=4 << 20) as table:
        tier = table.host_cache
        ids = request_ids(table.num_rows, 2000, 7)
        first = table.gather(ids)
        read = tier.rows_read
        assert read == len(np.unique(ids))  # distinct rows only... each row once
        again = table.gather(ids, out=poisoned(len(ids), table.row_bytes))
        assert tier.rows_read == read  # nothing read again
        assert np.array_equal(first, again) and np.array_equal(again, ordered.rows[ids])
        assert tier.pages_read >= 1


def test_table_lookup_merges_cached_disk_rows_with_the_resident_tier(ordered):
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=1 << 20) as table:
        table.resident(200 * table.row_bytes)
        ids = request_ids(table.num_rows, 500, 9)
        for _ in range(2):
            out = poisoned(len(ids), table.row_bytes)
            table.lookup(ids, out=out)
            assert np.array_equal(out, ordered.rows[ids])


def test_the_default_read_path_has_a_cache_and_mapped_has_none(ordered):
    with open_table(ordered.path, read_path="mapped") as table:
        assert table.host_cache is None
    with open_table(ordered.path, host_cache_bytes=0) as table:
        assert table.host_cache is None
    with pytest.raises(ValueError, match="host_cache_bytes"):
        open_table(ordered.path, host_cache_bytes=-1)
    with open_table(ordered.path) as table:
        if table.read_path == "direct":
            data = table.header.num_pages * table.header.page_size
            assert table.host_cache.cache.budget_bytes == default_budget(data)


def test_read_ahead_brings_a_requests_chunks_before_they_are_gathered(ordered, cache_loops):
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=4 << 20) as table:
        tier = table.host_cache
        chunks = [request_ids(table.num_rows, 400, seed) for seed in range(20, 24)]
        job = table.read_ahead(chunks)
        assert job.wait(30) and job.error is None and job.chunks_done == len(chunks)
        assert job.rows_read == len(np.unique(np.concatenate([table.slot_of(c) for c in chunks])))
        demand = tier.rows_read
        for chunk in chunks:
            out = poisoned(len(chunk), table.row_bytes)
            table.gather(chunk, out=out)
            assert np.array_equal(out, ordered.rows[chunk])
        assert tier.rows_read == demand  # every row was there already
        assert tier.cache.pinned == 0 and tier.cache.read_ahead_hits == job.rows_read
        stats = tier.stats()
        assert stats["read_ahead_rows_read"] == job.rows_read and stats["disk_rows_read"] == demand
        assert 0 < stats["read_ahead_coverage"] <= 1


def test_read_ahead_skips_the_resident_slots(ordered):
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=4 << 20) as table:
        ids = request_ids(table.num_rows, 600, 30)
        job = table.read_ahead([ids], skip_slots=1000)
        assert job.wait(30)
        slots = np.unique(table.slot_of(ids))
        assert job.rows_read == int((slots >= 1000).sum())


def test_read_ahead_pins_at_most_its_share_and_cancel_releases_them(ordered, cache_loops):
    from ple_prep.runtime import readahead

    budget = 40 * (ordered.manifest["row_bytes"] + 8) * hostcache.WAYS + 40
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=budget) as table:
        cache = table.host_cache.cache
        chunks = [np.arange(start, start + 100) for start in range(0, 3000, 100)]
        job = table.read_ahead(chunks)
        job.wait(0.5)
        assert cache.pinned <= cache.entries * readahead.PIN_FRACTION + readahead.BATCH_ROWS
        assert not job.done  # it waits for lookups to take what it pinned
        job.cancel()
        assert job.wait(10)
        assert cache.pinned == 0


def test_eviction_racing_copies_never_yields_wrong_rows(ordered, cache_loops):
    """Gathers on threads and a read-ahead over a cache of a few sets: each evicts what the others
    copy out; every row returned must still be its source row."""
    budget = 3 * (ordered.manifest["row_bytes"] + 8) * hostcache.WAYS + 3
    errors = []
    with open_table(ordered.path, read_path="mapped", host_cache_bytes=budget) as table:
        def gather(seed: int) -> None:
            try:
                for step in range(25):
                    ids = request_ids(table.num_rows, 300, seed * 100 + step)
                    out = poisoned(len(ids), table.row_bytes)
                    table.gather(ids, out=out)
                    if not np.array_equal(out, ordered.rows[ids]):
                        errors.append(seed)
            except Exception as error:  # noqa: BLE001 (reported by the assertion below)
                errors.append(error)

        job = table.read_ahead([request_ids(table.num_rows, 500, 900 + k) for k in range(10)])
        threads = [threading.Thread(target=gather, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        job.cancel()
        job.wait(10)
    assert errors == []


def test_the_torch_source_counts_rows_its_tables_host_cache_held(ordered):
    torch = pytest.importorskip("torch")
    from support.bf16_bits import bits, expected_bits

    from ple_prep.runtime.device import EmbeddingSource
    from ple_prep.tools.benchmark import evict

    evict(ordered.path)  # the direct path keeps it so: every request is cold, through the host cache
    try:
        table = open_table(ordered.path, read_path="direct", host_cache_bytes=4 << 20)
    except BadInput as exc:
        pytest.skip(str(exc))
    with table:
        source = EmbeddingSource(table, device="cpu", resident_bytes=500 * table.row_bytes, max_ids=200 * 16)
        ids = request_ids(table.num_rows, 200 * 16, 40).reshape(200, 16)
        slots = table.slot_of(ids.reshape(-1))
        distinct = len(np.unique(slots[slots >= source.num_resident]))
        for _ in range(2):
            values = source(ids)
            assert np.array_equal(bits(values), expected_bits(table, ids))
        stats = source.stats()
        assert stats.rows_read == distinct and stats.rows_host_cache == distinct
        job = source.read_ahead([ids[:100], ids[100:]])
        assert job.wait(30) and job.rows_read == 0 and job.rows_found >= distinct  # all held already
        assert torch.equal(source(ids[:100]), values[:100])
        source.close()
