"""Row bytes to bf16 values on a torch device: one decoder per encoding, keyed by `Encoding`.

Each decoder must give, bit for bit, `runtime.dequant`'s numpy reference rounded to bf16 (the
reference's FP8 and BF16 values already are bf16). A decoder is built once per table and device,
so constants (lookup tables, scales) are uploaded once; calling it only launches kernels and never
synchronises, so it can be captured in a CUDA graph.

To add an encoding, subclass `TorchDecoder` with `encoding=...`:

    class Q8_0(TorchDecoder, encoding=Encoding.GGUF_Q8_0):
        def __init__(self, values_per_row, scale, device): ...
        def decode(self, rows): ...   # uint8 (N, row_bytes) -> bf16 (N, values_per_row)

Imports torch: import this module only where torch is installed.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ...core.constants import ENCODING_BLOCKS, Encoding
from .. import dequant


class TorchDecoder:
    """Decodes uint8 rows of one encoding into bf16 on one device."""

    encoding: ClassVar[Encoding]
    registry: ClassVar[dict[Encoding, type["TorchDecoder"]]] = {}

    def __init_subclass__(cls, encoding: Encoding, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if encoding in TorchDecoder.registry:
            raise TypeError(f"a torch decoder for {encoding.label} is already registered")
        cls.encoding = encoding
        TorchDecoder.registry[encoding] = cls

    def __init__(self, values_per_row: int, scale: float | None, device: torch.device | str):
        self.values_per_row = values_per_row
        self.scale = scale
        self.device = torch.device(device)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """bf16 `(len(rows), values_per_row)` of uint8 `(len(rows), row_bytes)` on self.device."""
        raise NotImplementedError

    def __call__(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        values = self.decode(rows)
        if out is None:
            return values
        out.copy_(values)
        return out


class FP8E4M3(TorchDecoder, encoding=Encoding.FP8_E4M3):
    def __init__(self, values_per_row, scale, device):
        super().__init__(values_per_row, scale, device)
        # All 256 codes decoded once by the numpy reference: exact by construction, whatever the
        # scale's dtype (an F32 scale would round twice through a float32 multiply on the device).
        codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
        bits = dequant.decode(Encoding.FP8_E4M3, codes, 256, scale).view(np.uint32) >> 16
        self.lookup = torch.from_numpy(bits.astype(np.int16).reshape(256)).view(
            torch.bfloat16).to(self.device)

    def decode(self, rows):
        return self.lookup[rows.long()]

    def __call__(self, rows, out=None):
        if out is None or not out.is_contiguous():
            return super().__call__(rows, out)
        # One gather straight into `out`, with 32-bit indices: the bulk of a prefill chunk's decode.
        torch.index_select(self.lookup, 0, rows.reshape(-1).to(torch.int32), out=out.view(-1))
        return out


class BF16(TorchDecoder, encoding=Encoding.BF16):
    def decode(self, rows):
        return rows.contiguous().view(torch.bfloat16)


class NVFP4Packed(TorchDecoder, encoding=Encoding.NVFP4_PACKED):
    def __init__(self, values_per_row, scale, device):
        super().__init__(values_per_row, scale, device)
        self.e2m1 = torch.from_numpy(dequant.E2M1_VALUES).to(self.device)
        self.e4m3 = torch.from_numpy(dequant.E4M3_VALUES).to(self.device)
        self.global_scale = torch.tensor(float(np.float32(scale)), dtype=torch.float32,
                                         device=self.device)

    def decode(self, rows):
        code_bytes = self.values_per_row // 2
        codes = rows[:, :code_bytes].long()
        # Element 2k sits in the low nibble of byte k.
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(len(rows), self.values_per_row)
        block_scales = self.e4m3[rows[:, code_bytes:].long()].repeat_interleave(16, dim=1)
        # Same float32 operations, in the same order, as the numpy reference; then one rounding.
        values = self.e2m1[nibbles] * block_scales * self.global_scale
        return values.to(torch.bfloat16)


# --- GGUF types: the numpy reference's float32 steps (d*q, then + m, never fused), then bf16 ----


def _gguf_blocks(rows: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    return rows.contiguous().view(-1, ENCODING_BLOCKS[encoding][1])


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian f16 at byte `at` of each block as float32 `(blocks, 1)`."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes a block to 32 codes: low nibbles are values 0-15, high nibbles values 16-31."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


class _GGUFDecoder(TorchDecoder, encoding=Encoding.GGUF_F32):
    """F32 rows; the base of the other GGUF decoders, which replace `decode_float32`."""

    def __init__(self, values_per_row, scale, device):
        super().__init__(values_per_row, scale, device)
        # Q5's qh: value j's fifth bit is bit j % 8 of byte j // 8 (a little-endian u32).
        self.qh_byte = torch.arange(32, device=self.device) // 8
        self.qh_shift = (torch.arange(32, device=self.device) % 8).to(torch.uint8)

    def _fifth_bits(self, packed: torch.Tensor) -> torch.Tensor:
        return ((packed[:, self.qh_byte] >> self.qh_shift) & 1) << 4

    def decode_float32(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.contiguous().view(torch.float32)

    def decode(self, rows):
        return self.decode_float32(rows).reshape(len(rows), self.values_per_row).to(torch.bfloat16)


class _GGUFF16(_GGUFDecoder, encoding=Encoding.GGUF_F16):
    def decode_float32(self, rows):
        return rows.contiguous().view(torch.float16).float()


class _GGUFBF16(_GGUFDecoder, encoding=Encoding.GGUF_BF16):
    def decode(self, rows):
        return rows.contiguous().view(torch.bfloat16)


class _GGUFQ8_0(_GGUFDecoder, encoding=Encoding.GGUF_Q8_0):
    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


class _GGUFQ4_0(_GGUFDecoder, encoding=Encoding.GGUF_Q4_0):
    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


class _GGUFQ4_1(_GGUFDecoder, encoding=Encoding.GGUF_Q4_1):
    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


class _GGUFQ5_0(_GGUFDecoder, encoding=Encoding.GGUF_Q5_0):
    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        codes = _nibbles(blocks[:, 6:]) | self._fifth_bits(blocks[:, 2:6])
        return _f16(blocks, 0) * (codes.float() - 16)


class _GGUFQ5_1(_GGUFDecoder, encoding=Encoding.GGUF_Q5_1):
    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        codes = _nibbles(blocks[:, 8:]) | self._fifth_bits(blocks[:, 4:8])
        return _f16(blocks, 0) * codes.float() + _f16(blocks, 2)


class _GGUFIQ4_NL(_GGUFDecoder, encoding=Encoding.GGUF_IQ4_NL):
    def __init__(self, values_per_row, scale, device):
        super().__init__(values_per_row, scale, device)
        self.code_book = torch.from_numpy(dequant.IQ4_NL_VALUES).to(self.device)

    def decode_float32(self, rows):
        blocks = _gguf_blocks(rows, self.encoding)
        return _f16(blocks, 0) * self.code_book[_nibbles(blocks[:, 2:]).long()]


def decoder_for(encoding: Encoding | str, values_per_row: int, scale: float | None,
                device: torch.device | str) -> TorchDecoder:
    """The decoder of `encoding` with its constants on `device`."""
    if isinstance(encoding, str):
        encoding = Encoding.from_label(encoding)
    try:
        decoder = TorchDecoder.registry[encoding]
    except KeyError:
        raise NotImplementedError(f"no torch decoder for {encoding.label}") from None
    return decoder(values_per_row, scale, device)


def decode(encoding: Encoding | str, rows: torch.Tensor, values_per_row: int,
           scale: float | None) -> torch.Tensor:
    """bf16 `(len(rows), values_per_row)` values of uint8 rows, on the rows' device."""
    return decoder_for(encoding, values_per_row, scale, rows.device)(rows)
