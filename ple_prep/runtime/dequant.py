"""Row bytes to the values the model layer computes: one small decoder per encoding, numpy only.

The GGUF decoders repeat the float32 arithmetic of `gguf.quants.dequantize` step for step (d*q
then + m, never fused), so their values are equal bit for bit; the `gguf` package itself is not
imported, so the runtime needs numpy alone.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..core.constants import ENCODING_BLOCKS, Encoding


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
    with np.errstate(over="ignore"):  # past the largest bf16 rounds to infinity, as it should
        out = rounded.view(np.float64).astype(np.float32)
    # Below 2**-126 bf16 is subnormal: a fixed step of 2**-133, fewer than 8 significant bits.
    # Scaling by a power of two is exact, so np.round (half to even) rounds once there too.
    tiny = np.abs(values) < 2.0**-126
    if np.any(tiny):
        out[tiny] = (np.round(values[tiny] * 2.0**133) * 2.0**-133).astype(np.float32)
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


# IQ4_NL's non-linear 4-bit code book (ggml-common.h kvalues_iq4nl).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.float32)


def _blocks(rows: np.ndarray, encoding: Encoding) -> np.ndarray:
    """uint8 rows as `(rows * blocks per row, bytes per block)`."""
    return np.ascontiguousarray(rows).reshape(-1, ENCODING_BLOCKS[encoding][1])


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte `at` of each block, as float32 `(blocks, 1)`."""
    return blocks[:, at:at + 2].view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes a block to 32 codes: low nibbles are values 0-15, high nibbles values 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _fifth_bits(packed: np.ndarray) -> np.ndarray:
    """The 4-byte little-endian qh of Q5 blocks: bit j is the fifth bit of value j, as 0/16."""
    return np.unpackbits(packed, axis=1, bitorder="little") << 4


class GGUFF32(Decoder, encoding=Encoding.GGUF_F32):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        return np.ascontiguousarray(rows).view("<f4").astype(np.float32)


class GGUFF16(Decoder, encoding=Encoding.GGUF_F16):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        return np.ascontiguousarray(rows).view("<f2").astype(np.float32)


class GGUFBF16(BF16, encoding=Encoding.GGUF_BF16):
    """GGML's BF16 rows are the same bytes as a BF16 checkpoint's."""


class GGUFQ8_0(Decoder, encoding=Encoding.GGUF_Q8_0):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        values = blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks, 0)
        return values.reshape(len(rows), values_per_row)


class GGUFQ4_0(Decoder, encoding=Encoding.GGUF_Q4_0):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        codes = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        return (_f16(blocks, 0) * codes.astype(np.float32)).reshape(len(rows), values_per_row)


class GGUFQ4_1(Decoder, encoding=Encoding.GGUF_Q4_1):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        codes = _nibbles(blocks[:, 4:]).astype(np.float32)
        values = _f16(blocks, 0) * codes + _f16(blocks, 2)
        return values.reshape(len(rows), values_per_row)


class GGUFQ5_0(Decoder, encoding=Encoding.GGUF_Q5_0):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        codes = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
        return (_f16(blocks, 0) * codes.astype(np.float32)).reshape(len(rows), values_per_row)


class GGUFQ5_1(Decoder, encoding=Encoding.GGUF_Q5_1):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        codes = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
        values = _f16(blocks, 0) * codes + _f16(blocks, 2)
        return values.reshape(len(rows), values_per_row)


class GGUFIQ4_NL(Decoder, encoding=Encoding.GGUF_IQ4_NL):
    @classmethod
    def decode(cls, rows, values_per_row, scale):
        blocks = _blocks(rows, cls.encoding)
        values = _f16(blocks, 0) * IQ4_NL_VALUES[_nibbles(blocks[:, 2:])]
        return values.reshape(len(rows), values_per_row)


def decode(encoding: Encoding, rows: np.ndarray, values_per_row: int,
           scale: float | None) -> np.ndarray:
    """float32 `(len(rows), values_per_row)` values of uint8 rows in `encoding`."""
    try:
        decoder = Decoder.registry[encoding]
    except KeyError:
        raise NotImplementedError(f"no decoder for {encoding.label}") from None
    return decoder.decode(rows, values_per_row, scale)
