"""Crash safety: real `ple-prep convert` processes killed with SIGKILL at many points.

After every kill, no destination name may open as a table unless it is complete and bit-exact; a
rerun of the same command succeeds, removes what the killed run left, and loses no row. Kill
points come from three sources: trace events (just before each rename), the partial file's size
(polled), and delays spread over a whole run. Every other rerun passes --resume. PLE_KILL_POINTS raises
the number of delays for a longer stress run (docs/RELIABILITY.md); the default keeps the suite fast.
"""
from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.killing import file_size_at_least, kill, reap, start_cli, wait_until

from ple_prep.cli import cli
from ple_prep.core.errors import BadInput
from ple_prep.format.manifest import manifest_path
from ple_prep.offline.verify import verify
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint

DELAY_KILLS = int(os.environ.get("PLE_KILL_POINTS", "6"))


def _start(args: list[str], kill_at_rename: int = 0) -> subprocess.Popen:
    # Rename 1 lands exactly before the data rename, 2 between the data and manifest renames.
    return start_cli(["convert", *args, "-q"], kill_at_rename=kill_at_rename)


def _kill_after(process: subprocess.Popen, seconds: float) -> None:
    time.sleep(seconds)
    kill(process)


def _kill_at_partial_size(process: subprocess.Popen, folder: Path, size: int) -> None:
    wait_until(file_size_at_least(folder, ".t.bin.*.partial", size), timeout=30, process=process)
    kill(process)


def _state(out: Path) -> str:
    """What the killed run left at the destination names, after checking that nothing half-made opens."""
    data, manifest = out.exists(), manifest_path(out).exists()
    if data and manifest:
        try:
            with open_table(out):
                return "published"
        except BadInput:
            return "refused"  # new data beside the previous conversion's manifest
    if data or manifest:
        with pytest.raises(BadInput):
            open_table(out)
        return "between renames"
    partials = list(out.parent.glob(f".{out.name}*.partial"))
    return "writing" if partials else "before"


def _assert_exact(out: Path, model: Path) -> None:
    report = verify(out, model)
    assert report.ok, report.to_json()
    assert report.rows_compared == FIXTURE_ROWS
    assert report.mismatched_rows == 0


def _rerun_succeeds(runner, args: list[str], out: Path, model: Path) -> None:
    result = runner.invoke(cli, ["convert", *args, "-q"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, manifest_path(out).name]
    _assert_exact(out, model)


def _kill_points(folder: Path, args: list[str], run_seconds: float):
    """(description, start-and-kill function) for every kill point of one scenario."""
    points = [(f"at rename {n}", lambda n=n: reap(_start(args, n))) for n in (1, 2)]
    points += [(f"partial >= {size} bytes",
                lambda size=size: _kill_at_partial_size(_start(args), folder, size))
               for size in (0, 4096, 1 << 20)]
    points += [(f"after {delay:.3f} s", lambda delay=delay: _kill_after(_start(args), delay))
               for delay in np.linspace(0.05, run_seconds * 1.3, DELAY_KILLS)]
    return points


def _timed_run(args: list[str]) -> float:
    started = time.perf_counter()
    process = _start(args)
    errors = process.stderr.read()
    assert reap(process) == 0, errors
    return time.perf_counter() - started


def test_convert_killed_anywhere_leaves_nothing_that_opens_and_rerun_succeeds(
        fp8_checkpoint, tmp_path, runner):
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "t.bin"
    args = ["--model", str(fp8_checkpoint), "--out", str(out)]
    run_seconds = _timed_run(args)
    _assert_exact(out, fp8_checkpoint)
    states = {}
    for number, (description, start_and_kill) in enumerate(_kill_points(folder, args, run_seconds)):
        for path in (out, manifest_path(out)):
            path.unlink(missing_ok=True)
        start_and_kill()
        state = _state(out)
        states[description] = state
        if state == "published":
            _assert_exact(out, fp8_checkpoint)
            result = runner.invoke(cli, ["convert", *args])
            assert result.exit_code == 2 and "exists; pass --force" in result.output
        else:
            # Every other rerun resumes: the kept progress must be as good as a fresh start.
            _rerun_succeeds(runner, args + ["--resume"] * (number % 2), out, fp8_checkpoint)
    print("kill points:", len(states), collections.Counter(states.values()))
    assert states["at rename 1"] == "writing"
    assert states["at rename 2"] == "between renames"
    # Whether a late delay catches a finished run depends on the machine's load: not asserted.
    assert states["after 0.050 s"] == "before"


def test_convert_force_killed_anywhere_keeps_old_table_or_refuses(fp8_checkpoint, tmp_path, runner):
    old_model = make_checkpoint(tmp_path / "old", "fp8", seed=5)
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "t.bin"
    args = ["--model", str(fp8_checkpoint), "--out", str(out), "--force"]
    run_seconds = _timed_run(args)
    old_out = tmp_path / "old.bin"
    assert runner.invoke(cli, ["convert", "--model", str(old_model), "--out", str(old_out),
                               "-q"]).exit_code == 0
    states = {}
    for description, start_and_kill in _kill_points(folder, args, run_seconds):
        # The old table, in place under the destination names (copies keep its file id).
        shutil.copyfile(old_out, out)
        shutil.copyfile(manifest_path(old_out), manifest_path(out))
        start_and_kill()
        state = _state(out)
        states[description] = state
        if state == "published":
            # Either the old table, untouched, or the complete new one: never a mixture.
            with open_table(out) as table:
                replaced = table.manifest["source"]["model"] == str(fp8_checkpoint.resolve())
            _assert_exact(out, fp8_checkpoint if replaced else old_model)
            state = states[description] = "published new" if replaced else "old kept"
        _rerun_succeeds(runner, args, out, fp8_checkpoint)
    print("kill points:", len(states), collections.Counter(states.values()))
    assert states["at rename 2"] == "refused"
    assert states["at rename 1"] == "old kept"


def test_convert_removes_only_partials_of_dead_writers(fp8_checkpoint, tmp_path, runner):
    out = tmp_path / "t.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = [tmp_path / f".t.bin.{dead}.partial", tmp_path / f".t.bin.json.{dead}.partial"]
    live = tmp_path / f".t.bin.{os.getppid()}.partial"
    unrelated = tmp_path / f".other.bin.{dead}.partial"
    for path in (*stale, live, unrelated):
        path.write_bytes(b"left by a killed run")
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert not any(path.exists() for path in stale)
    assert live.exists() and unrelated.exists()
