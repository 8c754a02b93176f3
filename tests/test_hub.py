"""Library tests of ple_prep.converters.hub: model names resolved from a cache folder in the hub's real layout."""
from __future__ import annotations

from pathlib import Path

import pytest
from support.hubcache import add_snapshot, commit_hash

from ple_prep.converters.hub import hub_cache_dir, resolve_model
from ple_prep.core.errors import BadInput

CONFIG = b'{"model_type": "qwen4exp"}'


@pytest.fixture
def cache(tmp_path) -> Path:
    """Several repos: two snapshots of one, a second owner of one name, a dataset, a branch."""
    hub = tmp_path / "hub"
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next", commit_hash("base-old"), {"config.json": b"{}"}, refs=())
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next", commit_hash("base-new"), {"config.json": CONFIG})
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("fp8"),
                 {"config.json": CONFIG, "weights/model.safetensors.index.json": b"{}"},
                 refs=("main", "v1.0"))
    add_snapshot(hub, "someone/Qwen3.8-Flash-Next-FP8", commit_hash("fork"), {"config.json": CONFIG})
    add_snapshot(hub, "Qwen/Other-Model", commit_hash("dataset"), {"data.txt": b"x"}, repo_type="dataset")
    return hub


def test_resolve_model_full_name_follows_refs_main(cache):
    snapshot = resolve_model("Qwen/Qwen3.8-Flash-Next", cache_dir=cache)
    assert snapshot.name == commit_hash("base-new")
    assert snapshot.parent.name == "snapshots"
    assert (snapshot / "config.json").read_bytes() == CONFIG


def test_resolve_model_full_name_is_case_insensitive(cache):
    assert resolve_model("qwen/qwen3.8-flash-next-fp8", cache_dir=cache).name == commit_hash("fp8")


def test_resolve_model_revision_by_tag_and_commit(cache):
    assert resolve_model("Qwen/Qwen3.8-Flash-Next-FP8@v1.0", cache_dir=cache).name == commit_hash("fp8")
    old = commit_hash("base-old")
    assert resolve_model(f"Qwen/Qwen3.8-Flash-Next@{old[:10]}", cache_dir=cache).name == old
    with pytest.raises(BadInput, match="no cached revision v9"):
        resolve_model("Qwen/Qwen3.8-Flash-Next@v9", cache_dir=cache)


def test_resolve_model_bare_name_prefers_exact_name(cache):
    # Qwen3.8-Flash-Next-FP8 also starts with the name, but an exact name wins.
    assert resolve_model("Qwen3.8-Flash-Next", cache_dir=cache).name == commit_hash("base-new")


def test_resolve_model_bare_name_matching_two_repos_lists_them(cache):
    with pytest.raises(BadInput) as error:
        resolve_model("Qwen3.8-Flash-Next-FP8", cache_dir=cache)
    message = str(error.value)
    assert "matches 2 models" in message
    assert "Qwen/Qwen3.8-Flash-Next-FP8, someone/Qwen3.8-Flash-Next-FP8" in message
    assert str(cache) in message and "\n" not in message


def test_resolve_model_bare_name_finds_a_lone_variant(tmp_path):
    hub = tmp_path / "hub"
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("fp8"), {"config.json": CONFIG})
    assert resolve_model("Qwen3.8-Flash-Next", cache_dir=hub).name == commit_hash("fp8")
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-BF16", commit_hash("bf16"), {"config.json": CONFIG})
    with pytest.raises(BadInput, match="Qwen/Qwen3.8-Flash-Next-BF16, Qwen/Qwen3.8-Flash-Next-FP8"):
        resolve_model("Qwen3.8-Flash-Next", cache_dir=hub)


def test_resolve_model_name_matching_none_says_where_it_looked(cache):
    with pytest.raises(BadInput) as error:
        resolve_model("Llama-9", cache_dir=cache)
    message = str(error.value)
    assert f"no model Llama-9 in the Hugging Face cache at {cache}" in message
    assert "cached: Qwen/Qwen3.8-Flash-Next, Qwen/Qwen3.8-Flash-Next-FP8, someone/" in message
    # Datasets are not models.
    assert "Other-Model" not in message
    with pytest.raises(BadInput, match="Other-Model"):
        resolve_model("Qwen/Other-Model", cache_dir=cache)


def test_resolve_model_missing_cache_folder(tmp_path):
    with pytest.raises(BadInput, match=r"cache at .*nowhere \(no such folder\)"):
        resolve_model("Qwen/Qwen3.8-Flash-Next", cache_dir=tmp_path / "nowhere")


def test_resolve_model_existing_path_wins(cache, tmp_path, monkeypatch):
    folder = tmp_path / "Qwen" / "Qwen3.8-Flash-Next"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("Qwen/Qwen3.8-Flash-Next", cache_dir=cache) == Path("Qwen/Qwen3.8-Flash-Next")
    with pytest.raises(BadInput, match=r"^\./missing does not exist$"):
        resolve_model("./missing", cache_dir=cache)
    with pytest.raises(BadInput, match=r"^/no/such/folder does not exist$"):
        resolve_model("/no/such/folder", cache_dir=cache)


def test_resolve_model_without_refs_main(tmp_path):
    hub = tmp_path / "hub"
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("only"), {"config.json": CONFIG}, refs=())
    assert resolve_model("Qwen/Qwen3.8-Flash-Next-FP8", cache_dir=hub).name == commit_hash("only")
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("second"), {"config.json": b"{}"}, refs=())
    with pytest.raises(BadInput, match="no refs/main and 2 snapshots"):
        resolve_model("Qwen/Qwen3.8-Flash-Next-FP8", cache_dir=hub)


def test_hub_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"


def test_resolve_model_reads_hf_home(cache, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # the fixture's cache is tmp_path/hub
    assert resolve_model("Qwen/Qwen3.8-Flash-Next-FP8").name == commit_hash("fp8")


@pytest.fixture
def gguf_cache(tmp_path) -> Path:
    hub = tmp_path / "hub"
    stem = "Qwen3.8-Flash-Next"
    add_snapshot(hub, "unsloth/Qwen3.8-Flash-Next-GGUF", commit_hash("gguf"), {
        f"{stem}-Q8_0.gguf": b"q8", f"{stem}-IQ4_NL.gguf": b"iq4", f"{stem}-Q4_K_S.gguf": b"k_s",
        f"Q4_K_M/{stem}-Q4_K_M-00002-of-00002.gguf": b"k_m2",
        f"Q4_K_M/{stem}-Q4_K_M-00001-of-00002.gguf": b"k_m1", "README.md": b"readme"})
    return hub


def test_resolve_model_quant_picks_a_gguf_file(gguf_cache):
    snapshot = gguf_cache / "models--unsloth--Qwen3.8-Flash-Next-GGUF" / "snapshots" / commit_hash("gguf")
    assert resolve_model("unsloth/Qwen3.8-Flash-Next-GGUF:q8_0", cache_dir=gguf_cache) == \
        snapshot / "Qwen3.8-Flash-Next-Q8_0.gguf"
    assert resolve_model("Qwen3.8-Flash-Next-GGUF@main:IQ4_NL", cache_dir=gguf_cache).read_bytes() == b"iq4"
    # A split set is named by its first file, whatever order the folder lists them in.
    assert resolve_model("Qwen3.8-Flash-Next:Q4_K_M", cache_dir=gguf_cache) == \
        snapshot / "Q4_K_M" / "Qwen3.8-Flash-Next-Q4_K_M-00001-of-00002.gguf"


def test_resolve_model_quant_matching_two_or_none(gguf_cache):
    with pytest.raises(BadInput, match=r"Q4_K names 2 GGUF models of unsloth/Qwen3.8-Flash-Next-GGUF: "
                                       r"Q4_K_M/Qwen3.8-Flash-Next-Q4_K_M-00001-of-00002.gguf, "
                                       r"Qwen3.8-Flash-Next-Q4_K_S.gguf; give a longer QUANT"):
        resolve_model("unsloth/Qwen3.8-Flash-Next-GGUF:Q4_K", cache_dir=gguf_cache)
    # Q4_NL is not IQ4_NL: a quant name matches whole, not inside another.
    with pytest.raises(BadInput, match=r"no GGUF file of unsloth/Qwen3.8-Flash-Next-GGUF in .* is named "
                                       r"Q4_NL \(.gguf files: Q4_K_M/"):
        resolve_model("unsloth/Qwen3.8-Flash-Next-GGUF:Q4_NL", cache_dir=gguf_cache)


def test_resolve_model_quant_prefers_the_gguf_repo(gguf_cache):
    add_snapshot(gguf_cache, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("fp8"), {"config.json": CONFIG})
    with pytest.raises(BadInput, match="matches 2 models"):
        resolve_model("Qwen3.8-Flash-Next", cache_dir=gguf_cache)
    assert resolve_model("Qwen3.8-Flash-Next:IQ4_NL", cache_dir=gguf_cache).read_bytes() == b"iq4"


def test_resolve_model_ref_to_a_missing_snapshot(tmp_path):
    hub = tmp_path / "hub"
    add_snapshot(hub, "Qwen/Qwen3.8-Flash-Next-FP8", commit_hash("fp8"), {"config.json": CONFIG}, refs=())
    refs = hub / "models--Qwen--Qwen3.8-Flash-Next-FP8" / "refs"
    refs.mkdir()
    (refs / "main").write_text(commit_hash("deleted"))
    with pytest.raises(BadInput, match=r"^Qwen/Qwen3.8-Flash-Next-FP8@main in .*: Cannot find"):
        resolve_model("Qwen/Qwen3.8-Flash-Next-FP8", cache_dir=hub)
    assert resolve_model(f"Qwen/Qwen3.8-Flash-Next-FP8@{commit_hash('fp8')}", cache_dir=hub).name == \
        commit_hash("fp8")
