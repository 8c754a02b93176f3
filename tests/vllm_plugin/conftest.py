"""Tests of the vLLM plugin; they run where vLLM imports (scripts/vllm-test-env.sh) and skip elsewhere."""
from __future__ import annotations

import os

import pytest

# vLLM decides its platform at import; these tests run its CPU paths.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def vllm_groups():
    """vLLM's process groups for one rank (gloo), and its general plugins loaded, as in a worker."""
    from worker import start_worker

    start_worker()
