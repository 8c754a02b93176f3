"""The device half of EmbeddingSource as CUDA graphs: one captured per size (and with or without the
span's copy), replayed by an eager `finish`; the index and decode that the graphs hold."""
from __future__ import annotations

import torch

# Up to this many ids, `start` does its host work inline (a hop to the worker thread costs more)
# and copies on the caller's stream, inside `finish`'s graph when `source(ids)` calls both.
INLINE_IDS = 1024
# An eager `finish` replays a graph captured for the count rounded up to a power of two, at least
# this (a decode step's 16 ids): one launch instead of a handful, each 5-15 us of host time on the
# H200's host, and a Triton launch from Python costs more than the chunk's replay.
GRAPH_MIN_IDS = 16


class GraphsMixin:
    """EmbeddingSource's graph cache and device half (source.py builds the buffers it uses)."""

    def _graph_size(self, count: int) -> int:
        """The positions of the graph an eager finish of `count` positions replays."""
        return min(self.capacity, max(GRAPH_MIN_IDS, 1 << (count - 1).bit_length()))


    def _output_view(self, count: int) -> torch.Tensor:
        """output[:count]; for a small request (a decode step's, every step) made once."""
        if count > INLINE_IDS:
            return self.output[:count]
        view = self._small_outputs.get(count)
        if view is None:
            view = self._small_outputs[count] = self.output[:count]
        return view

    def _index_and_decode(self, count: int) -> torch.Tensor:
        if self._fused is not None:
            values = self.output[:count]
            self._fused(self._tiers, self._index[:count], values)
            return values
        rows = torch.index_select(self._tiers, 0, self._index[:count], out=self._rows[:count])
        values = self.output[:count]
        self._decoder(rows, out=values)
        return values

    def _capture(self, size: int, with_copy: bool, stream) -> torch.cuda.CUDAGraph:
        """The device half for `size` positions as a CUDA graph, captured once per size; `with_copy`:
        preceded by the copy of the span's part that `size` positions can use (their rows fill the
        staging rows from the end) and with the events the copy waits for and marks."""
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(self.device)
        capture.wait_stream(stream)
        with torch.cuda.stream(capture):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                if with_copy:
                    self._launch_copy(((self.capacity - size) * self.table.row_bytes, self._index_at + 4 * size),
                                      capture)
                self._index_and_decode(size)
                if with_copy:
                    self._consumed.record(capture)
            finally:
                graph.capture_end()
        stream.wait_stream(capture)
        self._graphs[(size, with_copy)] = graph
        if with_copy and self._context is not None and hasattr(graph, "raw_cuda_graph_exec"):
            self._graph_execs[size] = graph.raw_cuda_graph_exec()
        return graph

