"""Tests of the vLLM plugin; they run where vLLM imports (scripts/vllm-test-env.sh) and skip elsewhere."""
from __future__ import annotations

import os
import socket

import pytest

# vLLM decides its platform at import; these tests run its CPU paths.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def vllm_groups():
    """vLLM's process groups for one rank (gloo), and its general plugins loaded, as in a worker."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
