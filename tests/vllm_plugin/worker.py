"""What a vLLM worker does before it builds a model, for one process of the plugin's tests and benches:
load the general plugins (the installed `vllm.general_plugins` entry points) and make vLLM's process
groups over gloo on the loopback."""
from __future__ import annotations

import os
import socket

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_worker(rank: int = 0, size: int = 1, port: int | None = None) -> None:
    """Plugins loaded, then tensor-parallel groups of `size` ranks (this one `rank`) over gloo."""
    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
        initialize_model_parallel(size, 1)
