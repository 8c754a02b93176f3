"""bench/real_geometry.py, the whole offline path in one script: a tiny geometry here; the 1/8 one
(40,001,792 rows, a 3.6 GB checkpoint, minutes) only with PLE_SLOW_TESTS=1."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "real_geometry.py"


def _run(folder: Path, *arguments: str) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(folder), "--rounds", "1",
                             "--fio-seconds", "0", *arguments], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def _check(results: dict, folder: Path) -> None:
    layout = results["convert"]["layout"]
    assert layout["kind"] == "access-ordered" and layout["num_placed"] > 0
    assert layout["map_bytes"] == 4 * layout["num_placed"]
    assert results["verify"]["report"]["ok"] and results["verify"]["report"]["mismatched_rows"] == 0
    assert results["bench"]["report"]
    for name in ("profile", "verify", "bench"):
        assert results[name]["seconds"] > 0 and results[name]["peak_rss_mib"] > 0
    for pair in results["convert"]["rounds"]:
        assert pair["copy_s"] > 0 and pair["convert_s"] > 0 and pair["convert_peak_rss_mib"] > 0
    rounds = results["convert"]["rounds"]
    assert results["convert"]["totals_ratio"] == round(sum(pair["copy_s"] for pair in rounds)
                                                       / sum(pair["convert_s"] for pair in rounds), 3)
    # Everything the run wrote is gone but what --keep keeps.
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt"]


def test_real_geometry_script_runs_every_step(tmp_path):
    results = _run(tmp_path, "--base", "3000", "--documents", "60", "--train-chars", "200000",
                   "--sample", "500", "--keep")
    _check(results, tmp_path)


@pytest.mark.skipif(os.environ.get("PLE_SLOW_TESTS") != "1", reason="minutes and 7 GB of disk: PLE_SLOW_TESTS=1")
def test_real_geometry_script_at_one_eighth_of_the_model(tmp_path):
    results = _run(tmp_path, "--base", "2500000", "--keep")
    assert results["convert"]["layout"]["num_placed"] >= 1_000_000
    _check(results, tmp_path)


def test_a_benchmark_step_is_killed_when_its_disk_runs_short(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_convert import run_timed

    free = shutil.disk_usage(tmp_path).free
    started = time.perf_counter()
    with pytest.raises(SystemExit, match="killed: less than"):
        run_timed(["sleep", "60"], min_free=(tmp_path, free + (1 << 40)))
    assert time.perf_counter() - started < 30
