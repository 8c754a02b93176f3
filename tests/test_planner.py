"""Access-ordered layouts: rows stay reachable by global id, groups share pages, hints are honest."""
from __future__ import annotations

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.format.header import ORDER_BYTES_PER_PLACED
from ple_prep.format.order import lookup_index_bytes
from ple_prep.ngram import rows_of_mixed
from ple_prep.offline.planner import _hot_groups, _pack, max_placed_rows, plan_for_source, plan_order, residency_hints
from ple_prep.offline.profile import Profiler, profile_files
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table

EOS = 248044


def corpus_profile(spec, seed=0, requests=400):
    """Zipf-like token streams, so some n-grams are hot and most are rare."""
    rng = np.random.default_rng(seed)
    profiler = Profiler(spec)
    for _ in range(requests):
        length = int(rng.integers(5, 60))
        tokens = np.minimum(rng.zipf(1.3, size=length), 5000) + 100
        tokens[rng.random(length) < 0.05] = EOS
        profiler.add_request(tokens)
    return profiler.finish(model="zipf", tokenizer_sha256=None, inputs=[])


@pytest.fixture(scope="module")
def source_and_profile(fp8_checkpoint):
    with open_source(fp8_checkpoint) as source:
        yield source, corpus_profile(source.spec)


@pytest.mark.parametrize("variant", ["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def test_convert_profile_gather_and_values_by_global_id(variant, request, tmp_path):
    checkpoint = request.getfixturevalue(variant)
    with open_source(checkpoint) as source:
        profile = corpus_profile(source.spec)
        plan = plan_for_source(source, profile, page_size=4096, map_fraction=0.019)
        assert plan.order.num_placed > 0
        convert(source, tmp_path / "t.bin", layout=plan)
        reference = tmp_path / "ref.bin"
        convert(source, reference)
        expected = source.read_rows(0, source.num_rows)
    ids = np.random.default_rng(2).permutation(len(expected))
    with open_table(tmp_path / "t.bin") as table, open_table(reference) as plain:
        assert np.array_equal(table.gather(ids), expected[ids])
        assert np.array_equal(table.values(ids), plain.values(ids), equal_nan=True)
        slots = table.slot_of(ids)
        assert np.array_equal(np.sort(slots), np.arange(table.num_rows))
        assert np.array_equal(table.page_of(ids), slots // table.rows_per_page)
        placed = plan.order.slot_rows
        assert np.array_equal(table.slot_of(placed), np.arange(len(placed)))


def test_plan_places_hottest_first_and_groups_on_one_page(source_and_profile):
    source, profile = source_and_profile
    rows_per_page = 25
    plan = plan_order(profile, source.num_rows, rows_per_page, max_placed=source.num_rows)
    order = plan.order
    # Every seen row is placed (no cap); rows never seen follow in source order.
    seen, _ = profile.parts["train"].rows(profile.spec)
    assert np.array_equal(np.sort(order.slot_rows.astype(np.int64)), seen)
    unseen = np.setdiff1d(np.arange(source.num_rows), seen)
    assert np.array_equal(order.slot_of(unseen), len(seen) + np.arange(len(unseen)))
    # A group whose rows were all new at its turn (hotness order) sits on one page, except the
    # few cut to fill a page's end.
    pages_of_new_groups = []
    taken: set[int] = set()
    groups = [(int(count), order_n, int(key), rows)
              for order_n, (keys, counts) in profile.parts["train"].groups.items()
              for key, count, rows in zip(keys, counts, rows_of_mixed(keys, order_n, profile.spec))]
    for _, _, _, rows in sorted(groups, key=lambda g: (-g[0], g[1], g[2])):
        if not taken & set(rows.tolist()):
            pages_of_new_groups.append(len(set((order.slot_of(rows) // rows_per_page).tolist())))
        taken.update(rows.tolist())
    assert plan.groups_split < 0.15 * plan.groups_placed
    assert np.mean(np.array(pages_of_new_groups) == 1) > 0.9
    # The hottest group is in the first page.
    train = profile.parts["train"].groups[2]
    hottest = rows_of_mixed(train[0][[np.argmax(train[1])]], 2, profile.spec)[0]
    assert set((order.slot_of(hottest) // rows_per_page).tolist()) == {0}


def test_plan_real_geometry_puts_each_seen_ngram_on_one_page():
    """At the model's 320M rows collisions are rare: a seen n-gram's 8 rows share one page."""
    from ple_prep.ngram import NgramSpec
    from ple_prep.tools.fixtures import fixture_config

    spec = NgramSpec.from_config(fixture_config(base=20_000_000))
    profile = corpus_profile(spec, seed=4, requests=300)
    plan = plan_order(profile, spec.rows_stored, 25, max_placed=spec.rows_stored)
    one_page, counts, every_row = [], [], []
    for order_n, (keys, group_counts) in profile.parts["train"].groups.items():
        rows = rows_of_mixed(keys, order_n, spec)
        slots = plan.order.slot_of(rows.reshape(-1)).reshape(-1, 8)
        one_page.append(np.ptp(slots // 25, axis=1) == 0)
        counts.append(group_counts)
        every_row.append(rows.reshape(-1))
    one_page, counts = np.concatenate(one_page), np.concatenate(counts)
    # Only the coldest groups (seen once) are cut to fill the page ends 8-row groups leave.
    assert np.all(one_page[counts >= 2])
    assert np.mean(one_page) > 0.95
    assert plan.order.num_placed == len(np.unique(np.concatenate(every_row)))


def test_plan_respects_the_map_cap(source_and_profile):
    source, profile = source_and_profile
    limit = max_placed_rows(source.num_rows, source.row_bytes, 0.01)
    # The cap counts what a server holds for the map: its rank lines and each placed row's packed slot.
    budget = int(0.01 * source.num_rows * 160)
    assert lookup_index_bytes(source.num_rows, limit) <= budget < lookup_index_bytes(source.num_rows, limit + 1)
    plan = plan_order(profile, source.num_rows, 25, max_placed=limit)
    assert 0 < plan.order.num_placed <= limit
    # The slots packed in the bits they need: the server holds less than the file's 4 bytes a placed row.
    assert lookup_index_bytes(source.num_rows, limit) < ORDER_BYTES_PER_PLACED[2] * limit
    with pytest.raises(BadInput, match="below 2%"):
        max_placed_rows(source.num_rows, source.row_bytes, 0.05)


def test_plan_for_a_rank_slice_keeps_its_rows(source_and_profile):
    source, profile = source_and_profile
    half = source.num_rows // 2
    plan = plan_order(profile, half, 25, max_placed=half, first_row=half)
    seen, _ = profile.parts["train"].rows(profile.spec)
    assert np.array_equal(np.sort(plan.order.slot_rows.astype(np.int64)), seen[seen >= half] - half)


def test_pack_keeps_groups_whole_and_fills_pages():
    rng = np.random.default_rng(0)
    sizes = rng.choice([8, 7, 5, 3, 1], size=2000, p=[0.7, 0.1, 0.1, 0.05, 0.05]).tolist()
    groups, firsts, counts = _pack(np.array(sizes), 25)
    pieces = list(zip(groups.tolist(), firsts.tolist(), (firsts + counts).tolist()))
    placed = np.zeros(len(sizes), dtype=int)
    slot, pages = 0, {}
    for group, first, stop in pieces:
        assert first == placed[group]
        placed[group] = stop
        pages.setdefault(group, set()).update(range(slot // 25, (slot + stop - first - 1) // 25 + 1))
        slot += stop - first
    assert placed.tolist() == sizes
    whole = sum(len(p) == 1 for p in pages.values())
    assert whole >= 0.95 * len(sizes)
    # The hottest groups are placed first and whole.
    assert [p[0] for p in pieces[:3]] == [0, 1, 2]


@pytest.mark.parametrize("capacity", [25, 45, 300])
def test_pack_compiled_gives_the_pieces_of_the_python_loop(capacity, monkeypatch):
    from ple_prep.offline import planner

    if planner._native is None:
        pytest.skip("the compiled helper is not built")
    rng = np.random.default_rng(capacity)
    for case in range(30):
        count = int(rng.integers(0, 3000))
        # Group sizes as the planner makes them (up to 8 rows, some 0), now and then one larger than a page.
        sizes = rng.choice([8, 7, 6, 5, 3, 2, 1, 0], size=count, p=[0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
        if case % 3 == 0 and count:
            sizes[rng.integers(0, count)] = min(255, capacity + 5)
        spare = int(rng.choice([0, 3, 1000, 10 ** 6]))
        compiled = _pack(sizes, capacity, spare)
        monkeypatch.setattr(planner, "_native", None)
        python = _pack(sizes, capacity, spare)
        monkeypatch.undo()
        for got, expected in zip(compiled, python):
            assert np.array_equal(got.astype(np.int64), expected.astype(np.int64)), (case, count, spare)


def test_new_rows_compiled_match_the_numpy_steps(monkeypatch):
    from ple_prep.offline import planner

    if planner._native is None:
        pytest.skip("the compiled helper is not built")
    rng = np.random.default_rng(5)
    heads, num_rows = 8, 5000
    for case in range(20):
        groups = int(rng.integers(0, 4000))
        # Few rows for many groups: rows shared between groups and within one, some outside the slice.
        flat = rng.integers(-1, num_rows, size=groups * heads).astype(np.int64)
        outputs = []
        for native in (planner._native, None):
            monkeypatch.setattr(planner, "_native", native)
            taken = np.zeros(-(-num_rows // 64), dtype=np.uint64)
            new_rows = np.zeros(num_rows, dtype=np.uint32)
            per_group = np.zeros(groups, dtype=np.uint8)
            take = planner._take_new_rows if native is None else native.take_new_rows
            filled = 0
            for start in range(0, groups, 700):  # the bitmap carried from one step to the next
                chunk = flat[start * heads:(start + 700) * heads]
                filled = take(chunk, heads, taken, new_rows, filled, per_group[start:start + 700])
            outputs.append((new_rows[:filled].copy(), per_group.copy(), taken.copy()))
        monkeypatch.undo()
        for got, expected in zip(*outputs):
            assert np.array_equal(got, expected), case
        assert len(np.unique(outputs[0][0])) == len(outputs[0][0])


def test_new_rows_compiled_refuses_a_row_beyond_its_bitmap():
    from ple_prep.offline import planner

    if planner._native is None:
        pytest.skip("the compiled helper is not built")
    taken = np.zeros(1, dtype=np.uint64)  # rows 0-63
    with pytest.raises(ValueError, match="beyond the bitmap"):
        planner._native.take_new_rows(np.array([3, 64], dtype=np.int64), 2, taken, np.zeros(4, np.uint32), 0,
                                      np.zeros(1, np.uint8))


def test_residency_hints_measured_on_heldout_only(source_and_profile):
    source, profile = source_and_profile
    plan = plan_order(profile, source.num_rows, 25, max_placed=source.num_rows)
    hints = residency_hints(plan.order, profile, row_bytes=160, rows_per_page=25, page_size=4096)
    assert [h["budget"] for h in hints] == ["0.25 GiB", "0.5 GiB", "1 GiB", "2 GiB", "4 GiB", "8 GiB",
                                            "16 GiB", "1%", "2%", "5%", "10%", "20%"]
    rows, counts = profile.parts["heldout"].rows(profile.spec)
    slots = plan.order.slot_of(rows)
    for hint in hints:
        expected = counts[slots < hint["rows"]].sum() / counts.sum()
        assert hint["hit_fraction"] == pytest.approx(expected, abs=1e-6)
    ten = next(h for h in hints if h["budget"] == "10%")
    assert ten["rows"] == (source.num_rows * 160 // 10) // 4096 * 25
    fractions = [h["hit_fraction"] for h in hints[7:]]
    assert fractions == sorted(fractions) and fractions[0] > 0.01


def test_convert_places_the_heldout_parts_groups_and_hints_come_from_a_plan_without_them(source_and_profile):
    source, _ = source_and_profile
    profile = corpus_profile(source.spec, seed=1, requests=30)  # fewer rows than the cap
    layout = plan_for_source(source, profile, page_size=4096, map_fraction=0.019)
    train_rows, _ = profile.parts["train"].rows(profile.spec)
    heldout_rows, _ = profile.parts["heldout"].rows(profile.spec)
    seen = np.union1d(train_rows, heldout_rows)
    assert len(np.setdiff1d(heldout_rows, train_rows)) > 0
    assert len(seen) <= max_placed_rows(source.num_rows, source.row_bytes, 0.019)
    # Every group of both parts is placed...
    assert np.array_equal(np.sort(layout.order.slot_rows.astype(np.int64)), seen)
    assert layout.entry["groups_seen"] == sum(len(keys) for keys, _ in
                                              _merged_groups(profile).values())
    # ...while the hints are measured on an order that never saw the held-out requests.
    train_only = plan_order(profile, source.num_rows, 25, max_placed=source.num_rows).order
    assert list(layout.residency) == residency_hints(train_only, profile, row_bytes=160, rows_per_page=25,
                                                     page_size=4096)


def test_groups_of_both_parts_rank_by_their_summed_counts(source_and_profile):
    _, profile = source_and_profile
    summed = {}
    for part in profile.parts.values():
        for order, (keys, counts) in part.groups.items():
            for key, count in zip(keys.tolist(), counts.tolist()):
                summed[order, key] = summed.get((order, key), 0) + count
    assert len(summed) > len(profile.parts["train"].groups[2][0]) + len(profile.parts["train"].groups[3][0])
    expected = sorted(summed, key=lambda group: (-summed[group], group[0], group[1]))
    keys, orders = _hot_groups(profile, ("train", "heldout"))
    assert list(zip(orders.tolist(), keys.tolist())) == expected
    *same, counts = _hot_groups(profile, ("train", "heldout"), with_counts=True)
    assert np.array_equal(same[0], keys) and np.array_equal(same[1], orders)
    assert counts.tolist() == [summed[group] for group in expected]


def _merged_groups(profile):
    merged = {}
    for part in profile.parts.values():
        for order, (keys, _) in part.groups.items():
            merged[order] = np.union1d(merged.get(order, np.zeros(0, np.uint64)), keys)
    return {order: (keys, None) for order, keys in merged.items()}


def test_plan_refuses_another_models_profile(fp8_checkpoint, tmp_path):
    from ple_prep.tools.fixtures import make_checkpoint

    other = make_checkpoint(tmp_path / "other", base=2000, num_shards=4)
    (tmp_path / "a.txt").write_text("the table")
    profile = profile_files(other, [tmp_path / "a.txt"])
    with open_source(fp8_checkpoint) as source, pytest.raises(BadInput, match="another model"):
        plan_for_source(source, profile, page_size=4096)


@pytest.mark.parametrize("variant", ["fp8_checkpoint", "nvfp4_checkpoint"])
def test_gather_rows_equals_read_rows(variant, request):
    checkpoint = request.getfixturevalue(variant)
    with open_source(checkpoint) as source:
        everything = source.read_rows(0, source.num_rows)
        rng = np.random.default_rng(5)
        for ids in (rng.integers(0, source.num_rows, size=5000), np.arange(source.num_rows)[::-1],
                    np.array([0, 0, source.num_rows - 1, 5, 5]), np.zeros(0, dtype=np.int64)):
            assert np.array_equal(source.gather_rows(ids), everything[ids])


def test_plan_under_a_cap_fills_page_ends_with_rows_beyond_it():
    """Rows of groups beyond the map's cap fill the slots 8-row groups leave: no placed group is cut."""
    from ple_prep.ngram import NgramSpec
    from ple_prep.tools.fixtures import fixture_config

    spec = NgramSpec.from_config(fixture_config(base=20_000_000))
    profile = corpus_profile(spec, seed=4, requests=300)
    cap = 8 * profile.summary()["train"]["groups"] // 3
    plan = plan_order(profile, spec.rows_stored, 25, max_placed=cap)
    assert 0.99 * cap <= plan.order.num_placed <= cap and plan.groups_split == 0
    order_groups = sorted(((int(c), n, int(k)) for n, (keys, counts) in profile.parts["train"].groups.items()
                           for k, c in zip(keys, counts)), key=lambda g: (-g[0], g[1], g[2]))
    taken: set[int] = set()
    for _count, order_n, key in order_groups[:plan.groups_placed]:
        rows = rows_of_mixed(np.array([key], np.uint64), order_n, spec)[0]
        if not taken & set(rows.tolist()):  # rows shared with a hotter group stay where it put them
            assert np.ptp(plan.order.slot_of(rows) // 25) == 0
        taken.update(rows.tolist())


def test_plan_releasing_the_counts_plans_the_same_order(source_and_profile):
    source, _ = source_and_profile
    kept, released = corpus_profile(source.spec, seed=3), corpus_profile(source.spec, seed=3)
    limit = max_placed_rows(source.num_rows, source.row_bytes, 0.01)
    plan = plan_order(kept, source.num_rows, 25, max_placed=limit)
    freed = plan_order(released, source.num_rows, 25, max_placed=limit, release_counts=True)
    assert np.array_equal(freed.order.slot_rows, plan.order.slot_rows)
    assert (freed.groups_placed, freed.groups_split, freed.groups_seen) == (
        plan.groups_placed, plan.groups_split, plan.groups_seen)
    assert kept.parts["train"].groups and not released.parts["train"].groups
