"""The built-in example: fixture checkpoint, convert, verify, and the hash's check vector (docs/MODEL.md)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ..converters import open_source
from ..ngram import row_ids
from ..offline.verify import verify
from ..offline.writer import WriteOptions, convert
from ..runtime import open_table
from .fixtures import make_checkpoint

# The check vector of docs/MODEL.md: a fresh request's tokens, with an EOS cutting the last window.
CHECK_TOKENS = [9707, 11, 1879, 248044, 40]


def run_demo(folder: Path, variant: str = "fp8") -> dict[str, Any]:
    checkpoint = make_checkpoint(folder / f"checkpoint-{variant}", variant)
    table_path = folder / f"ple-{variant}.bin"
    started = time.perf_counter()
    with open_source(checkpoint) as source:
        manifest = convert(source, table_path, WriteOptions(force=True))
        spec = source.spec
    seconds = time.perf_counter() - started
    report = verify(table_path, checkpoint)
    ids = row_ids(CHECK_TOKENS, spec)
    with open_table(table_path) as table:
        values = table.values(ids.reshape(-1)).reshape(len(CHECK_TOKENS), -1)
    return {
        "checkpoint": str(checkpoint),
        "table": str(table_path),
        "encoding": manifest["encoding"],
        "rows": manifest["num_rows"],
        "file_bytes": manifest["file_size"],
        "convert_seconds": round(seconds, 3),
        "rows_verified": report.rows_compared,
        "verified": report.ok,
        "token_0_rows": ids[0].tolist(),
        "token_0_values_sum": float(np.sum(values[0], dtype=np.float64)),
    }
