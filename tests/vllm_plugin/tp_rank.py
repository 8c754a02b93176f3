"""One tensor-parallel rank of tests/vllm_plugin/test_plugin.py's TP test, run as its own process.

    python tests/vllm_plugin/tp_rank.py RANK SIZE PORT TABLE_TEMPLATE CHECKPOINT VARIANT OUT.npz

Builds the layer with the plugin serving this rank's file, runs the test schedule, and saves each
step's PLE input (after the ranks' all-reduce) as int16 bits.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from worker import start_worker

rank, size, port = (int(arg) for arg in sys.argv[1:4])
template, checkpoint, variant, out = sys.argv[4], Path(sys.argv[5]), sys.argv[6], sys.argv[7]
# As in a vLLM worker: the plugins load before the model's modules are imported.
start_worker(rank, size, port)
from vllm_layer import build_layer, checkpoint_weights, ple_input, schedule, text_config, vllm_config  # noqa: E402

layer = build_layer(vllm_config(template), text_config(variant), checkpoint_weights(checkpoint))
assert layer.ngram_embedding.table.tensor_parallel == {"rank": rank, "size": size}
steps = [ple_input(layer, *step).view(torch.int16).numpy() for step in schedule()]
np.savez(out, *steps)
