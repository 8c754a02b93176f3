"""FP8 rows picked from the tiers and decoded to bf16 in one GPU kernel (Triton).

The torch path (device/buffers.py, PickAndDecode) copies each position's row with `index_select`,
widens every code to int32 and looks it up with a second `index_select`: three passes over a chunk's
bytes, most of what `finish` adds to the stream (BENCHMARKS.md, "Decode step and prefill chunk on an
H200"). This kernel reads each position's codes once and writes bf16 through the 256-entry table
the torch decoder builds (device/dequant.py), so its values are the same bits.

Used on CUDA devices where Triton is installed (torch's CUDA wheels bring it); elsewhere the torch
path runs. Imported only from device/buffers.py.
"""
from __future__ import annotations

import importlib.util

import torch

from ...core.constants import Encoding

# Positions per program, and the power of two that covers a row's codes.
BLOCK_POSITIONS = 16


def fp8_gather_for(decoder, row_bytes: int, device: torch.device):
    """`gather(tiers, index, out)` for FP8 rows on a CUDA device with Triton, else None.

    `decoder` is the table's torch decoder (an FP8 one's `lookup`: the 256 codes' bf16 values);
    `tiers` uint8 (rows, row_bytes), `index` int32 tier rows, `out` bf16 (len(index), row_bytes): an
    FP8 row holds one byte a value."""
    if (decoder.encoding != Encoding.FP8_E4M3 or device.type != "cuda"
            or importlib.util.find_spec("triton") is None):
        return None
    kernel = _kernel()
    bits = decoder.lookup.view(torch.int16)
    columns = 1 << (row_bytes - 1).bit_length()

    def gather(tiers: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        count = len(index)
        if count:
            kernel[(-(-count // BLOCK_POSITIONS),)](tiers, index, bits, out.view(torch.int16), count,
                                                   ROW_BYTES=row_bytes, COLUMNS=columns,
                                                   BLOCK_POSITIONS=BLOCK_POSITIONS)

    return gather


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["count"])
    def fp8_gather(tiers, index, lookup, out, count, ROW_BYTES: tl.constexpr, COLUMNS: tl.constexpr,
                   BLOCK_POSITIONS: tl.constexpr):
        positions = tl.program_id(0) * BLOCK_POSITIONS + tl.arange(0, BLOCK_POSITIONS)
        inside = positions < count
        rows = tl.load(index + positions, mask=inside, other=0).to(tl.int64)
        columns = tl.arange(0, COLUMNS)
        mask = inside[:, None] & (columns[None, :] < ROW_BYTES)
        codes = tl.load(tiers + rows[:, None] * ROW_BYTES + columns[None, :], mask=mask, other=0)
        values = tl.load(lookup + codes.to(tl.int32), mask=mask, other=0)
        tl.store(out + positions.to(tl.int64)[:, None] * ROW_BYTES + columns[None, :], values, mask=mask)

    return fp8_gather
