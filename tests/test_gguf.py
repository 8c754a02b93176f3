"""GGUF input: every type and layout converts with each row's bytes kept and values bit-exact."""
from __future__ import annotations

import dataclasses
import itertools

import gguf
import numpy as np
import pytest

from ple_prep.converters import open_source, read_spec
from ple_prep.converters.gguf import gguf_files, open_gguf, spec_from_metadata
from ple_prep.converters.gguf_header import read_gguf_header
from ple_prep.core.constants import ENCODING_BLOCKS, GGML_TYPES, Encoding
from ple_prep.core.errors import BadInput
from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.offline.verify import verify
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import GGUF_TYPES, fixture_config, make_gguf

SPEC = NgramSpec.from_config(fixture_config())
CASES = list(itertools.product(GGUF_TYPES, ("joined", "split"), (1, 3)))


def expected_table(folder, ggml_type: str, layout: str) -> np.ndarray:
    """The table's rows straight from the files through gguf's own reader, padded as documented."""
    rows = []
    for path in gguf_files(folder):
        for tensor in gguf.GGUFReader(path).tensors:
            if tensor.name.startswith(("per_layer_token_embd", "ple_ngram_embd")):
                rows.append((tensor.name, np.array(tensor.data).view(np.uint8).reshape(
                    int(tensor.shape[1]), -1)))
    if layout == "joined":
        assert len(rows) == 1
        return rows[0][1]
    heads = dict(rows)
    table = np.zeros((SPEC.rows_stored, heads["ple_ngram_embd.0.weight"].shape[1]), dtype=np.uint8)
    for head, (offset, size) in enumerate(zip(SPEC.head_offsets, SPEC.head_sizes)):
        table[offset:offset + size] = heads[f"ple_ngram_embd.{head}.weight"]
    return table


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {case: make_gguf(root / "-".join(map(str, case)), case[0], layout=case[1],
                            num_files=case[2], seed=len(case[0]))
            for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_convert_gguf_keeps_row_bytes_and_values(case, models, tmp_path):
    ggml_type, layout, num_files = case
    folder = models[case]
    assert len(gguf_files(folder)) == num_files
    expected = expected_table(folder, ggml_type, layout)
    with open_source(folder) as source:
        assert source.num_rows == SPEC.rows_stored and source.row_bytes == expected.shape[1]
        assert np.array_equal(source.read_rows(0, source.num_rows), expected)
        manifest = convert(source, tmp_path / "t.bin")
    assert manifest["encoding"] == f"gguf_{ggml_type}"
    assert manifest["ggml_type"] == {"name": ggml_type.upper(),
                                     "id": int(gguf.GGMLQuantizationType[ggml_type.upper()])}
    assert manifest["source"]["table_layout"] == layout
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(1).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])
        reference = gguf.quants.dequantize(expected[ids], gguf.GGMLQuantizationType[ggml_type.upper()])
        values = table.values(ids)
        assert values.dtype == np.float32
        assert np.array_equal(values.view(np.uint32), reference.reshape(values.shape).view(np.uint32))
    assert verify(tmp_path / "t.bin", folder).ok


def test_convert_gguf_split_heads_pad_with_zero_rows(models, tmp_path):
    folder = models[("q8_0", "split", 1)]
    with open_source(folder) as source:
        assert source.extra["zero_rows"] == [SPEC.rows_used, SPEC.rows_stored]
        convert(source, tmp_path / "t.bin")
    with open_table(tmp_path / "t.bin") as table:
        padding = np.arange(SPEC.rows_used, SPEC.rows_stored)
        assert not table.gather(padding).any()
        assert not table.values(padding).any()


def test_convert_gguf_spec_from_metadata_hashes_like_config(models):
    with open_source(models[("iq4_nl", "joined", 1)]) as source:
        spec = source.spec
    for field in ("multipliers", "head_sizes", "head_offsets", "eos_token_id", "vocab_size",
                  "rows_used", "rows_stored", "values_per_row"):
        assert getattr(spec, field) == getattr(SPEC, field)
    assert read_spec(models[("iq4_nl", "joined", 1)] / "model.gguf") == spec
    tokens = [9707, 11, 1879, 248044, 40]
    assert np.array_equal(row_ids(tokens, spec), row_ids(tokens, SPEC))


@pytest.mark.parametrize("pick", ["folder", "first", "middle"])
def test_convert_gguf_split_files_found_from_any_member(models, pick):
    folder = models[("q4_0", "split", 3)]
    files = sorted(folder.glob("*.gguf"))
    path = {"folder": folder, "first": files[0], "middle": files[1]}[pick]
    with open_gguf(path) as source:
        assert [f.name for f in source.files] == [f.name for f in files]
        assert len({s.path for s in source.parts[0] if s.path is not None}) > 1


def test_convert_gguf_spec_rejects_inconsistent_metadata():
    good = {"qwen4exp.ple.layer_multipliers": list(SPEC.multipliers),
            "qwen4exp.ple.head_offsets": list(SPEC.head_offsets),
            "qwen4exp.ple.head_vocab_sizes": list(SPEC.head_sizes),
            "qwen4exp.ple.ngram_size": 3, "qwen4exp.ple.heads_per_ngram": 8,
            "qwen4exp.ple.eos_token_id": 248044, "qwen4exp.embedding_length_per_layer_input": 160,
            "qwen4exp.vocab_size": 248320}
    assert spec_from_metadata(good).multipliers == SPEC.multipliers
    bad = {
        "lacks": {"qwen4exp.ple.head_offsets": None},
        "integers": {"qwen4exp.ple.layer_multipliers": [float(m) for m in SPEC.multipliers]},
        "running sums": {"qwen4exp.ple.head_offsets": [0] + list(SPEC.head_offsets[2:]) + [1]},
        "consecutive primes": {"qwen4exp.ple.head_vocab_sizes": [1009] * 16,
                               "qwen4exp.ple.head_offsets": [1009 * h for h in range(16)]},
        "disagree": {"qwen4exp.vocab_size": 151936},
        "odd": {"qwen4exp.ple.layer_multipliers": [2, 4, 6]},
        "expected 3": {"qwen4exp.ple.layer_multipliers": list(SPEC.multipliers[:2])},
    }
    for message, change in bad.items():
        metadata = {k: v for k, v in (good | change).items() if v is not None}
        with pytest.raises(BadInput, match=message):
            spec_from_metadata(metadata)


def test_convert_gguf_encoding_table_matches_gguf_package():
    for encoding, (name, type_id) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert int(qtype) == type_id
        assert ENCODING_BLOCKS[encoding] == gguf.GGML_QUANT_SIZES[qtype]
    assert {e for e in Encoding if e.label.startswith("gguf_")} == set(GGML_TYPES)


def write_with_vocabulary(path, tokens: int, keep_vocab_size: bool) -> np.ndarray:
    from gguf import GGUFValueType, GGUFWriter

    from ple_prep.tools.fixtures import add_gguf_metadata, gguf_table_bytes

    writer = GGUFWriter(path, "qwen4exp")
    add_gguf_metadata(writer, SPEC)
    if not keep_vocab_size:
        del writer.kv_data[0]["qwen4exp.vocab_size"]
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(tokens)])
    writer.add_key_value("tokenizer.ggml.scores", [0.5] * 1000, GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.FLOAT32)
    table = gguf_table_bytes("q4_0", SPEC.rows_stored, np.random.default_rng(0))
    writer.add_tensor("per_layer_token_embd.weight", table, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return table


def write_split_heads(path, spec: NgramSpec, ggml_type: str) -> None:
    """The split-head table of SPEC (rows of 160 values) under `spec`'s metadata."""
    from gguf import GGUFWriter

    from ple_prep.tools.fixtures import add_gguf_metadata, gguf_table_bytes

    writer = GGUFWriter(path, "qwen4exp")
    add_gguf_metadata(writer, spec)
    table = gguf_table_bytes(ggml_type, SPEC.rows_stored, np.random.default_rng(0))
    for head, (offset, size) in enumerate(zip(SPEC.head_offsets, SPEC.head_sizes)):
        writer.add_tensor(f"ple_ngram_embd.{head}.weight", table[offset:offset + size],
                          raw_dtype=gguf.GGMLQuantizationType[ggml_type.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_convert_gguf_split_heads_refuse_a_metadata_width_of_partial_blocks(tmp_path):
    # 88 values a row is not a whole number of Q8_0 blocks (32 values); the heads hold 160.
    narrow = dataclasses.replace(SPEC, ple_embed_dim=88 * SPEC.heads)
    write_split_heads(tmp_path / "model.gguf", narrow, "q8_0")
    with pytest.raises(BadInput, match=rf"ple_ngram_embd\.0\.weight has ggml dims \[160, {SPEC.head_sizes[0]}\]; "
                                       r"expected \[88, rows\]"):
        open_gguf(tmp_path / "model.gguf")


def _stock_value(field) -> object:
    """A field of gguf's own reader as plain Python (string arrays as their count of Nones)."""
    if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        return [None] * len(field.data)
    value = field.contents()
    return [v.item() if hasattr(v, "item") else v for v in value] if isinstance(value, list) else value


def test_gguf_header_parser_reads_what_the_gguf_package_reads(tmp_path):
    write_with_vocabulary(tmp_path / "v.gguf", 5000, keep_vocab_size=True)
    ours, stock = read_gguf_header(tmp_path / "v.gguf"), gguf.GGUFReader(tmp_path / "v.gguf")
    fields = {key: field for key, field in stock.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, field in fields.items():
        assert ours.metadata[key] == _stock_value(field), key
        assert type(ours.metadata[key]) is type(_stock_value(field)) or isinstance(ours.metadata[key], list), key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 5000
    assert ours.data_offset == stock.data_offset and ours.alignment == stock.alignment
    assert [(t.name, t.offset, t.nbytes, t.dims) for t in ours.tensors] == \
        [(t.name, int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in t.shape)) for t in stock.tensors]


def test_gguf_header_parser_refuses_a_version_it_does_not_know(tmp_path):
    write_with_vocabulary(tmp_path / "v.gguf", 10, keep_vocab_size=True)
    raw = bytearray((tmp_path / "v.gguf").read_bytes())
    for version, message in ((1, "GGUF version 1"), (4, "GGUF version 4; this reader knows versions 2, 3")):
        raw[4:8] = version.to_bytes(4, "little")
        (tmp_path / "w.gguf").write_bytes(bytes(raw))
        with pytest.raises(BadInput, match=message):
            read_gguf_header(tmp_path / "w.gguf")


def test_convert_gguf_vocab_size_from_token_count(tmp_path):
    table = write_with_vocabulary(tmp_path / "v.gguf", 248320, keep_vocab_size=False)
    with open_gguf(tmp_path / "v.gguf") as source:
        assert source.spec.vocab_size == 248320
        assert np.array_equal(source.read_rows(0, source.num_rows), table)
