"""Settings of the vLLM plugin (standard library only: runs without vLLM)."""
from __future__ import annotations

import pytest

from ple_prep.core.errors import BadInput
from ple_prep.integrations.vllm.settings import Settings, parse_bytes, read_settings


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


@pytest.mark.parametrize("text, count", [("4GiB", 4 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29),
                                         ("1000", 1000), (7, 7), (" 2 KiB ", 2048)])
def test_parse_bytes(text, count):
    assert parse_bytes(text, "x") == count


@pytest.mark.parametrize("text", ["-1", "4 GB", "lots", "", True, -5])
def test_parse_bytes_refuses_what_is_not_a_byte_count(text):
    with pytest.raises(BadInput):
        parse_bytes(text, "PLE_PREP_RESIDENT_BYTES")


def test_refuses_unknown_keys_and_non_objects():
    with pytest.raises(BadInput, match="unknown keys: tabel"):
        read_settings({"ple_prep": {"tabel": "/x"}}, {})
    with pytest.raises(BadInput, match="must be an object"):
        read_settings({"ple_prep": "/x.bin"}, {})


def test_table_path_names_each_ranks_file():
    settings = Settings("/nvme/ple.tp{rank}of{size}.bin", None)
    assert settings.table_path(1, 2) == "/nvme/ple.tp1of2.bin"
    assert Settings("/nvme/ple.bin", None).table_path(0, 1) == "/nvme/ple.bin"
    with pytest.raises(BadInput, match=r"only \{rank\} and \{size\}"):
        Settings("/nvme/{host}.bin", None).table_path(0, 1)


def test_an_empty_environment_value_counts_as_unset():
    assert read_settings({}, {"PLE_PREP_TABLE": "", "PLE_PREP_RESIDENT_BYTES": "1G"}) is None
    assert read_settings({}, {"PLE_PREP_TABLE": "/a.bin", "PLE_PREP_RESIDENT_BYTES": "", "PLE_PREP_READ_PATH": ""}) \
        == Settings("/a.bin", None, None)


def test_a_bad_byte_count_names_where_it_was_set():
    with pytest.raises(BadInput, match=r"^additional_config\['ple_prep'\]\['resident_bytes'\] must be a byte count"):
        read_settings({"ple_prep": {"table": "/a.bin", "resident_bytes": "lots"}}, {"PLE_PREP_RESIDENT_BYTES": "1G"})
    with pytest.raises(BadInput, match=r"^PLE_PREP_RESIDENT_BYTES must be a byte count"):
        read_settings({"ple_prep": {"table": "/a.bin"}}, {"PLE_PREP_RESIDENT_BYTES": "lots"})
