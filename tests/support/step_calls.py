"""A StepLookup's steps as the tests drive them: real-text-like ids, every rewritten buffer poisoned,
one step started and finished, or captured in one CUDA graph."""
from __future__ import annotations

import numpy as np
import torch

from ple_prep.ngram import row_ids


def token_ids(table, tokens: int, seed: int) -> np.ndarray:
    """(tokens, heads) row ids of random tokens under the table's hash (`table.spec`)."""
    return row_ids(np.random.default_rng(seed).integers(0, 5000, tokens), table.spec)


def poison(lookup) -> None:
    """Every buffer a step rewrites: the output, the staged rows on both sides, the ids' pinned copy."""
    buffers = lookup.buffers
    lookup.output.fill_(float("nan"))
    buffers.host_rows[1:].fill(0xFF)
    buffers.tiers[lookup.num_resident + 1:].fill_(0xFF)
    lookup.host_ids.fill(-1)


def serve(lookup, ids: np.ndarray) -> torch.Tensor:
    """One step of `ids` (the device waited for), its values."""
    lookup.start(torch.from_numpy(ids.reshape(-1).copy()).to(lookup.device))
    values = lookup.finish()
    if lookup.device.type == "cuda":
        torch.cuda.synchronize()
    return values


def captured_step(lookup, ids: torch.Tensor, consumer: torch.Tensor, finish_in_same_graph: bool = True):
    """`lookup`'s start of `ids` and its finish, the values copied into `consumer`, captured in one CUDA
    graph on a side stream (as torch captures): the graph, which serves whatever `ids` holds at each replay."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        lookup.start(ids, finish_in_same_graph=finish_in_same_graph)
        consumer.copy_(lookup.finish())
    torch.cuda.current_stream().wait_stream(stream)
    return graph
