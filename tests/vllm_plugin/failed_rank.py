"""One tensor-parallel rank of tests/vllm_plugin/test_plugin.py's failed-rank test, run as its own process.

    python tests/vllm_plugin/failed_rank.py RANK SIZE PORT TABLE_TEMPLATE CHECKPOINT INSTANCE_ID IDS [RECORDS]

Builds the layer with the plugin serving this rank's copy of its file (the disk tier only) and
serves a step. Then the last rank's file shrinks and every rank serves the next step, the ranks'
all-reduce included: the last rank's lookup fails. Each rank prints whether its step's values hold
NaN and what checking the lookups raised, as vLLM's worker checks them before it hands a step's
output over; then what its worker raises where vLLM, with VLLM_RAISE_ON_LOGIT_NANS, raises at a step
whose logits hold NaN (counted here in the values they are computed from). IDS `shared`: the
engine's config reaches every rank, its instance id included; `each`: each rank's config has an id
of its own, as each data-parallel replica's under vLLM's Ray launcher and each process's under
torchrun; `hosts`: as `shared`, but each rank keeps its records in a folder of its own
(RECORDS/rank{RANK}), as ranks on two hosts do.
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch
from worker import start_worker

rank, size, port = (int(arg) for arg in sys.argv[1:4])
template, checkpoint, instance_id, ids = sys.argv[4], Path(sys.argv[5]), sys.argv[6], sys.argv[7]
start_worker(rank, size, port)
from vllm.v1.worker.utils import raise_if_nan_logits  # noqa: E402
from vllm_layer import build_layer, checkpoint_weights, ple_input, schedule, text_config, vllm_config  # noqa: E402

from ple_prep.integrations.vllm import failures, traffic  # noqa: E402

if ids == "hosts":
    records = Path(sys.argv[8]) / f"rank{rank}"
    records.mkdir(parents=True, exist_ok=True)
    failures.records_folder = lambda: records
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
    print(f"rank {rank} check: nothing raised")
except Exception as error:  # noqa: BLE001 (printed for the test)
    print(f"rank {rank} check: {type(error).__name__}: {error}")


class Worker:  # vLLM 0.33.0's worker (vllm/v1/worker/gpu_worker.py), whose runner raises on NaN logits
    def sample_tokens(self, grammar_output):
        nans = torch.isnan(values.float()).sum(dim=-1)
        raise_if_nan_logits({f"request-{k}": int(count) for k, count in enumerate(nans)})


traffic.install_output_check(types.SimpleNamespace(Worker=Worker))
try:
    Worker().sample_tokens(None)
    print(f"rank {rank} logits check: nothing raised")
except Exception as error:  # noqa: BLE001 (printed for the test)
    print(f"rank {rank} logits check: {type(error).__name__}: {error}")
