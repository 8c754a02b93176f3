"""One tensor-parallel rank of tests/vllm_plugin/test_plugin.py's failed-rank test, run as its own process.

    python tests/vllm_plugin/failed_rank.py RANK SIZE PORT TABLE_TEMPLATE CHECKPOINT INSTANCE_ID IDS

Builds the layer with the plugin serving this rank's copy of its file (the disk tier only) and
serves a step. Then the last rank's file shrinks and every rank serves the next step, the ranks'
all-reduce included: the last rank's lookup fails. Each rank prints whether its step's values hold
NaN and what checking the lookups raised, as vLLM's worker checks them before it hands a step's
output over. IDS `shared`: the engine's config reaches every rank, its instance id included; `each`:
each rank's config has an id of its own, as each data-parallel replica's under vLLM's Ray launcher
and each process's under torchrun.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from worker import start_worker

rank, size, port = (int(arg) for arg in sys.argv[1:4])
template, checkpoint, instance_id, ids = sys.argv[4], Path(sys.argv[5]), sys.argv[6], sys.argv[7]
start_worker(rank, size, port)
from vllm_layer import build_layer, checkpoint_weights, ple_input, schedule, text_config, vllm_config  # noqa: E402

from ple_prep.integrations.vllm import traffic  # noqa: E402

config = vllm_config(template, resident_bytes=0, read_path="direct")
config.instance_id = f"{instance_id}-{rank}" if ids == "each" else instance_id
layer = build_layer(config, text_config("fp8"), checkpoint_weights(checkpoint))
steps = list(schedule())
ple_input(layer, *steps[0])
traffic.raise_failed_lookups()  # nothing failed yet
torch.distributed.barrier()
if rank == size - 1:
    table = layer.ngram_embedding.table
    os.truncate(table.path, table.header.data_offset)
torch.distributed.barrier()
values = ple_input(layer, *steps[1])
print(f"rank {rank} step: NaN values {bool(torch.isnan(values.float()).any())}")
try:
    traffic.raise_failed_lookups()
except Exception as error:  # noqa: BLE001 (printed for the test)
    print(f"rank {rank} check: {type(error).__name__}: {error}")
    sys.exit(0)
print(f"rank {rank} check: nothing raised")
