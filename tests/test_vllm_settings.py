"""Settings of the vLLM plugin (standard library only: runs without vLLM)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ple_prep.core.errors import BadInput
from ple_prep.integrations.vllm.environment import scale_launch_queues
from ple_prep.integrations.vllm.settings import (
    KEYS,
    MAX_BYTES,
    Settings,
    host_memory_bytes,
    parse_bytes,
    read_settings,
)
from ple_prep.runtime import READ_PATHS


def test_read_settings_none_without_a_table():
    assert read_settings(None, {}) is None
    assert read_settings({"other": 1}, {"PLE_PREP_RESIDENT_BYTES": "1G"}) is None


def test_read_settings_from_the_environment():
    assert read_settings({}, {"PLE_PREP_TABLE": "/nvme/ple.bin", "PLE_PREP_RESIDENT_BYTES": "4GiB"}) == \
        Settings("/nvme/ple.bin", 4 << 30)
    assert read_settings({}, {"PLE_PREP_TABLE": "/nvme/ple.bin"}) == Settings("/nvme/ple.bin", None)


def test_additional_config_wins_key_by_key():
    environ = {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_RESIDENT_BYTES": "1M", "PLE_PREP_READ_PATH": "direct"}
    assert read_settings({"ple_prep": {"table": "/b.bin"}}, environ) == Settings("/b.bin", 1 << 20, "direct")
    assert read_settings({"ple_prep": {"resident_bytes": 0, "read_path": "mapped"}}, environ) == \
        Settings("/a.bin", 0, "mapped")


@pytest.mark.parametrize("text, count", [
    ("4GiB", 4 << 30), ("4G", 4 << 30), ("4GB", 4 * 10**9), ("4 GB", 4 * 10**9), ("512M", 512 << 20),
    ("512MB", 512 * 10**6), ("1.5g", 3 << 29), ("1000", 1000), (7, 7), (" 2 KiB ", 2048), ("3kb", 3000),
    ("1TiB", 1 << 40), ("0.5K", 512), ("10B", 10), ("4Gi", 4 << 30), ("512Mi", 512 << 20), (4e9, 4 * 10**9),
    (4.0, 4)])
def test_parse_bytes_reads_decimal_and_binary_units(text, count):
    assert parse_bytes(text, "x") == count


@pytest.mark.parametrize("text", [
    "-1", "lots", "", True, -5, 4.5, float("nan"), float("inf"), None, [4], "4 G B", "4GiBs", "1e9", "0x10",
    "4_000",
    "\uff14GiB",            # a fullwidth digit
    "\u0664GiB",            # an Arabic-Indic digit
    "4\u00a0GiB",           # a no-break space
    "9" * 400,              # 400 digits: no OverflowError, no huge int
    "99999999999999999999TiB", "2TiB", 1 << 41])
def test_parse_bytes_refuses_what_is_not_a_bounded_ascii_byte_count(text):
    with pytest.raises(BadInput, match="^PLE_PREP_RESIDENT_BYTES="):
        parse_bytes(text, "PLE_PREP_RESIDENT_BYTES")


def test_parse_bytes_bound_is_documented_and_can_be_the_hosts_memory():
    assert parse_bytes(MAX_BYTES, "x") == MAX_BYTES
    memory = host_memory_bytes()
    assert parse_bytes(memory, "x", limit=memory) == memory
    with pytest.raises(BadInput, match=r"PLE_PREP_X=\d+: more than the \d+ bytes"):
        parse_bytes(str(memory + 1), "PLE_PREP_X", limit=memory)


def test_refuses_unknown_keys_and_non_objects():
    with pytest.raises(BadInput, match="unknown keys: tabel"):
        read_settings({"ple_prep": {"tabel": "/x"}}, {})
    with pytest.raises(BadInput, match="must be an object"):
        read_settings({"ple_prep": "/x.bin"}, {})


def test_table_path_names_each_ranks_file(tmp_path):
    (tmp_path / "ple.tp1of2.bin").write_bytes(b"")
    (tmp_path / "ple.bin").write_bytes(b"")
    settings = read_settings({}, {"PLE_PREP_TABLE": f"{tmp_path}/ple.tp{{rank}}of{{size}}.bin"})
    assert settings.table_path(1, 2) == f"{tmp_path}/ple.tp1of2.bin"
    assert Settings(f"{tmp_path}/ple.bin").table_path(0, 1) == f"{tmp_path}/ple.bin"
    assert Settings(f"{tmp_path}/{{{{rank}}}}.bin").table == f"{tmp_path}/{{{{rank}}}}.bin"


def test_a_missing_table_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(BadInput, match=f"^PLE_PREP_TABLE={tmp_path}/x.bin: no such file$"):
        read_settings({}, {"PLE_PREP_TABLE": f"{tmp_path}/x.bin"}).table_path(0, 1)
    with pytest.raises(BadInput, match=r"^additional_config\['ple_prep'\]\['table'\]=.*rank 1 of 2: .*tp1\.bin"
                                       r".*: no such file$"):
        read_settings({"ple_prep": {"table": f"{tmp_path}/tp{{rank}}.bin"}}, {}).table_path(1, 2)
    with pytest.raises(BadInput, match="a directory"):
        read_settings({}, {"PLE_PREP_TABLE": str(tmp_path)}).table_path(0, 1)


@pytest.mark.parametrize("template", [
    "/nvme/{rank:>9999999999}.bin",   # would build a 10 GB string
    "/nvme/{rank.__class__}.bin", "/nvme/{rank[0]}.bin", "/nvme/{rank!r}.bin", "/nvme/{size:d}.bin",
    "/nvme/{host}.bin", "/nvme/{}.bin", "/nvme/{0}.bin", "/nvme/{rank", "/nvme/rank}.bin"])
def test_table_templates_hold_only_rank_and_size_and_are_checked_at_parse_time(template):
    started = time.monotonic()
    with pytest.raises(BadInput, match="^PLE_PREP_TABLE=/nvme/"):
        read_settings({}, {"PLE_PREP_TABLE": template})
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("read_path", ["o_direct", 0, 1, False, ["direct"], "di rect"])
def test_read_paths_come_from_a_closed_list_at_parse_time(read_path):
    with pytest.raises(BadInput, match=r"^additional_config\['ple_prep'\]\['read_path'\]=.*: the read path is one of "
                                       + ", ".join(READ_PATHS)):
        read_settings({"ple_prep": {"table": "/a.bin", "read_path": read_path}}, {})


def test_each_read_path_is_accepted():
    for read_path in READ_PATHS:
        assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_READ_PATH": read_path}).read_path == read_path


@pytest.mark.parametrize("written, read_path", [("Direct", "direct"), (" mapped ", "mapped"), ("PREAD", "pread")])
def test_a_read_path_is_read_in_any_case_and_without_its_blanks(written, read_path):
    assert read_settings({"ple_prep": {"table": "/a.bin", "read_path": written}}, {}).read_path == read_path


def test_an_empty_environment_value_counts_as_unset():
    assert read_settings({}, {"PLE_PREP_TABLE": "", "PLE_PREP_RESIDENT_BYTES": "1G"}) is None
    assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_RESIDENT_BYTES": "", "PLE_PREP_READ_PATH": ""}) \
        == Settings("/a.bin", None, None)


def test_a_blank_value_counts_as_unset():
    assert read_settings({}, {"PLE_PREP_TABLE": "  "}) is None
    assert read_settings({"ple_prep": {"table": " \t"}}, {"PLE_PREP_TABLE": "/a.bin"}) == Settings("/a.bin")
    assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_RESIDENT_BYTES": "  "}) == Settings("/a.bin")


def test_without_a_table_other_variables_leave_vllm_as_it_was_even_when_bad():
    assert read_settings({}, {"PLE_PREP_RESIDENT_BYTES": "lots", "PLE_PREP_RECORD_PROFILE": "/no/such/x.prof",
                              "PLE_PREP_READ_PATH": "nowhere"}) is None


@pytest.mark.parametrize("environ, queues", [
    ({"PLE_PREP_TABLE": "/a.bin"}, "4x"),
    ({"PLE_PREP_TABLE": "/a.bin", "CUDA_SCALE_LAUNCH_QUEUES": "2x"}, "2x"),
    ({"PLE_PREP_TABLE": "/a.bin", "CUDA_SCALE_LAUNCH_QUEUES": ""}, ""),
    ({"PLE_PREP_TABLE": " "}, None),
    ({}, None),
])
def test_a_served_table_sizes_the_drivers_launch_queues_unless_the_operator_did(environ, queues):
    before = dict(environ)
    assert scale_launch_queues(environ) == (queues == "4x" and "CUDA_SCALE_LAUNCH_QUEUES" not in before)
    assert environ.get("CUDA_SCALE_LAUNCH_QUEUES") == queues
    assert {key: value for key, value in environ.items() if key != "CUDA_SCALE_LAUNCH_QUEUES"} \
        == {key: value for key, value in before.items() if key != "CUDA_SCALE_LAUNCH_QUEUES"}


@pytest.mark.parametrize("table", ["/nvme/ple.bin", None])
def test_the_plugin_hook_passes_the_launch_queues_to_the_processes_vllm_starts_after_it(table):
    """vLLM loads its general plugins while it parses the command line, before any process uses CUDA;
    the engine and worker processes it starts then inherit the variable."""
    environ = {key: value for key, value in os.environ.items()
               if key not in ("PLE_PREP_TABLE", "CUDA_SCALE_LAUNCH_QUEUES")}
    if table:
        environ["PLE_PREP_TABLE"] = table
    grandchild = "import os; print(os.environ.get('CUDA_SCALE_LAUNCH_QUEUES'))"
    child = ("from ple_prep.integrations.vllm import register; import subprocess, sys; register(); "
             f"print(subprocess.run([sys.executable, '-c', {grandchild!r}], capture_output=True, text=True,"
             " check=True).stdout.strip())")
    shown = subprocess.run([sys.executable, "-c", child], env=environ, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == ("4x" if table else "None")


def test_a_config_section_without_a_table_is_refused_naming_what_it_sets():
    with pytest.raises(BadInput, match=r"^additional_config\['ple_prep'\] sets read_path, resident_bytes but no "
                                       r"table: set its 'table' or PLE_PREP_TABLE$"):
        read_settings({"ple_prep": {"resident_bytes": "4GB", "read_path": "mapped"}}, {})


def test_a_table_open_table_refuses_is_named_with_the_settings_it_was_opened_with(tmp_path):
    settings = read_settings({}, {"PLE_PREP_TABLE": f"{tmp_path}/t.bin", "PLE_PREP_VERIFY_READS": "1"})
    error = settings.refused_table(0, 1, BadInput("t.bin.pagesums is missing"))
    assert str(error) == \
        f"PLE_PREP_TABLE={tmp_path}/t.bin: t.bin.pagesums is missing (opened with PLE_PREP_VERIFY_READS)"
    ranks = read_settings({"ple_prep": {"table": f"{tmp_path}/t{{rank}}.bin"}}, {})
    assert str(ranks.refused_table(1, 2, BadInput("0 bytes is too short"))) == \
        f"additional_config['ple_prep']['table']=\"{tmp_path}/t{{rank}}.bin (rank 1 of 2: {tmp_path}/t1.bin)\": " \
        "0 bytes is too short"


def test_a_bad_byte_count_names_where_it_was_set():
    with pytest.raises(BadInput, match=r"^additional_config\['ple_prep'\]\['resident_bytes'\]=\"lots\": not a byte"):
        read_settings({"ple_prep": {"table": "/a.bin", "resident_bytes": "lots"}}, {"PLE_PREP_RESIDENT_BYTES": "1G"})
    with pytest.raises(BadInput, match=r"^PLE_PREP_RESIDENT_BYTES=lots: not a byte count"):
        read_settings({"ple_prep": {"table": "/a.bin"}}, {"PLE_PREP_RESIDENT_BYTES": "lots"})


def test_every_key_is_a_settings_field():
    fields = {field for field in Settings.__dataclass_fields__ if field != "origins"}
    assert {key.field for key in KEYS} == fields
    assert all(key.variable.startswith("PLE_PREP_") for key in KEYS)


def test_read_timeout_and_verification_reach_open_table():
    environ = {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_READ_TIMEOUT": "2.5s", "PLE_PREP_READ_PATH": "pread"}
    settings = read_settings({"ple_prep": {"verify_reads": True}}, environ)
    assert settings.open_options() == {"read_path": "pread", "read_timeout": 2.5, "verify_reads": True}
    assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin"}).open_options() == {}
    for text, on in (("1", True), ("off", False), ("TRUE", True), ("no", False)):
        assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_VERIFY_READS": text}).verify_reads is on
    assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_READ_TIMEOUT": "30"}).read_timeout == 30.0


@pytest.mark.parametrize("variable, text, cause", [
    ("PLE_PREP_READ_TIMEOUT", "0", "more than 0"), ("PLE_PREP_READ_TIMEOUT", "3601", "at most 3600"),
    ("PLE_PREP_READ_TIMEOUT", "30 minutes", "not a number of seconds"),
    ("PLE_PREP_READ_TIMEOUT", "\uff13\uff10", "not a number of seconds"),
    ("PLE_PREP_READ_TIMEOUT", "1e9", "not a number of seconds"),
    ("PLE_PREP_VERIFY_READS", "maybe", "on or off"), ("PLE_PREP_VERIFY_READS", "2", "on or off")])
def test_read_timeout_and_verification_are_parsed_strictly(variable, text, cause):
    with pytest.raises(BadInput, match=f"^{variable}=.*: .*{cause}"):
        read_settings({}, {"PLE_PREP_TABLE": "/a.bin", variable: text})


@pytest.mark.parametrize("value, seconds", [("30", 30.0), ("0", 0.0), ("2.5", 2.5), (15, 15.0), ("60s", 60.0),
                                            ("10 s", 10.0), ("1.2345", 1.2345)])
def test_stats_seconds_are_read_from_the_environment_or_the_config(value, seconds):
    where = {"PLE_PREP_TABLE": "/nvme/ple.bin"}
    if isinstance(value, str):
        assert read_settings({}, where | {"PLE_PREP_STATS_SECONDS": value}).stats_seconds == seconds
    assert read_settings({"ple_prep": {"stats_seconds": value}}, where).stats_seconds == seconds
    assert read_settings({}, where).stats_seconds == 60.0


@pytest.mark.parametrize("value", ["-1", "1e9", "ten", "100000", "９"])
def test_stats_seconds_refused_naming_the_variable(value):
    with pytest.raises(BadInput, match=rf"^PLE_PREP_STATS_SECONDS={value}: seconds between stats lines, 0 \(none\)"):
        read_settings({}, {"PLE_PREP_TABLE": "/nvme/ple.bin", "PLE_PREP_STATS_SECONDS": value})
def test_host_cache_read_ahead_and_recording_settings(tmp_path):
    environ = {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_HOST_CACHE_BYTES": "2GiB", "PLE_PREP_READ_AHEAD": "off",
               "PLE_PREP_RECORD_PROFILE": str(tmp_path / "served.prof")}
    settings = read_settings({}, environ)
    assert (settings.host_cache_bytes, settings.read_ahead, settings.record_profile) == \
        (2 << 30, False, str(tmp_path / "served.prof"))
    defaults = read_settings({}, {"PLE_PREP_TABLE": "/a.bin"})
    assert (defaults.host_cache_bytes, defaults.read_ahead, defaults.record_profile) == (None, True, None)
    assert read_settings({"ple_prep": {"read_ahead": True, "host_cache_bytes": 0}}, environ).host_cache_bytes == 0


@pytest.mark.parametrize("variable, value, cause", [
    ("PLE_PREP_HOST_CACHE_BYTES", "99999TiB", "more than"),
    ("PLE_PREP_HOST_CACHE_BYTES", "lots", "not a byte count"),
    ("PLE_PREP_READ_AHEAD", "maybe", "on or off"),
    ("PLE_PREP_RECORD_PROFILE", "/no/such/folder/served.prof", "no such folder"),
])
def test_host_cache_settings_refuse_naming_the_variable(variable, value, cause):
    with pytest.raises(BadInput, match=f"{variable}={value}: .*{cause}"):
        read_settings({}, {"PLE_PREP_TABLE": "/a.bin", variable: value})
