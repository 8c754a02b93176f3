"""bf16 bits, for the tests that compare values served as torch tensors with `Table.values` bit for bit."""
from __future__ import annotations

import numpy as np
import torch

from ple_prep.runtime.dequant import round_to_bf16


def expected_bits(table, ids: np.ndarray) -> np.ndarray:
    """bf16 bits of each id's values in id order, flat, rounded as the model rounds."""
    values = table.values(ids.reshape(-1))
    return (round_to_bf16(values.astype(np.float64)).view(np.uint32) >> 16).astype(np.uint16).reshape(-1)


def bits(tensor) -> np.ndarray:
    return tensor.cpu().reshape(-1).view(torch.int16).numpy().view(np.uint16)
