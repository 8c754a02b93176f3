"""Profiling prompts: counts equal the hash's rows, shards merge to one run, inputs are checked."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from ple_prep.converters import read_spec
from ple_prep.core.errors import BadInput
from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.offline.chat import render_chat
from ple_prep.offline.profile import (
    BATCH_TOKENS,
    Profiler,
    is_heldout,
    load_profile,
    merge_profiles,
    profile_files,
    save_profile,
)

EOS = 248044


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
    requests.append(np.load(files[2]))
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


@pytest.mark.parametrize("workers", [2, 3])
def test_profile_on_several_workers_equals_one_process(fp8_checkpoint, prompt_files, tmp_path, monkeypatch,
                                                       workers):
    """Files shared among worker processes, the .jsonl cut into line-aligned pieces: the same
    counts, inputs and profile bytes as one process."""
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 2000)
    one = profile_files(fp8_checkpoint, prompt_files, workers=1)
    several = profile_files(fp8_checkpoint, prompt_files, workers=workers)
    assert several.inputs == one.inputs
    assert _saved_bytes(several, tmp_path / "several.prof") == _saved_bytes(one, tmp_path / "one.prof")


def test_profile_piece_of_a_jsonl_names_the_file_line(fp8_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("ple_prep.offline.profile_pool.PIECE_BYTES", 500)
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"token_ids": [1, 2, 3]})] * 300 + ["[1, 2]"] + [json.dumps({"token_ids": [4]})] * 20
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInput, match=f"{path}:301: each line must be a JSON object"):
        profile_files(fp8_checkpoint, [path], workers=2)
