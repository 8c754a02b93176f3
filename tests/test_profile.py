"""Profiling prompts: counts equal the hash's rows, shards merge to one run, inputs are checked."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

import ple_prep.ngram as ngram_module
import ple_prep.offline.profile as profile_module
import ple_prep.offline.profile_pool as profile_pool
from ple_prep.converters import read_spec
from ple_prep.core.errors import BadInput
from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.offline.chat import render_chat
from ple_prep.offline.profile import (
    BATCH_TOKENS,
    PartCounts,
    Profiler,
    is_heldout,
    load_profile,
    merge_profiles,
    profile_files,
    save_profile,
)

EOS = 248044


@pytest.fixture(params=[pytest.param("compiled", marks=pytest.mark.needs_helper), "numpy"])
def counting(request, monkeypatch):
    """Hashing and counting in the compiled helper (core/native/ngramcount.c) or in numpy."""
    if request.param == "numpy":
        without_helper(monkeypatch)
    return request.param


def without_helper(monkeypatch) -> None:
    monkeypatch.setattr(ngram_module, "_native", None)
    monkeypatch.setattr(profile_module, "_native", None)


@pytest.fixture(scope="module")
def spec(fp8_checkpoint) -> NgramSpec:
    return read_spec(fp8_checkpoint)


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """One prompt file of every kind, with requests that repeat, contain EOS and are empty."""
    folder = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(3)
    (folder / "one.txt").write_text("the table row page read; the model reads the table.\n")
    with open(folder / "many.jsonl", "w") as handle:
        for i in range(120):
            handle.write(json.dumps({"text": f"the model reads row {i} of the table"}) + "\n")
            handle.write(json.dumps({"prompt": "serve fast storage " * (i % 4)}) + "\n")
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"hash head {i}"},
                                                  {"role": "assistant", "content": "ok"}]}) + "\n")
            handle.write(json.dumps({"token_ids": rng.choice([EOS, 1, 2, 3, 500], size=i % 17).tolist()}) + "\n")
            handle.write("\n")
    np.save(folder / "ids.npy", rng.integers(0, 248320, size=3000))
    return [folder / "one.txt", folder / "many.jsonl", folder / "ids.npy"]


def expected_requests(checkpoint, files) -> list[np.ndarray]:
    """The requests of the fixture files, tokenised independently of the profiler."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    requests = [np.array(tokenizer.encode(files[0].read_text()).ids)]
    for line in files[1].read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "token_ids" in record:
            requests.append(np.array(record["token_ids"], dtype=np.int64))
        elif "messages" in record:
            text = render_chat(checkpoint, config, record["messages"], "test")
            requests.append(np.array(tokenizer.encode(text, add_special_tokens=False).ids))
        else:
            requests.append(np.array(tokenizer.encode(record.get("text", record.get("prompt"))).ids))
    requests.append(np.load(files[2], allow_pickle=False))
    return [r for r in requests if len(r)]


def row_counts(requests, spec) -> tuple[np.ndarray, np.ndarray]:
    if not requests:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.concatenate([row_ids(r, spec).reshape(-1) for r in requests])
    return np.unique(rows, return_counts=True)


def test_profile_counts_equal_rows_of_the_hash(fp8_checkpoint, prompt_files, spec):
    profile = profile_files(fp8_checkpoint, prompt_files)
    requests = expected_requests(fp8_checkpoint, prompt_files)
    heldout = [r for r in requests if is_heldout(r)]
    train = [r for r in requests if not is_heldout(r)]
    assert heldout and train
    for part, chosen in (("train", train), ("heldout", heldout)):
        counts = profile.parts[part]
        assert counts.requests == len(chosen)
        assert counts.tokens == sum(len(r) for r in chosen)
        rows, hits = counts.rows(spec)
        expected_rows, expected_hits = row_counts(chosen, spec)
        assert np.array_equal(rows, expected_rows) and np.array_equal(hits, expected_hits)
    assert [entry["requests"] for entry in profile.inputs] == [1, len(requests) - 2, 1]


def test_profile_chat_messages_render_with_the_template(fp8_checkpoint):
    config = json.loads((fp8_checkpoint / "tokenizer_config.json").read_text())
    text = render_chat(fp8_checkpoint, config, [{"role": "user", "content": "hi"}], "x")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = Tokenizer.from_file(str(fp8_checkpoint / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids[0] == EOS - 1 and EOS in ids


def test_profile_merge_of_shards_equals_one_run(fp8_checkpoint, prompt_files, tmp_path):
    whole = profile_files(fp8_checkpoint, prompt_files)
    save_profile(whole, tmp_path / "whole.prof")
    shards = [profile_files(fp8_checkpoint, prompt_files[:2]), profile_files(fp8_checkpoint, prompt_files[2:])]
    for index, shard in enumerate(shards):
        save_profile(shard, tmp_path / f"shard{index}.prof")
    merged = merge_profiles([load_profile(tmp_path / f"shard{index}.prof") for index in range(2)])
    save_profile(merged, tmp_path / "merged.prof")
    assert (tmp_path / "merged.prof").read_bytes() == (tmp_path / "whole.prof").read_bytes()
    loaded = load_profile(tmp_path / "merged.prof")
    for part in ("train", "heldout"):
        for order, (keys, counts) in whole.parts[part].groups.items():
            assert np.array_equal(loaded.parts[part].groups[order][0], keys)
            assert np.array_equal(loaded.parts[part].groups[order][1], counts)


def test_profile_batches_split_requests_like_single_calls(spec, monkeypatch):
    """Requests hashed across several flushes and compactions count as one pass would."""
    monkeypatch.setattr("ple_prep.offline.profile.BATCH_TOKENS", 64)
    rng = np.random.default_rng(9)
    requests = [rng.choice([EOS, 7, 8, 9, 10], size=int(rng.integers(1, 40))) for _ in range(200)]
    profiler = Profiler(spec)
    for request in requests:
        profiler.add_request(request)
    profile = profiler.finish(model="m", tokenizer_sha256=None, inputs=[])
    rows = np.concatenate([profile.parts[p].rows(spec)[0] for p in ("train", "heldout")])
    hits = np.concatenate([profile.parts[p].rows(spec)[1] for p in ("train", "heldout")])
    merged_rows, inverse = np.unique(rows, return_inverse=True)
    expected_rows, expected_hits = row_counts(requests, spec)
    assert np.array_equal(merged_rows, expected_rows)
    assert np.array_equal(np.bincount(inverse, weights=hits).astype(np.int64), expected_hits)
    assert BATCH_TOKENS > 64


def test_profile_counts_so_far_stay_put_while_counting_goes_on(spec, monkeypatch, counting):
    monkeypatch.setattr("ple_prep.offline.profile.BATCH_TOKENS", 64)
    rng = np.random.default_rng(10)
    profiler = Profiler(spec)
    snapshots = []
    for _ in range(6):
        for _ in range(40):
            profiler.add_request(rng.choice([EOS, *range(300)], size=int(rng.integers(1, 30))))
        counts = profiler.counts()["train"].groups[3]
        snapshots.append((counts, counts[0].copy(), counts[1].copy()))
    for (keys, counts), keys_then, counts_then in snapshots:
        assert np.array_equal(keys, keys_then) and np.array_equal(counts, counts_then)
    assert len(snapshots[-1][1]) > len(snapshots[0][1])


def test_profile_heldout_is_about_a_tenth_and_by_content():
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 1000, size=20) for _ in range(5000)]
    share = np.mean([is_heldout(r) for r in requests])
    assert 0.08 < share < 0.12
    assert is_heldout(requests[0]) == is_heldout(requests[0].copy().astype(np.int32))


@pytest.mark.parametrize("name, content, message", [
    ("bad.csv", "x", "must be .txt, .jsonl or .npy"),
    ("bad.jsonl", "{not json}\n", "bad.jsonl:1 is not JSON"),
    ("list.jsonl", "[1, 2]\n", "each line must be a JSON object"),
    ("keys.jsonl", '{"other": 1}\n', "expected a string 'text'"),
    ("ids.jsonl", '{"token_ids": [1, "a"]}\n', "token_ids must be a list of integers"),
    ("range.jsonl", '{"token_ids": [1, 248320]}\n', "token ids must be in [0, 248320)"),
    ("huge.jsonl", '{"text": "ok"}\n{"token_ids": [99999999999999999999999]}\n',
     "huge.jsonl:2: token ids must be in [0, 248320)"),
    ("surrogate.jsonl", '{"text": "\\ud800"}\n', "surrogate.jsonl:1: text must be valid Unicode"),
    ("prompt.jsonl", '{"prompt": "a \\udfff b"}\n', "prompt.jsonl:1: text must be valid Unicode"),
    ("chat-surrogate.jsonl", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}\n',
     "chat-surrogate.jsonl:1: text must be valid Unicode"),
    ("chat.jsonl", '{"messages": "hi"}\n', "messages must be a list"),
    ("latin.txt", b"\xff\xfe bad", "is not UTF-8"),
])
def test_profile_bad_inputs_raise(fp8_checkpoint, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(BadInput, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        profile_files(fp8_checkpoint, [path])


def test_profile_bad_npy_and_missing_tokenizer(fp8_checkpoint, tmp_path):
    np.save(tmp_path / "two.npy", np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BadInput, match="1-D integer array"):
        profile_files(fp8_checkpoint, [tmp_path / "two.npy"])
    from ple_prep.tools.fixtures import make_checkpoint

    bare = make_checkpoint(tmp_path / "bare", with_tokenizer=False, num_shards=4)
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(BadInput, match="tokenizer.json not found"):
        profile_files(bare, [tmp_path / "a.txt"])
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(BadInput, match="need a chat template"):
        profile_files(bare, [tmp_path / "c.jsonl"])


def test_profile_load_refuses_other_files(tmp_path):
    (tmp_path / "x.prof").write_bytes(b"not zstd at all")
    with pytest.raises(BadInput, match="not a ple-prep profile"):
        load_profile(tmp_path / "x.prof")
    import zstandard

    (tmp_path / "y.prof").write_bytes(zstandard.ZstdCompressor().compress(b"PLEPROF\x00" + b"\x05" * 8))
    with pytest.raises(BadInput):
        load_profile(tmp_path / "y.prof")


def test_profile_merge_refuses_other_models(fp8_checkpoint, prompt_files, tmp_path):
    from ple_prep.tools.fixtures import make_checkpoint

    other = make_checkpoint(tmp_path / "other", base=2000, num_shards=4)
    first = profile_files(fp8_checkpoint, prompt_files[2:])
    second = profile_files(other, prompt_files[2:])
    with pytest.raises(BadInput, match="different hash specs"):
        merge_profiles([first, second])


@pytest.mark.parametrize("count, size", [(5, 1000), (5000, 1000)])
def test_profile_row_sums_dense_and_sorted_agree(count, size):
    from ple_prep.offline.profile import _sum_by_key, _sum_in_range

    rng = np.random.default_rng(count)
    keys = rng.integers(500, 500 + size, size=count)
    counts = rng.integers(1, 1 << 40, size=count).astype(np.uint64)
    dense_keys, dense_counts = _sum_in_range(keys, counts, 500, size)
    sorted_keys, sorted_counts = _sum_by_key(keys, counts)
    assert np.array_equal(dense_keys, sorted_keys) and np.array_equal(dense_counts, sorted_counts)
    assert int(sorted_counts.sum()) == int(counts.sum())


def _saved_bytes(profile, path) -> bytes:
    save_profile(profile, path, force=True)
    return path.read_bytes()


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_profile_on_several_workers_equals_one_process(fp8_checkpoint, prompt_files, tmp_path, monkeypatch,
                                                       workers):
    """Files shared among worker processes, the .jsonl cut into line-aligned pieces: the same
    counts, inputs and profile bytes as one process."""
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 2000)
    one = profile_files(fp8_checkpoint, prompt_files, workers=1)
    several = profile_files(fp8_checkpoint, prompt_files, workers=workers)
    assert several.inputs == one.inputs
    assert _saved_bytes(several, tmp_path / "several.prof") == _saved_bytes(one, tmp_path / "one.prof")


def test_worker_results_go_to_disk_where_the_memory_folder_lacks_room(fp8_checkpoint, prompt_files, tmp_path,
                                                                     monkeypatch):
    """The workers' results go to the memory folder only where it has room for them (a container's
    small /dev/shm would fail the run), else to disk, with the same profile either way."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr("ple_prep.offline.profile_pool.SHM_FOLDER", str(folder))
    room = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    assert profile_pool.scratch_folder(1000) == str(folder)
    assert profile_pool.scratch_folder(room) is None
    monkeypatch.setattr("ple_prep.offline.profile_pool.SHM_FOLDER", str(tmp_path / "missing"))
    assert profile_pool.scratch_folder(1000) is None
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 2000)
    one = profile_files(fp8_checkpoint, prompt_files, workers=1)
    several = profile_files(fp8_checkpoint, prompt_files, workers=2)
    assert _saved_bytes(several, tmp_path / "several.prof") == _saved_bytes(one, tmp_path / "one.prof")


def test_profile_piece_of_a_jsonl_names_the_file_line(fp8_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 500)
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"token_ids": [1, 2, 3]})] * 300 + ["[1, 2]"] + [json.dumps({"token_ids": [4]})] * 20
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInput, match=f"{path}:301: each line must be a JSON object"):
        profile_files(fp8_checkpoint, [path], workers=2)


@pytest.mark.parametrize("failure", ["disk", "killed"])
def test_a_failing_profile_worker_raises_its_cause_here(fp8_checkpoint, prompt_files, monkeypatch, failure):
    """A worker's error comes back as plain data and is raised again as its kind (a file's error
    with its errno and file); a worker killed by a signal is named as such, and the run ends."""
    parent = os.getpid()
    share = profile_module._profile_share

    def failing_in_a_worker(*args):
        if os.getpid() != parent:
            if failure == "killed":
                os.kill(os.getpid(), 9)
            raise OSError(28, "No space left on device", "/scratch/x")
        return share(*args)

    monkeypatch.setattr(profile_module, "_profile_share", failing_in_a_worker)
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 2000)
    expected = (OSError, r"No space left on device.*/scratch/x") if failure == "disk" else \
        (RuntimeError, "a profile worker was killed by SIGKILL")
    with pytest.raises(expected[0], match=expected[1]) as raised:
        profile_files(fp8_checkpoint, prompt_files, workers=2)
    if failure == "disk":
        assert raised.value.errno == 28 and raised.value.filename == "/scratch/x"


@pytest.mark.needs_helper
def test_profile_bytes_are_the_same_without_the_compiled_helper(fp8_checkpoint, prompt_files, tmp_path,
                                                                monkeypatch):
    """Many small batches (merges of runs at every size) hashed and counted in C and in numpy."""
    monkeypatch.setattr("ple_prep.offline.profile.BATCH_TOKENS", 300)
    compiled = _saved_bytes(profile_files(fp8_checkpoint, prompt_files, workers=1), tmp_path / "c.prof")
    without_helper(monkeypatch)
    assert _saved_bytes(profile_files(fp8_checkpoint, prompt_files, workers=1), tmp_path / "n.prof") == compiled


def _random_runs(rng, count: int, high: int) -> list[tuple[np.ndarray, np.ndarray]]:
    runs = []
    for _ in range(count):
        keys = np.unique(rng.integers(0, high, size=int(rng.integers(0, 3000)), dtype=np.uint64))
        counts = rng.integers(0, 1 << 63, size=len(keys), dtype=np.uint64) >> np.uint64(rng.integers(0, 64))
        runs.append((keys, counts))
    return runs


@pytest.mark.needs_helper
@pytest.mark.parametrize("seed", range(4))
def test_profile_merged_runs_equal_numpy_sums_with_zero_and_wrapping_counts(monkeypatch, seed):
    from ple_prep.offline.profile import _sum_by_key, _sum_runs

    rng = np.random.default_rng(seed)
    runs = _random_runs(rng, int(rng.integers(1, 7)), 1 << int(rng.integers(4, 64)))
    keys, counts = _sum_runs(runs)
    expected_keys, expected_counts = _sum_by_key(np.concatenate([k for k, _ in runs]),
                                                 np.concatenate([c for _, c in runs]))
    assert keys.dtype == np.uint64 and np.array_equal(keys, expected_keys)
    assert counts.dtype == np.uint64 and np.array_equal(counts, expected_counts)


@pytest.mark.needs_helper
@pytest.mark.parametrize("base, total_bits", [(1000, 40), (1000, 62), (20_000_000, 40)])
def test_profile_rows_of_groups_equal_numpy_in_dense_sparse_and_huge_counts(monkeypatch, base, total_bits):
    """Rows of counted groups: dense counting (many groups a head), sorting (few), and the sorted
    path numpy takes when float64 sums would not be exact; zero counts included."""
    from ple_prep.tools.fixtures import fixture_config

    spec = NgramSpec.from_config(fixture_config(base=base))
    rng = np.random.default_rng(base + total_bits)
    groups = {}
    for order in (2, 3):
        keys = np.unique(rng.integers(0, 1 << 64, size=20_000, dtype=np.uint64))
        counts = rng.integers(0, 1 << (total_bits - 15), size=len(keys), dtype=np.uint64)
        counts[::7] = 0
        groups[order] = (keys, counts)
    part = PartCounts(1, 1, groups)
    rows, hits = part.rows(spec)
    without_helper(monkeypatch)
    expected_rows, expected_hits = part.rows(spec)
    assert rows.dtype == np.int64 and hits.dtype == np.uint64
    assert np.array_equal(rows, expected_rows) and np.array_equal(hits, expected_hits)


@pytest.mark.parametrize("workers", [1, 2])
def test_profile_inputs_carry_each_file_sha256(fp8_checkpoint, prompt_files, monkeypatch, workers, counting):
    """Read once for hashing and checksum alike: the checksums are the files' own, whole files and
    a .jsonl cut into pieces alike."""
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 2000)
    profile = profile_files(fp8_checkpoint, prompt_files, workers=workers)
    assert [entry["sha256"] for entry in profile.inputs] == [
        hashlib.sha256(path.read_bytes()).hexdigest() for path in prompt_files]
    assert [entry["bytes"] for entry in profile.inputs] == [path.stat().st_size for path in prompt_files]
