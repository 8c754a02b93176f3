"""docs/SERVING.md's prefetch section runs against the real API: the split call in a model, and its
CUDA-graph recipe (on a GPU), each giving the values `Table.values` gives."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.runtime import open_table

torch = pytest.importorskip("torch")

SERVING = Path(__file__).resolve().parent.parent / "docs" / "SERVING.md"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _section_blocks() -> list[str]:
    text = SERVING.read_text()
    section = text[text.index("## Prefetch:"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _run(code: str, table: Path, namespace: dict) -> dict:
    code = code.replace("/nvme/ple.bin", str(table)).replace('device="cuda"', f'device="{DEVICE}"')
    exec(compile(code, str(SERVING), "exec"), namespace)
    return namespace


def _expected(table_path: Path, batch) -> torch.Tensor:
    with open_table(table_path) as table:
        spec = NgramSpec.from_json(table.manifest["ngram"])
        ids = np.concatenate([row_ids(tokens, spec, context=context) for tokens, context in batch])
        values = table.values(ids.reshape(-1)).reshape(len(ids), -1)
    return torch.from_numpy(values).to(torch.bfloat16).to(DEVICE)


def test_prefetch_doc_model_starts_before_layer_zero_and_finishes_at_the_ple_layer(fp8_table):
    namespace = _run(_section_blocks()[0], fp8_table, {})
    ple, batch = namespace["ple"], namespace["batch"]
    ple.start(batch)
    assert torch.equal(ple.finish(), _expected(fp8_table, batch))
    other = [(list(range(300, 340)), None)]
    ple.start(other)
    torch.ones(64, 64, device=DEVICE).sum()  # other work between the halves
    assert torch.equal(ple.finish(), _expected(fp8_table, other))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_doc_graph_recipe_replays_the_step(fp8_table):
    blocks = _section_blocks()
    namespace = _run(blocks[1], fp8_table, _run(blocks[0], fp8_table, {}))
    torch.cuda.synchronize()
    ids = namespace["step_ids"]
    values = namespace["static_values"][:ids.size].reshape(len(ids), -1)
    assert torch.equal(values, _expected(fp8_table, namespace["batch"]))
