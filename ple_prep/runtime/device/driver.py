"""The device package's calls past torch's public API, in one place: the compiled helper's CUDA
driver calls (runtime/native/cuda.c), the step kernels' module, the current stream's raw handle and
a graph's exec.

Each CUDA call through torch costs host time on every step (BENCHMARKS.md, "Decode step and
prefill chunk on an H200"; the single calls in docs/benchmark-history.md), so the copies a start
from device ids queues go to the driver directly. The helper opens libcuda itself, at the first call; torch has
loaded it by then. Imports no torch: the callers pass torch's objects in.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

try:
    from .. import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

STEP_KERNELS_PTX = Path(__file__).resolve().parent.parent / "native" / "step_kernels.ptx"
_log = logging.getLogger(__name__)


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


def raw_stream_of(torch, ordinal: int):
    """A function giving device `ordinal`'s current stream as a raw handle. torch's private call
    where it has one: `torch.cuda.current_stream` builds a Stream object on every call, which
    costs more than the driver call it feeds."""
    private = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if private is not None:
        return functools.partial(private, ordinal)
    return lambda: torch.cuda.current_stream(ordinal).cuda_stream


def graph_exec(graph) -> int | None:
    """A captured torch CUDA graph's exec handle for the helper to launch, or None where this torch
    does not hand it out (the graph is then replayed through torch)."""
    return graph.raw_cuda_graph_exec() if hasattr(graph, "raw_cuda_graph_exec") else None


def load_step_kernels(context: int) -> tuple[int, int, int] | None:
    """The step kernels (runtime/native/step_kernels.cu) loaded into `context`: (module,
    step_request, step_fetch), or None where the driver cannot load them (logged): the caller's
    steps then all go through its side stream."""
    try:
        return _native.step_kernels(context, STEP_KERNELS_PTX.read_bytes())
    except (OSError, RuntimeError) as error:
        _log.warning("the PLE step kernels are not used, every step goes through the side stream: %s", error)
        return None
