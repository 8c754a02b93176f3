"""`ple-prep bench`: real-text requests, cold and warm, with and without fio."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from ple_prep.cli import cli

SCENARIOS = ("cold_prefill", "cold_decode_16", "warm_prefill", "warm_decode_16", "warm_decode_64")


def test_bench_json_reports_every_scenario_without_fio(runner, fp8_table):
    result = runner.invoke(cli, ["bench", str(fp8_table), "--json", "--prefill-requests", "1",
                                 "--decode-requests", "20"], env={"PATH": "/nonexistent"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fio"] is None and "cold_vs_fio" not in report
    for key in SCENARIOS:
        row = report[key]
        assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"] and row["rows_per_s"] > 0
    faults = {key: report[key]["major_faults"] for key in SCENARIOS}
    if report["read_path"] == "direct":
        # O_DIRECT reads land in the reader's own buffers: no gather faults the table's rows in (a
        # mapped cold gather faults once a page, hundreds of times here). The count is the process's
        # (the bench pages the gather's code in first): a library page reclaimed mid-run may cost one.
        assert all(count <= 2 for count in faults.values()), faults
    else:
        # Mapped: warm gathers find every page cached; a cold one after eviction waits on the disk.
        assert all(faults[key] == 0 for key in SCENARIOS if key.startswith("warm")), faults
        if report["cached_after_evict"] is not None and report["cached_after_evict"] < 0.5:
            assert faults["cold_prefill"] > 0, faults
    assert report["warm_prefill"]["rows_per_request"] == 4096 * 16
    assert report["warm_decode_16"]["rows_per_request"] == 16
    assert report["warm_decode_64"]["rows_per_request"] == 64
    # Real text repeats n-grams: a prefill chunk reads far fewer distinct rows than ids.
    assert report["warm_prefill"]["distinct_rows_per_request"] < 4096 * 16 * 0.8


def test_bench_text_says_when_fio_did_not_run(runner, fp8_table):
    result = runner.invoke(cli, ["bench", str(fp8_table), "--prefill-requests", "1",
                                 "--decode-requests", "5", "--fio-seconds", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "warm decode, 1 token" in result.output
    assert "fio: not run (not installed, or --fio-seconds 0)" in result.output


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_bench_runs_fio_beside_the_gathers(runner, fp8_table):
    result = runner.invoke(cli, ["bench", str(fp8_table), "--json", "--prefill-requests", "1",
                                 "--decode-requests", "5", "--fio-seconds", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fio"]["iops"] > 0 and report["fio"]["queue_depth"] == 64
    # New offsets each run: fio repeats one sequence by default, which a disk's own cache would serve.
    assert "--randrepeat=0" in report["fio"]["command"].split()
    assert report["cold_vs_fio"] > 0


def test_bench_missing_table_is_bad_input(runner, tmp_path):
    result = runner.invoke(cli, ["bench", str(tmp_path / "absent.bin")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_bench_names_the_read_path_and_its_settings(runner, fp8_table):
    result = runner.invoke(cli, ["bench", str(fp8_table), "--prefill-requests", "1", "--decode-requests", "5",
                                 "--fio-seconds", "0"])
    assert result.exit_code == 0, result.output
    report = json.loads(runner.invoke(cli, ["bench", str(fp8_table), "--json", "--prefill-requests", "1",
                                            "--decode-requests", "5", "--fio-seconds", "0"]).stdout)
    lines = result.stdout.splitlines()
    if report["read_path"] == "direct":
        # O_DIRECT takes no read-ahead advice: no window is named for it.
        assert lines[1].startswith("cold rows: direct (O_DIRECT reads") and "advice window" not in result.stdout
    else:
        assert lines[1].startswith("cold rows: mapped (page faults behind an advice window of 128 pages")


def test_bench_says_a_small_tables_figures_mean_nothing(runner, fp8_table):
    result = runner.invoke(cli, ["bench", str(fp8_table), "--prefill-requests", "1", "--decode-requests", "5",
                                 "--fio-seconds", "0"])
    assert result.exit_code == 0, result.output
    note = result.stdout.splitlines()[-1]
    assert note.startswith("note: this table holds 16,896 rows, the model's 320,001,536") and "say nothing" in note
    report = json.loads(runner.invoke(cli, ["bench", str(fp8_table), "--json", "--prefill-requests", "1",
                                            "--decode-requests", "5", "--fio-seconds", "0"]).stdout)
    assert report["notes"][-1] == note.removeprefix("note: ")


def test_bench_notes_nothing_for_a_table_of_the_models_size():
    from ple_prep.runtime import compiled_helper_missing
    from ple_prep.tools.benchmark import MODEL_TABLE_ROWS, table_notes

    helper = [] if compiled_helper_missing() is None else [compiled_helper_missing()]
    assert table_notes({"total_rows": MODEL_TABLE_ROWS}, 52 << 30) == helper
    assert len(table_notes({"total_rows": MODEL_TABLE_ROWS // 8}, 6 << 30)) == len(helper) + 1


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_reads_new_offsets_within_the_region_it_is_given(tmp_path):
    from ple_prep.tools.benchmark import fio_random_read

    region = 1 << 20
    path = tmp_path / "disk.bin"
    path.write_bytes(bytes(16 << 20))
    report = fio_random_read(path, seconds=1, region_bytes=region)
    assert report["iops"] > 0
    command = report["command"].split()
    assert f"--size={region}" in command and "--randrepeat=0" in command
    # The command as built, with fio's log of every read: each offset lies within the region.
    logs = []
    for run in range(2):
        log = tmp_path / f"reads{run}.log"
        subprocess.run([*command, f"--write_iolog={log}"], check=True, capture_output=True)
        # version 3 lines: time, file, action, offset, length
        logs.append([int(fields[3]) for fields in (line.split() for line in log.read_text().splitlines())
                     if len(fields) == 5 and fields[2] == "read"])
    assert all(logs) and all(0 <= offset < region for offsets in logs for offset in offsets)
    # Two runs read different offsets (fio's default would repeat the first run's).
    assert logs[0][:100] != logs[1][:100]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_runs_for_a_fraction_of_a_second_as_asked(tmp_path):
    from ple_prep.tools.benchmark import fio_random_read

    path = tmp_path / "disk.bin"
    path.write_bytes(bytes(4 << 20))
    report = fio_random_read(path, seconds=0.3, queue_depth=4)
    assert report["iops"] > 0 and "--runtime=300ms" in report["command"].split()
    done = subprocess.run(report["command"].split(), check=True, capture_output=True, text=True)
    # fio's own account of the time it ran, in milliseconds (it read whole seconds before).
    assert 250 <= json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]["job_runtime"] < 1000
