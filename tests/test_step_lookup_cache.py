"""StepLookup through the table's host cache: the service thread serves disk-tier rows the cache
holds, admits what it reads, reads what read-ahead brought from memory, and never yields a wrong
row while other threads evict and replace the entries it copies (runtime/native/disk_reads.c,
hostcache.c), with poisoned buffers and a cache far smaller than one step."""
from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support import table_copies  # noqa: E402
from support.bf16_bits import bits, expected_bits  # noqa: E402
from support.step_calls import poison, serve, token_ids  # noqa: E402

from ple_prep.core.errors import BadInput  # noqa: E402
from ple_prep.runtime import hostcache, open_table  # noqa: E402
from ple_prep.runtime.device import steps  # noqa: E402

pytestmark = pytest.mark.skipif(steps._native is None, reason="needs the compiled helper")
TIERS = ("rows_resident", "rows_page_cache", "rows_host_cache", "rows_disk")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, converted_table, fp8_checkpoint):
    """The source table, mapped (its values are the expected ones), and its spec."""
    made = converted_table(fp8_checkpoint, tmp_path_factory.mktemp("steps-cache") / "t.bin",
                           placed=table_copies.hot_text_first)
    with open_table(made.path, read_path="mapped") as opened:
        opened.spec = made.spec
        yield opened


@pytest.fixture
def cold_copy(reference, tmp_path):
    """A copy of the table out of the page cache (another file: the reference's pages do not count)."""
    return table_copies.cold_copy(reference.path, tmp_path)


def open_direct(path, host_cache_bytes: int):
    try:
        return open_table(path, read_path="direct", host_cache_bytes=host_cache_bytes)
    except BadInput as error:
        pytest.skip(str(error))


def serve_poisoned(lookup, ids: np.ndarray) -> torch.Tensor:
    """A step with every buffer it rewrites poisoned first."""
    poison(lookup)
    return serve(lookup, ids)





@pytest.mark.parametrize("device", DEVICES)
def test_rows_read_once_are_served_from_the_host_cache_on_the_next_step(reference, cold_copy, device):
    with open_direct(cold_copy, 4 << 20) as table:
        lookup = steps.StepLookup(table, device=device, resident_bytes=500 * table.row_bytes, max_ids=300 * 16)
        try:
            ids = token_ids(reference, 300, 1)
            assert np.array_equal(bits(serve_poisoned(lookup, ids)), expected_bits(reference, ids))
            first = lookup.stats()
            assert first["rows_disk"] > 0 and first["rows_host_cache"] < first["rows_disk"]
            assert first["bytes_read"] == first["pages_read"] * max(4096, table.page_size)
            assert np.array_equal(bits(serve_poisoned(lookup, ids)), expected_bits(reference, ids))
            lookup.check()
            second = lookup.stats()
            window = {key: second[key] - first[key] for key in second}
            # Every disk-tier position of the re-read step from the cache: nothing read.
            assert window["rows_disk"] == 0 and window["pages_read"] == 0
            assert window["rows_host_cache"] == first["rows_disk"] + first["rows_host_cache"]
            assert sum(second[tier] for tier in TIERS) == second["ids"]
            assert table.host_cache.cache.hits >= window["rows_host_cache"]
        finally:
            lookup.close()


@pytest.mark.parametrize("device", DEVICES)
def test_read_ahead_fills_the_cache_the_step_service_reads(reference, cold_copy, device):
    with open_direct(cold_copy, 4 << 20) as table:
        lookup = steps.StepLookup(table, device=device, resident_bytes=500 * table.row_bytes, max_ids=200 * 16)
        try:
            chunks = [token_ids(reference, 200, seed) for seed in (11, 12, 13)]
            job = table.read_ahead([chunk.reshape(-1) for chunk in chunks], skip_slots=lookup.num_resident)
            assert job.wait(30) and job.error is None and job.rows_read > 0
            for chunk in chunks:
                assert np.array_equal(bits(serve_poisoned(lookup, chunk)), expected_bits(reference, chunk))
            lookup.check()
            stats = lookup.stats()
            assert stats["rows_disk"] == 0 and stats["pages_read"] == 0
            assert stats["rows_host_cache"] == stats["ids"] - stats["rows_resident"] > 0
            assert 0 < stats["rows_read_ahead"] <= stats["rows_host_cache"]
            assert table.host_cache.cache.pinned == 0  # every row read ahead was taken by a step
        finally:
            lookup.close()


def test_a_cache_far_smaller_than_a_step_evicted_by_other_threads_never_yields_wrong_rows(reference, cold_copy):
    """Three sets of the cache against 300-token steps, while gathers, admissions and a read-ahead
    on other threads evict and replace the entries the service thread copies out: every step exact."""
    budget = 3 * (reference.row_bytes + 8) * hostcache.WAYS + 3
    errors: list = []
    with open_direct(cold_copy, budget) as table:
        assert table.host_cache.cache.entries == 3 * hostcache.WAYS
        lookup = steps.StepLookup(table, device="cpu", resident_bytes=200 * table.row_bytes, max_ids=300 * 16)
        stop = threading.Event()

        def gather(seed: int) -> None:
            step = 0
            while not stop.is_set():
                ids = token_ids(reference, 100, seed * 1000 + step).reshape(-1)
                step += 1
                out = np.full((len(ids), table.row_bytes), 0xA5, dtype=np.uint8)
                table.gather(ids, out=out)
                if not np.array_equal(out, reference.gather(ids)):
                    errors.append(seed)

        def replace() -> None:
            """Admissions in long compiled loops (the GIL released): entries change all the time."""
            cache = table.host_cache.cache
            slots = np.arange(table.num_rows, dtype=np.int64)
            rows = reference.gather_slots(slots)
            rng = np.random.default_rng(3)
            while not stop.is_set():
                order = rng.permutation(len(slots))
                cache.admit(slots[order], rows[order])

        threads = [threading.Thread(target=gather, args=(seed,)) for seed in (1, 2)]
        threads.append(threading.Thread(target=replace))
        try:
            job = table.read_ahead([token_ids(reference, 300, 900 + k).reshape(-1) for k in range(8)])
            for thread in threads:
                thread.start()
            for step in range(60):
                ids = token_ids(reference, 300 if step % 3 else 1, step % 7)  # repeats: hits in a tiny cache
                if not np.array_equal(bits(serve_poisoned(lookup, ids)), expected_bits(reference, ids)):
                    errors.append(f"step {step}")
            lookup.check()
            stats = lookup.stats()
            assert stats["rows_host_cache"] > 0 and stats["rows_disk"] > 0
            assert sum(stats[tier] for tier in TIERS) == stats["ids"]
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            job.cancel()
            job.wait(10)
            lookup.close()
    assert errors == []


def test_a_step_lookup_on_a_table_without_a_host_cache_reads_every_cold_row(reference, cold_copy):
    with open_direct(cold_copy, 0) as table:
        lookup = steps.StepLookup(table, device="cpu", resident_bytes=0, max_ids=50 * 16)
        try:
            assert lookup.host_cache is None
            ids = token_ids(reference, 50, 3)
            for _ in range(2):
                assert np.array_equal(bits(serve_poisoned(lookup, ids)), expected_bits(reference, ids))
            stats = lookup.stats()
            assert stats["rows_host_cache"] == 0 and stats["rows_disk"] == stats["ids"]
        finally:
            lookup.close()
