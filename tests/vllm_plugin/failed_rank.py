"""One tensor-parallel rank of tests/vllm_plugin/test_plugin.py's failed-rank test, run as its own process.

    python tests/vllm_plugin/failed_rank.py RANK SIZE PORT TABLE_TEMPLATE CHECKPOINT INSTANCE_ID

Builds the layer with the plugin serving this rank's copy of its file (the disk tier only, read with
O_DIRECT) and serves a step. Then the last rank's file shrinks and that rank's next lookup fails,
alone (no all-reduce: on the CPU the failed lookup raises before it). After a barrier every rank
checks the lookups as vLLM's worker does before it hands a step's output over, and prints what that
raised.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from worker import start_worker

rank, size, port = (int(arg) for arg in sys.argv[1:4])
template, checkpoint, instance_id = sys.argv[4], Path(sys.argv[5]), sys.argv[6]
start_worker(rank, size, port)
from vllm_layer import build_layer, checkpoint_weights, ple_input, schedule, text_config, vllm_config  # noqa: E402

from ple_prep.integrations.vllm import traffic  # noqa: E402

config = vllm_config(template, resident_bytes=0, read_path="direct")
config.instance_id = instance_id  # as the engine's config reaches every worker
layer = build_layer(config, text_config("fp8"), checkpoint_weights(checkpoint))
steps = list(schedule())
ple_input(layer, *steps[0])
traffic.raise_failed_lookups()  # nothing failed yet
torch.distributed.barrier()
if rank == size - 1:
    storage = layer.ngram_embedding
    table = storage.table
    os.truncate(table.path, table.header.data_offset)
    first, _stop = table.row_range
    try:
        storage.rows.start(torch.arange(first, first + 32, dtype=torch.int64).view(-1, 16))
        storage.rows.finish()
    except OSError as error:
        print(f"rank {rank} raised: {error}")
torch.distributed.barrier()
try:
    traffic.raise_failed_lookups()
except Exception as error:  # noqa: BLE001 (printed for the test)
    print(f"rank {rank} check: {type(error).__name__}: {error}")
    sys.exit(0)
print(f"rank {rank} check: nothing raised")
