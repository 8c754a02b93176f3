"""The compiled helper's calls into the CUDA driver (runtime/native/cuda.c), for the device package.

Each CUDA call through torch costs 5-15 us of host time on the H200's host (BENCHMARKS.md), so the
copies a start from device ids queues on every step go to the driver directly. The helper opens
libcuda itself, at the first call; torch has loaded it by then.
"""
from __future__ import annotations

import functools

try:
    from .. import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None


@functools.cache  # the driver retains the context once per device, not once per source
def device_context(ordinal: int) -> int:
    """The CUDA primary context of device `ordinal` (the one torch uses), as an int; OSError where
    the compiled helper or the CUDA driver is missing."""
    if _native is None:
        raise OSError("the compiled helper (runtime/native/) is not built")
    return _native.device_context(ordinal)


def queue_ids_copy(context: int, stream: int, event: int, target: int, source: int, size: int, flag: int,
                   flag_source: int) -> None:
    """Queue on `stream` the copy of `size` bytes from device address `source` into pinned host
    memory at `target`, then, unless `flag_source` is 0, of the int32 at device address
    `flag_source` into pinned `flag`, then a record of `event` (raw CUDA handles as ints)."""
    _native.queue_ids_copy(context, stream, event, target, source, size, flag, flag_source)
