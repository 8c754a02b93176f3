"""docs/SERVING.md's code runs against the real API: its blocks, executed on a small profiled table,
and its prefetch section's split call and CUDA-graph recipe, each giving the values `Table.values` gives."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ple_prep.cli import cli
from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.runtime import open_table

torch = pytest.importorskip("torch")

SERVING = Path(__file__).resolve().parent.parent / "docs" / "SERVING.md"
# The doc's GPU where there is one (run on the H200 too), else the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", SERVING.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def served(fp8_checkpoint, tmp_path_factory):
    """A profiled table, its tensor-parallel rank files, and a real `ple-prep bench --json`."""
    from click.testing import CliRunner

    folder = tmp_path_factory.mktemp("serving")
    runner = CliRunner()
    rng = np.random.default_rng(7)
    with open(folder / "requests.jsonl", "w") as handle:
        for _ in range(200):
            handle.write(json.dumps({"token_ids": (rng.zipf(1.3, size=60) % 3000).tolist()}) + "\n")
    model = ["--model", str(fp8_checkpoint), "-q"]
    commands = [
        ["profile", *model, "--prompts", str(folder / "requests.jsonl"), "--out", str(folder / "p.prof")],
        ["convert", *model, "--profile", str(folder / "p.prof"), "--out", str(folder / "ple.bin")],
        ["convert", *model, "--tp-size", "2", "--out", str(folder / "ple.bin")],
    ]
    for args in commands:
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["bench", str(folder / "ple.bin"), "--json", "--fio-seconds", "0",
                                 "--prefill-requests", "1", "--decode-requests", "10"])
    assert result.exit_code == 0, result.output
    (folder / "bench.json").write_text(result.stdout)
    return folder


def _run(code: str, folder: Path, namespace: dict, table_name: str = "ple.bin") -> dict:
    # The doc's host paths swapped for the test's files, and its GPU for DEVICE.
    code = (code.replace("/nvme/ple.bin", str(folder / table_name))
                .replace('"bench.json"', repr(str(folder / "bench.json")))
                .replace('device="cuda"', f'device="{DEVICE}"'))
    exec(compile(code, str(SERVING), "exec"), namespace)
    return namespace


def _expected(table_path: Path, chunks) -> np.ndarray:
    with open_table(table_path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        ids = np.concatenate([row_ids(tokens, spec, context=context) for tokens, context in chunks])
        values = table.values(ids.reshape(-1)).reshape(len(ids), -1)
    return torch.from_numpy(values).to(torch.bfloat16).to(DEVICE)


def test_serving_doc_embedding_layer_gives_the_model_values(served):
    layer, usage = _blocks()[:2]
    namespace = _run(usage, served, _run(layer, served, {}))
    prompt = [9707, 11, 1879, 248044, 40]
    # The usage block's last call: a request's next token, then a new request, in one batch.
    expected = _expected(served / "ple.bin", [([13], prompt[-2:]), ([9707, 11], None)])
    assert torch.equal(namespace["step"], expected)
    ple = namespace["ple"]
    assert torch.equal(ple([(prompt, None)]), _expected(served / "ple.bin", [(prompt, None)]))
    # A batch larger than max_tokens goes through in pieces.
    small = namespace["NgramPLEEmbedding"](str(served / "ple.bin"), device=DEVICE, resident_bytes=4096,
                                           max_tokens=3)
    long_prompt = list(range(100, 111))
    assert torch.equal(small([(long_prompt, None)]), _expected(served / "ple.bin", [(long_prompt, None)]))


def test_serving_doc_tensor_parallel_ranks_sum_to_the_full_input(served):
    layer = _blocks()[0]
    namespace = _run(layer, served, {})
    chunks = [(list(range(2000, 2050)), None), ([5, 6, 7], [3, 4])]
    ranks = [namespace["NgramPLEEmbedding"](str(served / f"ple.tp{r}of2.bin"), device=DEVICE,
                                            resident_bytes=8192) for r in range(2)]
    partial = [rank(chunks).float() for rank in ranks]
    assert all(p.abs().sum() > 0 for p in partial)
    assert torch.equal((partial[0] + partial[1]).to(torch.bfloat16), _expected(served / "ple.bin", chunks))


def test_serving_doc_pick_budget_follows_the_hints(served):
    namespace = _run(_blocks()[2], served, {})
    manifest = json.loads((served / "ple.bin.json").read_text())
    disk_rows_per_s = json.loads((served / "bench.json").read_text())["cold_prefill"]["distinct_rows_per_s"]
    pick_budget = namespace["pick_budget"]
    hints = sorted((h for h in manifest["residency"] if h["hit_fraction"] is not None),
                   key=lambda h: h["rows"])
    assert hints, "the profiled table must carry measured hints"
    # A disk that serves everything needs no memory; one that serves nothing needs the whole table.
    assert pick_budget(manifest, 1e18, 20_000, max_bytes=1 << 40)["rows"] == hints[0]["rows"]
    full = pick_budget(manifest, 1e-9, 20_000, max_bytes=1 << 40)
    assert full is not None and full["hit_fraction"] == 1.0 and full["disk_rows_per_s_needed"] == 0
    assert pick_budget(manifest, 1e-9, 20_000, max_bytes=1000) is None
    choice = pick_budget(manifest, disk_rows_per_s, peak_tokens_per_s=20_000, max_bytes=8 << 30)
    if choice is not None:
        assert choice["disk_rows_per_s_needed"] <= 0.5 * disk_rows_per_s
        assert choice["resident_bytes"] == choice["rows"] * manifest["row_bytes"] <= 8 << 30


def test_serving_doc_pick_budget_takes_the_rows_the_disk_read(served, tmp_path):
    # bench's rows_per_s counts a chunk's repeated ids too; the disk read each distinct row once.
    bench = json.loads((served / "bench.json").read_text())
    bench["cold_prefill"] |= {"rows_per_s": 1e18, "distinct_rows_per_s": 1e-9}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    for name in ("ple.bin", "ple.bin.json"):
        (tmp_path / name).symlink_to(served / name)
    namespace = _run(_blocks()[2], tmp_path, {})
    manifest, pick_budget = namespace["manifest"], namespace["pick_budget"]
    assert namespace["choice"] == pick_budget(manifest, 1e-9, 20_000, max_bytes=8 << 30)
    assert namespace["choice"] != pick_budget(manifest, 1e18, 20_000, max_bytes=8 << 30)


# --- The prefetch section: the split call in a model, and its CUDA-graph recipe (on a GPU) --------

def _prefetch_blocks() -> list[str]:
    text = SERVING.read_text()
    section = text[text.index("## Prefetch:"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_prefetch_doc_model_starts_before_layer_zero_and_finishes_at_the_ple_layer(fp8_table):
    namespace = _run(_prefetch_blocks()[0], fp8_table.parent, {}, fp8_table.name)
    ple, batch = namespace["ple"], namespace["batch"]
    ple.start(batch)
    assert torch.equal(ple.finish(), _expected(fp8_table, batch))
    other = [(list(range(300, 340)), None)]
    ple.start(other)
    torch.ones(64, 64, device=DEVICE).sum()  # other work between the halves
    assert torch.equal(ple.finish(), _expected(fp8_table, other))


@pytest.mark.needs_cuda
def test_prefetch_doc_graph_recipe_replays_the_step(fp8_table):
    blocks = _prefetch_blocks()
    namespace = _run(blocks[1], fp8_table.parent, _run(blocks[0], fp8_table.parent, {}, fp8_table.name),
                     fp8_table.name)
    torch.cuda.synchronize()
    ids = namespace["step_ids"]
    values = namespace["static_values"][:ids.size].reshape(len(ids), -1)
    assert torch.equal(values, _expected(fp8_table, namespace["batch"]))
