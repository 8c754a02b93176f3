"""The manifest's JSON Schema (ple_prep/format/manifest.schema.json) describes the manifests convert
really writes, and refuses broken ones; the reader's check at open agrees with it."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from ple_prep.cli import cli
from ple_prep.converters import open_source
from ple_prep.core.errors import BadInput
from ple_prep.format.manifest import SCHEMA_PATH, manifest_path, validate_manifest, validate_with_schema
from ple_prep.offline.writer import convert
from ple_prep.tools.fixtures import FIXTURE_ROWS, make_gguf

SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


@pytest.fixture(scope="module")
def manifests(fp8_checkpoint, bf16_checkpoint, nvfp4_checkpoint, tmp_path_factory):
    """{name: manifest} of every kind of file convert writes."""
    from click.testing import CliRunner

    runner, folder = CliRunner(), tmp_path_factory.mktemp("schema")
    gguf = make_gguf(folder / "gguf", "iq4_nl", layout="split")
    np.save(folder / "ids.npy", np.random.default_rng(0).integers(0, 2000, size=5000))
    profile = folder / "p.prof"
    assert runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts",
                               str(folder / "ids.npy"), "--out", str(profile), "-q"]).exit_code == 0
    jobs = {"fp8": [fp8_checkpoint], "bf16": [bf16_checkpoint], "nvfp4": [nvfp4_checkpoint],
            "gguf": [gguf], "profiled": [fp8_checkpoint, "--profile", str(profile)],
            "rank": [bf16_checkpoint, "--tp-size", "2", "--tp-rank", "1"]}
    made = {}
    for name, (model, *extra) in jobs.items():
        out = folder / f"{name}.bin"
        result = runner.invoke(cli, ["convert", "--model", str(model), "--out", str(out), "-q", *extra])
        assert result.exit_code == 0, result.output
        written = out.with_name(f"{name}.tp1of2.bin") if name == "rank" else out
        made[name] = json.loads(manifest_path(written).read_text())
    return made


def test_manifest_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", ["fp8", "bf16", "nvfp4", "gguf", "profiled", "rank"])
def test_convert_manifest_matches_schema(name, manifests):
    manifest = manifests[name]
    assert [error.message for error in VALIDATOR.iter_errors(manifest)] == []
    expected = {"profiled": "access-ordered"}.get(name, "source-order")
    assert manifest["layout"]["kind"] == expected
    assert ("tensor_parallel" in manifest) == (name == "rank")


def _delete(key):
    def change(manifest):
        del manifest[key]
        return manifest
    return change


def _set(path, value):
    def change(manifest):
        *parents, last = path.split(".")
        target = manifest
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[int(last) if isinstance(target, list) else last] = value
        return manifest
    return change


BROKEN = [
    ("missing file_id", _delete("file_id")),
    ("missing checksums", _delete("checksums")),
    ("other format", _set("format", "safetensors")),
    ("version 3", _set("format_version", 3)),
    ("short file id", _set("file_id", "abc")),
    ("upper-case file id", _set("file_id", "9D85791934434A03B9E57A1F9E54965A")),
    ("unknown encoding", _set("encoding", "fp4")),
    ("rows as text", _set("num_rows", f"{FIXTURE_ROWS}")),
    ("no rows", _set("num_rows", 0)),
    ("negative first row", _set("first_row", -1)),
    ("page size not a power of two", _set("page_size", 4000)),
    ("zero scale", _set("scale.value", 0)),
    ("scale without bytes", _set("scale", {"dtype": "BF16", "value": 2e-4})),
    ("FP8 without scale", _set("scale", None)),
    ("FP8 with a ggml type", _set("ggml_type", {"name": "Q8_0", "id": 8})),
    ("multiplier with a fraction", _set("ngram.multipliers.0", 0.5)),
    ("multiplier past u64", _set("ngram.multipliers.0", 2**64)),
    ("other checksum", _set("checksums.algorithm", "md5")),
    ("crc past 32 bits", _set("checksums.blocks.0", 2**32)),
    ("no checksum blocks", _set("checksums.blocks", [])),
    ("bad table digest", _set("source.table_sha256", "00")),
    ("unknown layout", _set("layout.kind", "random")),
    ("residency not a list", _set("residency", {})),
    ("not an object", lambda manifest: [manifest]),
]


@pytest.mark.parametrize("change", [case[1] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_manifest_schema_refuses_broken(change, manifests):
    assert not VALIDATOR.is_valid(change(copy.deepcopy(manifests["fp8"])))


@pytest.mark.parametrize("change", [case[1] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_reader_check_refuses_what_the_schema_refuses(change, manifests):
    # The fast check at open is a subset of the schema: on each broken manifest both refuse.
    manifest = change(copy.deepcopy(manifests["fp8"]))
    assert not VALIDATOR.is_valid(manifest)
    with pytest.raises(BadInput):
        validate_manifest(manifest)
    with pytest.raises(BadInput, match="does not match the manifest schema"):
        validate_with_schema(manifest)


@pytest.mark.parametrize("name", ["fp8", "bf16", "nvfp4", "gguf", "profiled", "rank"])
def test_reader_check_accepts_what_the_schema_accepts(name, manifests):
    validate_manifest(copy.deepcopy(manifests[name]))
    validate_with_schema(copy.deepcopy(manifests[name]))


@pytest.mark.parametrize("case", ["missing data_file", "missing ggml_type", "page_size 4000",
                                  "table_sha256 00", "layout kind random", "file_id abc"])
def test_former_disagreements_are_refused_by_both(case, manifests):
    change = {"missing data_file": _delete("data_file"), "missing ggml_type": _delete("ggml_type"),
              "page_size 4000": _set("page_size", 4000), "table_sha256 00": _set("source.table_sha256", "00"),
              "layout kind random": _set("layout.kind", "random"), "file_id abc": _set("file_id", "abc")}[case]
    manifest = change(copy.deepcopy(manifests["bf16"]))
    assert not VALIDATOR.is_valid(manifest)
    with pytest.raises(BadInput):
        validate_manifest(manifest)


def _integers_written_as_floats(value):
    """`value` with every integer (not bool) below 2**53 written as a float, as some JSON tools do."""
    if isinstance(value, dict):
        return {key: _integers_written_as_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integers_written_as_floats(item) for item in value]
    if type(value) is int and abs(value) < 2**53:
        return float(value)
    return value


def test_a_table_whose_manifest_writes_integers_as_floats_opens_and_reads_the_same(fp8_table, tmp_path):
    import shutil

    from ple_prep.runtime import open_table

    table = tmp_path / "t.bin"
    shutil.copyfile(fp8_table, table)
    manifest = json.loads(manifest_path(fp8_table).read_text())
    floated = _integers_written_as_floats(manifest)
    assert floated["format_version"] == 2.0 and isinstance(floated["num_rows"], float)
    assert VALIDATOR.is_valid(floated)  # the schema cannot tell 2.0 from 2
    manifest_path(table).write_text(json.dumps(floated))
    ids = np.arange(0, FIXTURE_ROWS, 7)
    with open_table(fp8_table) as written, open_table(table) as rewritten:
        assert rewritten.manifest == manifest  # the floats read back as the integers they are
        assert np.array_equal(rewritten.gather(ids), written.gather(ids))


def test_reader_refuses_a_whole_float_a_double_may_have_rounded_where_an_integer_is_needed(manifests):
    # A multiplier is a u64: as a float at or above 2**53 it may have lost bits on its way.
    manifest = copy.deepcopy(manifests["bf16"])
    manifest["ngram"]["multipliers"][0] = float(2**60)
    with pytest.raises(BadInput, match="multipliers"):
        validate_manifest(manifest)
    manifest["ngram"]["multipliers"][0] = 2**60
    validate_manifest(manifest)


def test_the_schema_ships_in_the_package():
    # The wheel's package data names the schema, and the docs link to it, not to a copy.
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"format/manifest.schema.json"' in pyproject
    assert SCHEMA_PATH.parent.name == "format" and SCHEMA_PATH.is_file()
    assert not (Path(__file__).resolve().parents[1] / "docs" / "manifest.schema.json").exists()


def test_manifest_schema_gguf_type_must_match_encoding(manifests):
    manifest = copy.deepcopy(manifests["gguf"])
    assert manifest["ggml_type"] == {"name": "IQ4_NL", "id": 20}
    manifest["ggml_type"] = {"name": "Q4_0", "id": 2}
    assert not VALIDATOR.is_valid(manifest)
    manifest["ggml_type"] = None
    assert not VALIDATOR.is_valid(manifest)



def test_convert_never_publishes_a_manifest_the_schema_refuses(fp8_checkpoint, tmp_path):
    with open_source(fp8_checkpoint) as source:
        source.spec = dataclasses.replace(source.spec, vocab_size=0)
        with pytest.raises(BadInput, match="t.bin.json does not match the manifest schema: ngram.vocab_size"):
            convert(source, tmp_path / "t.bin")
    assert list(tmp_path.iterdir()) == []
