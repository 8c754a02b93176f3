"""torch decoders of the GGUF types equal the numpy reference rounded to bf16, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ple_prep.converters import open_source  # noqa: E402
from ple_prep.core.constants import GGML_TYPES, Encoding, row_bytes_for  # noqa: E402
from ple_prep.offline.writer import convert  # noqa: E402
from ple_prep.runtime import dequant, open_table  # noqa: E402
from ple_prep.runtime.device.dequant import decode, decoder_for  # noqa: E402
from ple_prep.tools.fixtures import make_gguf  # noqa: E402

FLOAT_WORDS = {Encoding.GGUF_F32: ("<u4", 0x7F800000, 0x40000000),
               Encoding.GGUF_F16: ("<u2", 0x7C00, 0x4000), Encoding.GGUF_BF16: ("<u2", 0x7F80, 0x4000)}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_bits(values: np.ndarray) -> np.ndarray:
    return (dequant.round_to_bf16(values.astype(np.float64)).view(np.uint32) >> 16).astype(np.uint16)


def torch_bits(values) -> np.ndarray:
    return values.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("encoding", list(GGML_TYPES), ids=lambda e: e.label)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_dequant_gguf_table_matches_numpy(encoding, device, tmp_path):
    name = GGML_TYPES[encoding][0].lower()
    model = make_gguf(tmp_path / "m", name, layout="split")
    with open_source(model) as source:
        convert(source, tmp_path / "t.bin")
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(0).permutation(table.num_rows)
        expected = reference_bits(table.values(ids))
        decoder = decoder_for(table.encoding, table.values_per_row, table.scale, device)
        out = torch.full((len(ids), 160), float("nan"), dtype=torch.bfloat16, device=device)
        decoder(torch.from_numpy(table.gather(ids)).to(device), out=out)
    assert np.array_equal(torch_bits(out), expected)


@pytest.mark.parametrize("encoding", list(GGML_TYPES), ids=lambda e: e.label)
def test_torch_dequant_gguf_random_blocks_match_numpy(encoding):
    # Every bit pattern of the scales and codes, subnormal f16 scales and F32 values included;
    # rows holding NaN or infinity are left out (their bf16 NaN payloads are not compared).
    rows = np.random.default_rng(1).integers(0, 256, size=(4000, row_bytes_for(encoding, 160)),
                                             dtype=np.uint8)
    if encoding in FLOAT_WORDS:
        # Plain float rows: clear one exponent bit of each infinity or NaN so every row counts.
        dtype, exponent, bit = FLOAT_WORDS[encoding]
        words = rows.view(dtype)
        words[(words & exponent) == exponent] &= ~np.array(bit, dtype=dtype)
    with np.errstate(all="ignore"):
        values = dequant.decode(encoding, rows, 160, None)
    finite = np.isfinite(values).all(axis=1)
    assert finite.sum() > 400
    got = decode(encoding, torch.from_numpy(rows[finite]), 160, None)
    assert np.array_equal(torch_bits(got), reference_bits(values[finite]))


def test_round_to_bf16_subnormals_match_torch():
    bits = np.concatenate([np.arange(0, 1 << 17, dtype=np.uint32),
                           np.arange(0, 1 << 17, dtype=np.uint32) | 0x80000000,
                           np.array([0x007FFFFF, 0x007F8000, 0x00008000, 0x00018000], np.uint32)])
    values = bits.view(np.float32)
    expected = torch_bits(torch.from_numpy(values).to(torch.bfloat16))
    assert np.array_equal(reference_bits(values), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_source_serves_gguf_tokens(device, tmp_path):
    """The torch serving path on a split-head IQ4_NL table (zero padding rows included)."""
    from ple_prep.ngram import row_ids
    from ple_prep.runtime.device import EmbeddingSource

    model = make_gguf(tmp_path / "m", "iq4_nl", layout="split", num_files=2)
    with open_source(model) as source:
        spec = source.spec
        convert(source, tmp_path / "t.bin")
    with open_table(tmp_path / "t.bin") as table:
        ids = row_ids(np.random.default_rng(3).integers(0, 248320, 64), spec)
        serving = EmbeddingSource(table, device=device, resident_bytes=table.row_bytes * 4000,
                                  max_ids=64 * 16)
        got = serving(torch.from_numpy(ids).to(device))
        expected = reference_bits(table.values(ids.reshape(-1))).reshape(64, -1)
        assert np.array_equal(torch_bits(got), expected)
