"""torch decoders equal the numpy reference rounded to bf16, bit for bit, on every device present."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ple_prep.core.constants import Encoding  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.dequant import round_to_bf16  # noqa: E402
from ple_prep.runtime.device.dequant import TorchDecoder, decode, decoder_for  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bf16_bits_of_reference(values: np.ndarray) -> np.ndarray:
    """The numpy reference's float32 values as bf16 bits (round once, nearest even)."""
    return (round_to_bf16(values.astype(np.float64)).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module", params=["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def table(request, tmp_path_factory, converted_table):
    checkpoint = request.getfixturevalue(request.param)
    with open_table(converted_table(checkpoint, tmp_path_factory.mktemp("tdq") / "t.bin").path) as opened:
        yield opened


@pytest.mark.parametrize("device", DEVICES)
def test_torch_dequant_matches_numpy_reference(table, device):
    ids = np.arange(table.num_rows)
    expected = bf16_bits_of_reference(table.values(ids))
    rows = torch.from_numpy(table.gather(ids)).to(device)
    values = decode(table.encoding, rows, table.values_per_row, table.scale)
    assert values.dtype == torch.bfloat16 and values.shape == expected.shape
    got = values.cpu().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_dequant_writes_into_out(table, device):
    ids = np.arange(0, table.num_rows, 7)
    decoder = decoder_for(table.encoding, table.values_per_row, table.scale, device)
    out = torch.full((len(ids), table.values_per_row), float("nan"), dtype=torch.bfloat16,
                     device=device)
    returned = decoder(torch.from_numpy(table.gather(ids)).to(device), out=out)
    assert returned.data_ptr() == out.data_ptr()
    expected = bf16_bits_of_reference(table.values(ids))
    assert np.array_equal(out.cpu().view(torch.int16).numpy().view(np.uint16), expected)


def test_torch_dequant_fp8_f32_scale_rounds_once():
    # An F32 scale (bits 0x39508888) for which a float32 multiply then a bf16 rounding gives 28
    # codes a different value than the single rounding the model does.
    scale = float(np.array([0x39508888], dtype=np.uint32).view(np.float32)[0])
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
    codes = codes[:, (codes[0] & 0x7F) != 0x7F]
    from ple_prep.runtime.dequant import decode as numpy_decode
    expected = bf16_bits_of_reference(numpy_decode(Encoding.FP8_E4M3, codes, codes.shape[1], scale))
    got = decode(Encoding.FP8_E4M3, torch.from_numpy(codes), codes.shape[1], scale)
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), expected)


def test_torch_dequant_refuses_double_registration_and_unknown_encodings(monkeypatch):
    with pytest.raises(TypeError, match="already registered"):
        class Again(TorchDecoder, encoding=Encoding.BF16):
            pass
    monkeypatch.delitem(TorchDecoder.registry, Encoding.BF16)
    with pytest.raises(NotImplementedError, match="no torch decoder for bf16"):
        decoder_for(Encoding.BF16, 160, None, "cpu")
