"""A profile recorded from served traffic: the file `profile merge` and `convert --profile` take."""
from __future__ import annotations

import time

import numpy as np

from ple_prep.ngram import NgramSpec
from ple_prep.offline.profile import Profiler, load_profile, merge_profiles
from ple_prep.runtime.recording import TrafficRecorder
from ple_prep.tools.fixtures import fixture_config


def requests(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 900, int(rng.integers(1, 300))) for _ in range(count)]


def test_every_request_recorded_equals_the_profile_of_those_requests(tmp_path):
    spec = NgramSpec.from_config(fixture_config(1000))
    recorder = TrafficRecorder(spec, tmp_path / "served.prof", sample_every=1, write_seconds=3600)
    profiler = Profiler(spec)
    for number, tokens in enumerate(requests(120, 1)):
        if number % 32 == 0:
            recorder.flush()  # a kept request waits on a bounded queue; more are dropped
        assert recorder.add_request(tokens)
        profiler.add_request(tokens)
    recorder.close()
    (tmp_path / "served.prof").unlink()
    recorder.close()  # once only: nothing written again
    assert not (tmp_path / "served.prof").exists()
    recorder.write()
    recorded = load_profile(tmp_path / "served.prof")
    expected = profiler.finish(model="served", tokenizer_sha256=None, inputs=[])
    for part in ("train", "heldout"):
        assert recorded.parts[part].requests == expected.parts[part].requests
        assert recorded.parts[part].tokens == expected.parts[part].tokens
        for order, (keys, counts) in expected.parts[part].groups.items():
            got_keys, got_counts = recorded.parts[part].groups[order]
            assert np.array_equal(got_keys, keys) and np.array_equal(got_counts, counts)
    assert recorded.parts["heldout"].requests > 0  # the split is the profiler's


def test_a_sample_is_kept_and_profiles_of_two_replicas_merge(tmp_path):
    spec = NgramSpec.from_config(fixture_config(1000))
    paths = []
    for replica in range(2):
        recorder = TrafficRecorder(spec, tmp_path / f"r{replica}.prof", sample_every=4, write_seconds=3600)
        kept = sum(recorder.add_request(tokens) for tokens in requests(40, 10 + replica))
        recorder.close()
        assert kept == 10 and recorder.recorded == 10 and recorder.error is None
        paths.append(tmp_path / f"r{replica}.prof")
    merged = merge_profiles([load_profile(path) for path in paths])
    assert merged.requests == 20


def test_the_profile_is_written_periodically_while_serving(tmp_path):
    spec = NgramSpec.from_config(fixture_config(1000))
    recorder = TrafficRecorder(spec, tmp_path / "served.prof", sample_every=1, write_seconds=0.05)
    for tokens in requests(5, 3):
        recorder.add_request(tokens)
    recorder.flush()
    for _ in range(200):
        if (tmp_path / "served.prof").exists():
            break
        time.sleep(0.02)
    assert load_profile(tmp_path / "served.prof").requests >= 1
    recorder.close()
