"""Shared fixtures: real checkpoints written with the safetensors library, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import settings

from ple_prep.converters import open_source
from ple_prep.offline.writer import convert
from ple_prep.tools.fixtures import make_checkpoint

# Every run replays the same fuzz examples, so a red build always reproduces and CI never flakes.
settings.register_profile("replayable", derandomize=True, database=None)
settings.load_profile("replayable")


@pytest.fixture(scope="session")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", "fp8")


@pytest.fixture(scope="session")
def bf16_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", "bf16")


@pytest.fixture(scope="session")
def nvfp4_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("nvfp4") / "ckpt", "nvfp4")


@pytest.fixture(scope="session")
def fp8_table(fp8_checkpoint, tmp_path_factory) -> Path:
    """The FP8 fixture converted in source order; tests only read it (copy it to change it)."""
    path = tmp_path_factory.mktemp("fp8-table") / "t.bin"
    with open_source(fp8_checkpoint) as source:
        convert(source, path)
    return path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()
