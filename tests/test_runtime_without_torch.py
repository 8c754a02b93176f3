"""The runtime core serves with numpy alone: in a process where torch cannot be imported, a table
opens and serves, `import ple_prep.runtime` pulls in no torch (nor the offline tools' libraries),
and only asking for EmbeddingSource needs torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A meta-path finder that refuses torch as if it were not installed, then the runtime at work.
CHILD = """
import importlib.abc, json, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
import numpy as np
import ple_prep.runtime as runtime
from ple_prep.runtime import open_table

with open_table(sys.argv[1]) as table:
    ids = np.arange(0, table.num_rows, 7)
    table.resident(budget_bytes=100 * table.row_bytes)
    out = np.empty((len(ids), table.row_bytes), np.uint8)
    table.lookup(ids, out=out)
    same = bool((out == table.gather(ids)).all())
    values = table.values(ids[:10]).shape
try:
    runtime.EmbeddingSource
    refused = None
except ImportError as error:
    refused = str(error)
loaded = sorted(name for name in ("torch", "click", "tqdm", "gguf", "safetensors", "tokenizers", "zstandard")
                if name in sys.modules)
print(json.dumps({"same": same, "values": list(values), "refused": refused, "loaded": loaded}))
"""


def test_the_runtime_core_serves_where_torch_cannot_be_imported(fp8_table):
    done = subprocess.run([sys.executable, "-c", CHILD, str(fp8_table)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["same"] and report["values"] == [10, 160]
    assert report["refused"] is not None and "torch" in report["refused"]
    assert report["loaded"] == []
