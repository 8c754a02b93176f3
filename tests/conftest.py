"""Shared fixtures: real checkpoints written with the safetensors library, built once per session."""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import settings
from support.faultfs import FaultFS, fuse_unavailable

from ple_prep.converters import open_source
from ple_prep.format import order as order_module
from ple_prep.format.layout import TableLayout
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder
from ple_prep.ngram import NgramSpec
from ple_prep.offline.ranks import convert_ranks
from ple_prep.offline.writer import WriteOptions, convert
from ple_prep.runtime import gather as gather_module
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


# Both compiled helpers (core/native/, runtime/native/) import here: built by setup.py where a C
# compiler was there (both or neither).
HELPER_BUILT = None not in (gather_module._native, gather_module._core_native, order_module._native)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_helper: skipped where the compiled helpers are not built "
                                       "(no C compiler at install)")
    config.addinivalue_line("markers", "needs_cuda: skipped where torch has no CUDA device")


def pytest_collection_modifyitems(config, items):
    cuda = None
    for item in items:
        if item.get_closest_marker("needs_helper") and not HELPER_BUILT:
            item.add_marker(pytest.mark.skip(reason="the compiled helper is not built here (no compiler at install)"))
        if item.get_closest_marker("needs_cuda"):
            cuda = _cuda_available() if cuda is None else cuda
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(params=[pytest.param("compiled", marks=pytest.mark.needs_helper), "numpy"])
def loops(request, monkeypatch):
    """The compiled helper's loops (core/native/, runtime/native/), or the numpy fallback of a machine
    built without a compiler: both must give the same results."""
    if request.param == "numpy":
        for module, name in ((gather_module, "_native"), (gather_module, "_core_native"), (order_module, "_native")):
            monkeypatch.setattr(module, name, None)
    return request.param


@dataclasses.dataclass
class ConvertedTable:
    path: Path
    manifest: dict[str, Any]
    spec: NgramSpec
    rows: np.ndarray | None  # the source's rows in source order, when asked for
    scale_raw: bytes | None  # the source's scale bytes (None without a scale)


def convert_checkpoint(checkpoint: Path, out: Path, *, placed: Any = None, options: WriteOptions | None = None,
                       with_rows: bool = False) -> ConvertedTable:
    """The one way tests make a prepared table: `checkpoint` converted to `out`, in source order or
    with the rows `placed` first (an array, or a function of (num_rows, spec) giving one)."""
    with open_source(checkpoint) as source:
        layout = None
        if placed is not None:
            chosen = placed(source.num_rows, source.spec) if callable(placed) else placed
            layout = TableLayout(RowOrder.from_placed(np.asarray(chosen), source.num_rows))
        manifest = convert(source, out, options, layout=layout)
        rows = source.read_rows(0, source.num_rows) if with_rows else None
        return ConvertedTable(Path(out), manifest, source.spec, rows,
                              source.scale.raw if source.scale is not None else None)


@pytest.fixture(scope="session")
def converted_table() -> Callable[..., ConvertedTable]:
    """`convert_checkpoint`, for tests and fixtures of any scope."""
    return convert_checkpoint


@pytest.fixture(scope="session")
def fp8_table(fp8_checkpoint, tmp_path_factory) -> Path:
    """The FP8 fixture converted in source order; tests only read it (copy it to change it)."""
    return convert_checkpoint(fp8_checkpoint, tmp_path_factory.mktemp("fp8-table") / "t.bin").path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="session")
def fp8_rank_tables(fp8_checkpoint, tmp_path_factory) -> Path:
    """The folder of the FP8 fixture converted with `--tp-size 2`: ple.tp0of2.bin and ple.tp1of2.bin
    (and their manifests); tests only read them."""
    folder = tmp_path_factory.mktemp("fp8-ranks")
    with open_source(fp8_checkpoint) as source:
        convert_ranks(source, folder / "ple.bin", 2)
    return folder


@pytest.fixture(scope="module")
def source_rows(fp8_checkpoint):
    """Every row of the FP8 fixture in source order, as the checkpoint holds them."""
    with open_source(fp8_checkpoint) as source:
        return source.read_rows(0, source.num_rows)


@pytest.fixture(scope="module")
def faultfs(fp8_table, tmp_path_factory):
    """The FP8 fixture table on a fault-injecting FUSE mount; skips where FUSE is unavailable."""
    why = fuse_unavailable()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("faulty")
    shutil.copyfile(fp8_table, folder / "t.bin")
    shutil.copyfile(manifest_path(fp8_table), manifest_path(folder / "t.bin"))
    try:
        with FaultFS(folder) as fs:
            yield fs
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            pytest.skip(str(exc))
        raise


@pytest.fixture
def faults(faultfs):
    """The fault file system with no fault injected before and after the test."""
    faultfs.clear()
    yield faultfs
    faultfs.clear()


@pytest.fixture
def small_disk(tmp_path, request):
    """Mount a tmpfs of `request.param` bytes; skip (with the reason) where that is not possible."""
    if os.geteuid() != 0:
        pytest.skip("full-disk test needs root to mount a small tmpfs (run the suite as root)")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs",
                           str(mount_point)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"full-disk test could not mount a tmpfs: {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)
