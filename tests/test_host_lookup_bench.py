"""bench/host_lookup_bench.py beside other code (`--other-tree`): the two trees' runs in turn, and
every figure both report side by side."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "host_lookup_bench.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))  # the bench imports gather_bench beside it
    try:
        spec = importlib.util.spec_from_file_location("host_lookup_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_a_reports_numbers_are_named_by_their_path_of_keys():
    report = {"compiled_helper": True, "tables": {"t.bin": {"placed": 7, "slot_of": {"16 ids": {"p50_us": 2.5}},
                                                           "note": "text"}}}
    assert _bench().leaves(report) == {"tables/t.bin/placed": 7, "tables/t.bin/slot_of/16 ids/p50_us": 2.5}


def test_two_trees_run_in_turn_and_their_shared_figures_are_set_side_by_side(monkeypatch, tmp_path):
    bench = _bench()
    other = tmp_path / "other"
    calls = []

    def run(command, **_):
        side = "other" if Path(command[1]).is_relative_to(other) else "this"
        calls.append(side)
        runs = calls.count(side)
        figures = {"slot_of": {"p50_us": 100.0 * runs if side == "this" else 200.0}}
        if side == "this":
            figures["only_here"] = 1
        return types.SimpleNamespace(stdout=json.dumps({"tables": {"t.bin": figures}}))

    monkeypatch.setattr(bench.subprocess, "run", run)
    report = bench.beside(other, [tmp_path / "t.bin"], rounds=5, pairs=3)

    assert calls == ["this", "other", "other", "this", "this", "other"]
    assert list(report["figures"]) == ["tables/t.bin/slot_of/p50_us"]
    figure = report["figures"]["tables/t.bin/slot_of/p50_us"]
    assert figure["this"] == [100.0, 200.0, 300.0] and figure["other"] == [200.0, 200.0, 200.0]
    assert figure["this_over_other"] == 1.0
