"""Row bytes to the values the model layer computes: one small decoder per encoding, numpy only."""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..constants import Encoding


def _e4m3_table() -> np.ndarray:
    """float32 value of each e4m3fn byte (bias 7, no infinities, 0x7f/0xff are NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6,
                         (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = sign * magnitude
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=np.float32)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float64 values once, to nearest-even bf16, returned as float32.

    Rounding straight from float64 avoids the double rounding a float32 step would add when the
    exact product needs more than 24 bits (an F32 scale).
    """
    values = np.asarray(values, dtype=np.float64)
    bits = values.view(np.uint64)
    # bf16 keeps 8 significant bits; float64 has 53, so 45 bits go, rounding half to even.
    keep_lsb = (bits >> np.uint64(45)) & np.uint64(1)
    rounded = (bits + np.uint64((1 << 44) - 1) + keep_lsb) & ~np.uint64((1 << 45) - 1)
    out = rounded.view(np.float64).astype(np.float32)
    return np.where(np.isnan(values), np.float32(np.nan), out)


class Decoder:
    """Decodes rows of one encoding; subclasses register themselves by encoding."""

    encoding: ClassVar[Encoding]
    registry: ClassVar[dict[Encoding, type["Decoder"]]] = {}

    def __init_subclass__(cls, encoding: Encoding, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if encoding in Decoder.registry:
            raise TypeError(f"a decoder for {encoding.label} is already registered")
        cls.encoding = encoding
        Decoder.registry[encoding] = cls

    @classmethod
    def decode(cls, rows: np.ndarray, values_per_row: int, scale: float | None) -> np.ndarray:
        raise NotImplementedError


class FP8E4M3(Decoder, encoding=Encoding.FP8_E4M3):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        # e4m3 (4 significant bits) times the scale is exact in float64; round once to bf16.
        return round_to_bf16(E4M3_VALUES[rows].astype(np.float64) * float(scale))


class BF16(Decoder, encoding=Encoding.BF16):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        return bf16_bits_to_float32(np.ascontiguousarray(rows).view("<u2"))


class NVFP4Packed(Decoder, encoding=Encoding.NVFP4_PACKED):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        code_bytes = values_per_row // 2
        codes = rows[:, :code_bytes]
        # Element 2k sits in the low nibble of byte k.
        nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(len(rows), values_per_row)
        block_scales = E4M3_VALUES[rows[:, code_bytes:]]
        scaled = E2M1_VALUES[nibbles] * np.repeat(block_scales, 16, axis=1)
        return scaled * np.float32(scale)


def decode(encoding: Encoding, rows: np.ndarray, values_per_row: int,
           scale: float | None) -> np.ndarray:
    """float32 `(len(rows), values_per_row)` values of uint8 rows in `encoding`."""
    try:
        decoder = Decoder.registry[encoding]
    except KeyError:
        raise NotImplementedError(f"no decoder for {encoding.label}") from None
    return decoder.decode(rows, values_per_row, scale)
