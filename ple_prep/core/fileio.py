"""Positioned reads that fill a buffer completely or say where the file ended. Standard library only."""
from __future__ import annotations

import os

from .errors import BadInput


def read_exactly(descriptor: int, buffer: memoryview, offset: int, name: str) -> None:
    """Fill `buffer` from `offset`; a file that ends first (truncated) is BadInput, never a short read."""
    while len(buffer):
        count = os.preadv(descriptor, [buffer], offset)
        if count <= 0:
            raise BadInput(f"{name} ended early at byte {offset}: the file was truncated")
        buffer, offset = buffer[count:], offset + count
