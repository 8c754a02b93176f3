"""The device half of EmbeddingSource as CUDA graphs: one captured per size, with or without the
span's copy, replayed by an eager `finish`."""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator

import torch

from .buffers import DeviceBuffers
from .driver import graph_exec

# Up to this many ids, `start` does its host work inline (a hop to the worker thread costs more)
# and copies on the caller's stream, inside `finish`'s graph when `source(ids)` calls both.
INLINE_IDS = 1024
# An eager `finish` replays a graph captured for the count rounded up to a power of two, at least
# this (a decode step's 16 ids): one launch instead of a handful, each costing host time, and a
# Triton launch from Python costs more than a chunk's replay (BENCHMARKS.md, "Decode step and
# prefill chunk on an H200").
GRAPH_MIN_IDS = 16


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No automatic garbage collection inside: a collection during a capture that frees a CUDA
    graph (or anything else whose finalizer calls CUDA) ends the capture with an error. torch's own
    `torch.cuda.graph` collects before it captures instead, which would cost every first finish of
    a size a full collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphCache:
    """Graphs of the device half by (positions, with the span's copy); `execs`: their exec handles
    by the same keys, where torch hands them out, for the compiled helper to launch."""

    def __init__(self, buffers: DeviceBuffers, device: torch.device, device_half: Callable[[int], torch.Tensor]):
        self._buffers = buffers
        self._device = device
        self._device_half = device_half
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.execs: dict[tuple[int, bool], int] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def size_for(self, count: int) -> int:
        """The positions of the graph an eager finish of `count` positions replays."""
        return min(self._buffers.capacity, max(GRAPH_MIN_IDS, 1 << (count - 1).bit_length()))

    def output_view(self, count: int) -> torch.Tensor:
        """output[:count], made once per count (a slice costs a finish's host more than its launch;
        at most `capacity` small views)."""
        view = self._outputs.get(count)
        if view is None:
            view = self._outputs[count] = self._buffers.output[:count]
        return view

    def capture(self, size: int, with_copy: bool, stream) -> torch.cuda.CUDAGraph:
        """The device half for `size` positions as a CUDA graph, captured once per size; `with_copy`:
        preceded by the copy of the span's part that `size` positions can use (their rows fill the
        staging rows from the end) and with the events the copy waits for and marks."""
        buffers = self._buffers
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(self._device)
        capture.wait_stream(stream)
        with torch.cuda.stream(capture), _no_collection():
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                if with_copy:
                    buffers.launch_copy(buffers.span_of(size, size), capture)
                self._device_half(size)
                if with_copy:
                    buffers.consumed.record(capture)
            finally:
                graph.capture_end()
        stream.wait_stream(capture)
        self.graphs[(size, with_copy)] = graph
        handle = graph_exec(graph)
        if handle:  # None where torch hands none out
            self.execs[(size, with_copy)] = handle
        return graph
