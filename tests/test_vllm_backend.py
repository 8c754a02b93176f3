"""The vLLM plugin's core without vLLM: table checks, the default budget and the split lookup (CPU)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.bf16_bits import bits, expected_bits  # noqa: E402
from support.garbage_collections import collections_set_off  # noqa: E402
from support.step_calls import captured_step  # noqa: E402

from ple_prep.integrations.vllm.backend import (  # noqa: E402
    PrefetchedRows,
    TableMismatch,
    check_hash,
    check_layer,
    check_scale,
    default_resident_bytes,
)
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.fixtures import FIXTURE_ROWS  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_start_finish_equals_the_tables_values_across_tiers(fp8_table, device):
    """Ids on the device, as vLLM gives them: chunks and decode steps of one and two tokens, each
    size more than once (on a GPU, from the second of a size a step is finished in one call of the
    compiled helper), the values' shape following the count."""
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device=device, resident_bytes=4000 * 160, max_tokens=64, heads=16)
        ids = np.random.default_rng(1).integers(0, FIXTURE_ROWS, (40, 16))
        for request in (ids, ids[:1], ids[1:2], ids[2:4], ids[4:5], ids[6:8], ids[5:], ids[8:9]):
            rows.start(torch.from_numpy(request).to(device))
            values = rows.finish()
            assert values.shape == (len(request), 2560)
            np.testing.assert_array_equal(bits(values), expected_bits(table, request))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 64])
def test_a_steps_calls_set_off_no_garbage_collection_of_their_own(fp8_table, device, tokens):
    """vLLM calls start, finish and check at every step. A collection that an object made in them sets
    off runs inside the call (from Python 3.12), so the plugin's own part makes none: its steps set off
    no more collections than its lookup's calls alone."""
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device=device, resident_bytes=4000 * 160, max_tokens=64, heads=16)
        ids = np.random.default_rng(2).integers(0, FIXTURE_ROWS, (tokens, 16))
        as_ids = torch.from_numpy(ids).to(device)
        served = []

        def step(lookup) -> None:
            lookup.start(as_ids)
            served.append(lookup.finish())
            lookup.check()

        try:
            if not rows.graph_safe:
                pytest.skip("needs the compiled helper")
            step(rows)  # the first step of a size captures its graph
            # The least of three counts: now and then a round sets off one more, on either side.
            steps = min(collections_set_off(lambda: step(rows)) for _ in range(3))
            assert steps == min(collections_set_off(lambda: step(rows.source)) for _ in range(3))
            np.testing.assert_array_equal(bits(served[-1]), expected_bits(table, ids))
        finally:
            rows.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_serves_its_rows_and_zeros_for_the_others(fp8_table, fp8_rank_tables, device):
    ids = np.random.default_rng(2).integers(0, FIXTURE_ROWS, (30, 16))
    with open_table(fp8_table) as whole:
        want = expected_bits(whole, ids).reshape(30, 16, 160)
    total = np.zeros((30, 16, 160), dtype=np.int64)
    for rank in range(2):
        with open_table(fp8_rank_tables / f"ple.tp{rank}of2.bin") as table:
            rows = PrefetchedRows(table, device=device, resident_bytes=0, max_tokens=32, heads=16)
            rows.start(torch.from_numpy(ids).to(device))
            got = bits(rows.finish()).reshape(30, 16, 160)
            first, stop = table.row_range
            owned = (ids >= first) & (ids < stop)
            np.testing.assert_array_equal(got[owned], want[owned])
            assert not got[~owned].any()
            total += got
    np.testing.assert_array_equal(total, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("outside", [-1, FIXTURE_ROWS + 5])
def test_an_id_outside_the_whole_table_fails_the_step_on_the_rank_at_that_end(fp8_rank_tables, outside, device):
    """Rank 0 of 2 owns every id below its block's end, rank 1 every id from its block's start: an id
    below 0 fails rank 0's step and one past the table rank 1's, naming the id (on a GPU at the check
    after the step), and the other rank serves its rows of the step (zeros for the id it does not own)."""
    ids = np.random.default_rng(3).integers(0, FIXTURE_ROWS, (2, 16))
    ids[1, 5] = outside
    failing = 0 if outside < 0 else 1
    for rank in range(2):
        with open_table(fp8_rank_tables / f"ple.tp{rank}of2.bin") as table:
            rows = PrefetchedRows(table, device=device, resident_bytes=0, max_tokens=4, heads=16)
            rows.start(torch.from_numpy(ids).to(device))
            if rank == failing:
                with pytest.raises(IndexError, match=f"row id {outside} is outside"):
                    rows.finish()
                    torch.cuda.synchronize()
                    rows.check()
            else:
                got = bits(rows.finish()).reshape(2, 16, 160)
                first, stop = table.row_range
                owned = (ids >= first) & (ids < stop)
                np.testing.assert_array_equal(got[owned], expected_bits(table, ids[owned]).reshape(-1, 160))
                assert not got[~owned].any()
            rows.close()


def test_an_error_of_the_started_lookup_surfaces_at_finish_and_at_every_later_call(fp8_table):
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16)
        rows.start(torch.full((1, 16), FIXTURE_ROWS))
        with pytest.raises(IndexError, match=f"row id {FIXTURE_ROWS} is outside"):
            rows.finish()
        with pytest.raises(RuntimeError, match="finished without a start"):
            rows.finish()
        # vLLM's engine stops at the first: no later step may pass for served.
        for _ in range(2):
            with pytest.raises(IndexError, match=f"row id {FIXTURE_ROWS} is outside"):
                rows.start(torch.zeros((1, 16), dtype=torch.int64))
            with pytest.raises(IndexError, match=f"row id {FIXTURE_ROWS} is outside"):
                rows.check()
        assert isinstance(rows.pending_error(), IndexError)


def test_a_failed_steps_error_taken_by_one_thread_is_raised_to_another(fp8_table):
    """The worker's thread takes a failed step's error from the lookup while vLLM's output thread
    checks the step's output: that check raises too, never passes in between."""
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16)
        if not rows.graph_safe:
            pytest.skip("needs the compiled helper")
        taken = threading.Event()

        def taking_slowly():  # the lookup hands its error out once, then builds it
            taken.set()
            time.sleep(0.2)
            raise OSError(5, "Input/output error")

        rows.source.check = taking_slowly
        worker = threading.Thread(target=lambda: pytest.raises(OSError, rows.check))
        worker.start()
        taken.wait(10)
        rows.source.check = lambda: None  # taken: the lookup has nothing left to hand out
        with pytest.raises(OSError, match="Input/output error"):
            rows.check()
        worker.join()
        rows.close()


def test_too_many_tokens_are_refused_at_start(fp8_table):
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16)
        with pytest.raises(ValueError, match="5 tokens exceed the 4"):
            rows.start(torch.zeros((5, 16), dtype=torch.int64))


def test_an_abandoned_start_is_dropped_by_the_next(fp8_table):
    with open_table(fp8_table) as table:
        rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16)
        rows.start(torch.full((1, 16), FIXTURE_ROWS))  # its forward pass failed before the PLE layer
        ids = np.arange(32).reshape(2, 16)
        rows.start(torch.from_numpy(ids))
        values = rows.finish()
        assert values.shape == (2, 2560)
        np.testing.assert_array_equal(bits(values), expected_bits(table, ids))


def test_check_layer_refuses_encoding_geometry_and_rank(fp8_table, fp8_rank_tables):
    layer = {"method": "fp8", "total_rows": FIXTURE_ROWS, "values_per_row": 160, "owned": (0, FIXTURE_ROWS),
             "rank": 0, "size": 1}
    with open_table(fp8_table) as table:
        check_layer(table, **layer)
        with pytest.raises(TableMismatch, match="holds fp8_e4m3 rows, but the checkpoint's PLE table is nvfp4"):
            check_layer(table, **layer | {"method": "nvfp4"})
        with pytest.raises(TableMismatch, match=f"{FIXTURE_ROWS} rows of 160 values; the model's has 17024 rows"):
            check_layer(table, **layer | {"total_rows": 17024})
        whole, half = FIXTURE_ROWS, FIXTURE_ROWS // 2
        with pytest.raises(TableMismatch, match=rf"holds the whole table \[0, {whole}\]; tensor-parallel rank 1 "
                                                rf"of 2 serves rows \[{half}, {whole}\]: convert with --tp-size 2"):
            check_layer(table, **layer | {"owned": (half, whole), "rank": 1, "size": 2})
    with open_table(fp8_rank_tables / "ple.tp0of2.bin") as table:
        check_layer(table, **layer | {"owned": (0, 8448), "rank": 0, "size": 2})
        with pytest.raises(TableMismatch, match="holds rank 0 of 2's rows"):
            check_layer(table, **layer | {"owned": (half, whole), "rank": 1, "size": 2})


def test_check_hash_and_scale(fp8_table):
    with open_table(fp8_table) as table:
        ngram = table.manifest["ngram"]
        constants = {"multipliers": ngram["multipliers"], "head_offsets": ngram["head_offsets"],
                     "head_sizes": ngram["head_sizes"]}
        check_hash(table, **constants)
        with pytest.raises(TableMismatch, match=r"\(multipliers, head_sizes differ\)"):
            check_hash(table, **constants | {"multipliers": [1, 3, 5],
                                             "head_sizes": [s + 2 for s in ngram["head_sizes"]]})
        check_scale(table, float(torch.tensor(table.scale, dtype=torch.float32)))
        check_scale(table, None)
        with pytest.raises(TableMismatch, match="converted from a checkpoint with scale"):
            check_scale(table, table.scale * 2)


def test_default_budget_is_the_tables_5_percent_hint(fp8_table):
    with open_table(fp8_table) as table:
        assert default_resident_bytes(table) == 0  # a table converted without a profile has no hints
        table.manifest["residency"] = [{"budget": "1%", "rows": 128}, {"budget": "5%", "rows": 768}]
        assert default_resident_bytes(table) == 768 * 160


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_lookup_in_one_cuda_graph_serves_each_step_and_fails_one_with_an_id_outside_the_table(
        fp8_table, fp8_rank_tables, rank):
    """vLLM's FULL graph holds start and finish: replayed with new ids into a poisoned output, a rank
    serves its rows and zeros for the others' bit for bit; a step with an id outside the table at
    this rank's end gives NaN where the rank owns rows, zeros elsewhere, and its error at the check."""
    outside = -1 if rank == 0 else FIXTURE_ROWS + 5
    rng = np.random.default_rng(4 + rank)
    with open_table(fp8_rank_tables / f"ple.tp{rank}of2.bin") as table, open_table(fp8_table) as whole:
        rows = PrefetchedRows(table, device="cuda", resident_bytes=500 * table.row_bytes, max_tokens=8, heads=16)
        try:
            if not rows.graph_safe:
                pytest.skip("FULL graphs need the compiled helper")
            ids_buffer = torch.zeros((4, 16), dtype=torch.int64, device="cuda")
            consumer = torch.empty((4, 2560), dtype=torch.bfloat16, device="cuda")
            ids_buffer.copy_(torch.from_numpy(rng.integers(0, FIXTURE_ROWS, (4, 16))))
            rows.start(ids_buffer)  # warm-up outside the capture
            rows.finish()
            graph = captured_step(rows, ids_buffer, consumer)
            first, stop = table.row_range
            for step in range(6):
                ids = rng.integers(0, FIXTURE_ROWS, (4, 16))
                if step == 5:
                    ids[2, 7] = outside
                ids_buffer.copy_(torch.from_numpy(ids))
                consumer.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                owned = (ids >= first) & (ids < stop)
                if step < 5:
                    rows.check()
                    got = bits(consumer).reshape(4, 16, 160)
                    np.testing.assert_array_equal(got[owned], expected_bits(whole, ids[owned]).reshape(-1, 160))
                    assert not got[~owned].any()
                else:
                    owned[2, 7] = True
                    nan = torch.isnan(consumer).cpu().numpy().reshape(4, 16, 160)
                    assert nan[owned].all() and not bits(consumer).reshape(4, 16, 160)[~owned].any()
                    with pytest.raises(IndexError, match=f"row id {outside} is outside"):
                        rows.check()
        finally:
            rows.close()
