"""open_table: placed rows, refusals at open (other conversion, wrong size); open_checked: staleness."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ple_prep.cli import cli
from ple_prep.converters import open_source
from ple_prep.converters.safetensors import read_header
from ple_prep.core.constants import HEADER_SIZE, SCALE_SUFFIX
from ple_prep.core.errors import BadInput
from ple_prep.format.layout import TableLayout
from ple_prep.format.manifest import manifest_path
from ple_prep.format.order import RowOrder
from ple_prep.offline.staleness import open_checked
from ple_prep.offline.writer import convert
from ple_prep.runtime import gather, open_table
from ple_prep.tools.benchmark import evict
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_checkpoint


def test_open_table_placed_rows_read_back_exact(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        order = RowOrder.from_placed(np.array([500, 3, 77, source.num_rows - 1]), source.num_rows)
        convert(source, tmp_path / "t.bin", layout=TableLayout(order))
        expected = source.read_rows(0, source.num_rows)
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(2).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])
        assert table.slot_of(np.array([500, 3, 77])).tolist() == [0, 1, 2]


@pytest.fixture
def table_path(fp8_checkpoint, tmp_path, converted_table):
    converted_table(fp8_checkpoint, tmp_path / "t.bin")
    return tmp_path / "t.bin"


def test_open_table_refuses_manifest_of_another_conversion(fp8_checkpoint, table_path):
    with open_source(fp8_checkpoint) as source:
        convert(source, table_path.with_name("other.bin"))
    shutil.copy(table_path.with_name("other.bin.json"), manifest_path(table_path))
    with pytest.raises(BadInput, match="come from different conversions"):
        open_table(table_path)


@pytest.mark.parametrize("new_size", [0, 100, HEADER_SIZE, "minus_page", "minus_byte", "plus_byte",
                                      "plus_page"])
def test_open_table_refuses_truncated_or_extended_file(table_path, new_size):
    size = table_path.stat().st_size
    new_size = {"minus_page": size - 4096, "minus_byte": size - 1, "plus_byte": size + 1,
                "plus_page": size + 4096}.get(new_size, new_size)
    os.truncate(table_path, new_size)
    with pytest.raises(BadInput, match="too short|truncated or extended"):
        open_table(table_path)


def test_open_table_refuses_missing_manifest_and_missing_file(table_path):
    manifest_path(table_path).rename(table_path.with_name("elsewhere.json"))
    with pytest.raises(BadInput, match="manifest .* not found"):
        open_table(table_path)
    with pytest.raises(BadInput, match="no such file: .*absent.bin"):
        open_table(table_path.with_name("absent.bin"), manifest=table_path.with_name("elsewhere.json"))


def test_open_table_with_unchanged_source_opens(fp8_checkpoint, table_path):
    with open_checked(table_path, fp8_checkpoint) as table:
        assert table.num_rows == FIXTURE_ROWS


def _copy_checkpoint(checkpoint, destination):
    shutil.copytree(checkpoint, destination)
    return destination


def test_open_table_refuses_source_with_same_sizes_other_values(table_path, tmp_path):
    other = make_checkpoint(tmp_path / "reexport", "fp8", seed=7)
    with pytest.raises(BadInput, match="was converted from .*, not from .*reexport: .* sampled rows differ"):
        open_checked(table_path, other)


def test_open_table_refuses_source_with_other_files(table_path, tmp_path):
    other = make_checkpoint(tmp_path / "refiled", "fp8", num_files=4)
    with pytest.raises(BadInput, match="not from .*refiled: .*model-00001-of-00003.safetensors is gone; "
                                       "model-00001-of-00004.safetensors is new"):
        open_checked(table_path, other)
    resharded = make_checkpoint(tmp_path / "resharded", "fp8", num_shards=64)
    with pytest.raises(BadInput, match="not from .*resharded: .* bytes, now"):
        open_checked(table_path, resharded)


def test_open_table_refuses_source_with_other_scale(fp8_checkpoint, table_path, tmp_path):
    copy = _copy_checkpoint(fp8_checkpoint, tmp_path / "rescaled")
    tensors = {}
    for path in copy.glob("*.safetensors"):
        tensors.update(read_header(path))
    scale = next(t for name, t in tensors.items() if name.endswith(SCALE_SUFFIX))
    with open(scale.path, "r+b") as handle:
        handle.seek(scale.offset)
        handle.write(np.array([0x3954], dtype="<u2").tobytes())
    with pytest.raises(BadInput, match="not from .*rescaled: .*the scale was 5339, now 5439"):
        open_checked(table_path, copy)


def test_open_checked_says_its_own_checkpoint_changed(fp8_checkpoint, tmp_path):
    model = _copy_checkpoint(fp8_checkpoint, tmp_path / "ckpt")
    with open_source(model) as source:
        convert(source, tmp_path / "t.bin")
    tensors = {}
    for path in model.glob("*.safetensors"):
        tensors.update(read_header(path))
    scale = next(t for name, t in tensors.items() if name.endswith(SCALE_SUFFIX))
    with open(scale.path, "r+b") as handle:  # the same folder, its scale changed since conversion
        handle.seek(scale.offset)
        handle.write(np.array([0x3954], dtype="<u2").tobytes())
    with pytest.raises(BadInput, match=f"t.bin is stale: {model} changed since conversion: "
                                       f"the scale was 5339, now 5439"):
        open_checked(tmp_path / "t.bin", model)


def test_verify_reports_changed_source(runner, table_path, tmp_path):
    other = make_checkpoint(tmp_path / "reexport", "fp8", seed=7)
    result = runner.invoke(cli, ["verify", str(table_path), "--model", str(other), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output[:result.output.rindex("}") + 1])
    assert report["source_problems"] == [
        "another checkpoint: the 256 sampled rows differ (same sizes, other values)"]
    assert report["rows_compared"] == FIXTURE_ROWS and report["mismatched_rows"] > 16_000


def test_open_table_keeps_old_rows_after_convert_force_replaced_it(tmp_path, runner):
    old_source = make_checkpoint(tmp_path / "old", "fp8", seed=1)
    new_source = make_checkpoint(tmp_path / "new", "fp8", seed=2)
    out = tmp_path / "t.bin"
    assert runner.invoke(cli, ["convert", "--model", str(old_source), "--out", str(out)]).exit_code == 0
    with open_source(old_source) as source:
        old_rows = source.read_rows(0, source.num_rows)
    with open_source(new_source) as source:
        new_rows = source.read_rows(0, source.num_rows)
    ids = np.random.default_rng(3).permutation(len(old_rows))
    with open_table(out) as serving:
        # No page is touched before the replacement: every fault is served after it.
        result = runner.invoke(cli, ["convert", "--model", str(new_source), "--out", str(out), "--force"])
        assert result.exit_code == 0, result.output
        assert np.array_equal(serving.gather(ids), old_rows[ids])
        with open_table(out) as reopened:
            assert np.array_equal(reopened.gather(ids), new_rows[ids])


def direct_io_works(path: Path) -> bool:
    try:
        open_table(path, read_path="direct").close()
    except BadInput:
        return False
    return True


def test_open_table_in_place_truncation_raises_where_rename_serves_on(table_path, tmp_path):
    # What ple-prep cannot prevent: someone truncating the mapped file in place (docs/RELIABILITY.md).
    # Through the mapping the compiled copy turns the SIGBUS into an error; O_DIRECT reads raise too.
    for read_path, expected in (("mapped", 1 if gather._core_native is not None else -signal.SIGBUS),
                                ("direct", 1)):
        copy = tmp_path / read_path / table_path.name
        copy.parent.mkdir()
        shutil.copyfile(table_path, copy)
        shutil.copyfile(manifest_path(table_path), manifest_path(copy))
        evict(copy)
        if read_path == "direct" and not direct_io_works(copy):
            continue
        script = ("import os, sys, numpy as np\n"
                  "from ple_prep.runtime import open_table\n"
                  f"t = open_table(sys.argv[1], read_path={read_path!r})\n"
                  "os.truncate(sys.argv[1], 4096)\n"
                  "t.gather(np.arange(t.num_rows))\n")
        done = subprocess.run([sys.executable, "-c", script, str(copy)], capture_output=True,
                              cwd=Path(__file__).resolve().parent.parent)
        if b"native AIO refused" in done.stderr:  # fs.aio-max-nr used up by other processes
            continue
        assert done.returncode == expected, done.stderr
        if expected == 1:
            assert b"the file shrank" in done.stderr
