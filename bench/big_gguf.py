"""Write a large qwen4exp GGUF for benchmarks, streaming: one chunk of rows in memory at a time.

The tensor info goes through `GGUFWriter`'s own state machine (header, metadata, tensor info);
the table's bytes are then streamed into its file after the data alignment, as
`write_tensors_to_file` would write them, without holding the table in memory.

    python bench/big_gguf.py /work/bigdata/issue5/q8_0 --type q8_0 --base 1600000
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ple_prep.core.constants import GGUF_JOINED_TENSOR, VALUES_PER_ROW  # noqa: E402
from ple_prep.ngram import NgramSpec  # noqa: E402
from ple_prep.tools.fixtures import add_gguf_metadata, fixture_config  # noqa: E402

CHUNK_BYTES = 64 << 20


def random_rows(ggml_type: str, count: int, row_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks: random codes, and a small positive f16 scale at the head of each block."""
    rows = np.frombuffer(rng.bytes(count * row_bytes), dtype=np.uint8).reshape(count, row_bytes).copy()
    if ggml_type in ("q8_0", "q4_0", "iq4_nl"):
        block_bytes = row_bytes // (VALUES_PER_ROW // 32)
        blocks = rows.reshape(-1, block_bytes)
        scales = rng.uniform(2e-4, 1e-3, size=(len(blocks), 1)).astype("<f2")
        blocks[:, :2] = scales.view(np.uint8)
    return rows


def write_big_gguf(folder: Path, ggml_type: str, base: int, seed: int = 0) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    spec = NgramSpec.from_config(fixture_config(base))
    qtype = GGMLQuantizationType[ggml_type.upper()]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = VALUES_PER_ROW // block_values * block_bytes
    rows = spec.rows_stored
    writer = GGUFWriter(path, "qwen4exp")
    add_gguf_metadata(writer, spec)
    writer.add_tensor_info(GGUF_JOINED_TENSOR, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
                           raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    handle = writer.fout[0]
    writer.write_padding(handle, handle.tell())
    rng = np.random.default_rng(seed)
    rows_per_chunk = CHUNK_BYTES // row_bytes
    for start in range(0, rows, rows_per_chunk):
        random_rows(ggml_type, min(rows_per_chunk, rows - start), row_bytes, rng).tofile(handle)
    writer.write_padding(handle, rows * row_bytes)
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0", "iq4_nl"])
    parser.add_argument("--base", type=int, default=1_600_000,
                        help="ngram_vocab_size_base (1,600,000 with Q8_0: a 4.05 GiB table).")
    args = parser.parse_args()
    started = time.perf_counter()
    path = write_big_gguf(args.folder, args.type, args.base)
    print(f"wrote {path}: {path.stat().st_size / 2**30:.2f} GiB in "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
