"""The n-gram hash against the check vector of docs/MODEL.md and a plain-Python transcription, in
the compiled helper's loop and in numpy's (a build without a compiler)."""
from __future__ import annotations

import numpy as np
import pytest

import ple_prep.ngram as ngram_module
from ple_prep.ngram import NgramSpec, mixed_columns, mixed_values, row_ids
from ple_prep.tools.fixtures import fixture_config

EOS = 248044
CHECK_TOKENS = [9707, 11, 1879, EOS, 40]
CHECK_ROWS = {
    0: [16410909, 39682429, 55103279, 60931720, 87006904, 116506179, 131512017, 152932897,
        169641436, 182022480, 209277433, 237891023, 256841529, 277007269, 290665954, 300984276],
    4: [10580618, 37840707, 45212370, 71723338, 84052565, 102293892, 120404177, 159281483,
        167500023, 187273292, 213206235, 226933061, 259691440, 273675538, 298609479, 305321328],
}


@pytest.fixture(params=[pytest.param("compiled", marks=pytest.mark.needs_helper), "numpy"])
def hashing(request, monkeypatch):
    """The hash in the compiled helper (core/native/ngramcount.c) or in numpy: the same values."""
    if request.param == "numpy":
        monkeypatch.setattr(ngram_module, "_native", None)
    return request.param


@pytest.fixture(scope="module")
def real_spec() -> NgramSpec:
    return NgramSpec.from_config(fixture_config(base=20_000_000))


@pytest.fixture(scope="module")
def small_spec() -> NgramSpec:
    return NgramSpec.from_config(fixture_config(base=1000))


def reference_rows(tokens: list[int], spec: NgramSpec, history: list[int] | None = None) -> list[list[int]]:
    """The rules of docs/MODEL.md word for word, one position at a time, on Python integers."""
    mask = (1 << 64) - 1
    sequence = list(history or []) + list(tokens)
    first = len(history or [])
    out = []
    for t in range(first, len(sequence)):
        ctx = [sequence[t]]
        cut = False
        for s in range(1, spec.ngram_size):
            position = t - s
            # Positions before the request start (history included) read EOS.
            c = EOS if cut or position < 0 else sequence[position]
            cut |= c == EOS
            ctx.append(c)
        rows = []
        for n in range(2, spec.ngram_size + 1):
            mixed = 0
            for j in range(n):
                mixed ^= (ctx[j] * spec.multipliers[j]) & mask
            for k in range(spec.heads_per_ngram):
                h = (n - 2) * spec.heads_per_ngram + k
                rows.append(mixed % spec.head_sizes[h] + spec.head_offsets[h])
        out.append(rows)
    return out


def test_hash_matches_spec_check_vector(real_spec, hashing):
    ids = row_ids(CHECK_TOKENS, real_spec)
    assert ids.dtype == np.int64 and ids.shape == (5, 16)
    for position, expected in CHECK_ROWS.items():
        assert ids[position].tolist() == expected


def test_hash_constants_match_spec(real_spec, small_spec):
    assert real_spec.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert small_spec.multipliers == real_spec.multipliers
    assert small_spec.head_sizes == (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061,
                                     1063, 1069, 1087, 1091, 1093, 1097)
    assert small_spec.rows_stored == 16_896
    assert real_spec.rows_stored == 320_001_536


def test_hash_check_vector_matches_reference(real_spec, hashing):
    assert reference_rows(CHECK_TOKENS, real_spec) == row_ids(CHECK_TOKENS, real_spec).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_hash_matches_reference_on_random_sequences_with_eos(small_spec, real_spec, seed, hashing):
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 60))
    # Small vocabulary with many EOS tokens, including runs of EOS and EOS at the start.
    tokens = rng.choice([EOS, 0, 1, 2, 3, 248319, 123456], size=length,
                        p=[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1]).tolist()
    for spec in (small_spec, real_spec):
        assert row_ids(tokens, spec).tolist() == reference_rows(tokens, spec)


@pytest.mark.parametrize("seed", range(4))
def test_hash_chunked_with_context_equals_whole(small_spec, seed, hashing):
    rng = np.random.default_rng(100 + seed)
    tokens = rng.choice([EOS, 5, 6, 7, 8, 9], size=200).astype(np.int64)
    whole = row_ids(tokens, small_spec)
    cuts = sorted(set(rng.integers(0, len(tokens), size=8).tolist()) | {0, len(tokens)})
    pieces = [row_ids(tokens[a:b], small_spec, context=tokens[max(0, a - 2):a] if a else None)
              for a, b in zip(cuts, cuts[1:])]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_hash_context_of_one_token_pads_with_eos(small_spec, hashing):
    tokens = [11, 12, 13]
    assert np.array_equal(row_ids(tokens[1:], small_spec, context=[11]), row_ids(tokens, small_spec)[1:])


def test_hash_request_starts_equal_separate_requests(small_spec, hashing):
    rng = np.random.default_rng(7)
    requests = [rng.choice([EOS, 1, 2, 3], size=n) for n in (1, 5, 2, 1, 9)]
    starts = np.cumsum([0] + [len(r) for r in requests[:-1]])
    batched = mixed_values(np.concatenate(requests), small_spec, request_starts=starts)
    separate = np.concatenate([mixed_values(r, small_spec) for r in requests])
    assert np.array_equal(batched, separate)


@pytest.mark.needs_helper
@pytest.mark.parametrize("seed", range(5))
def test_hash_compiled_and_numpy_agree_on_batches_with_context_and_starts(small_spec, monkeypatch, seed):
    rng = np.random.default_rng(200 + seed)
    tokens = rng.choice([EOS, 0, 1, 2, 248319, 77], size=int(rng.integers(0, 400)))
    context = rng.choice([EOS, 3, 4], size=int(rng.integers(0, 4)))
    starts = np.unique(rng.integers(0, len(tokens) + 3, size=int(rng.integers(0, 30))))
    compiled = mixed_columns(tokens, small_spec, context, starts)
    monkeypatch.setattr(ngram_module, "_native", None)
    assert np.array_equal(compiled, mixed_columns(tokens, small_spec, context, starts))


def test_hash_refuses_unsorted_request_starts(small_spec, hashing):
    with pytest.raises(ValueError, match="sorted"):
        mixed_values([1, 2, 3, 4], small_spec, request_starts=np.array([2, 1]))
