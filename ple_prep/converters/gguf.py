"""GGUF checkpoints of architecture qwen4exp (docs/MODEL.md), packed rows kept byte for byte.

The table is either joined (`per_layer_token_embd.weight`, ggml dims [160, rows]) or split into the
16 hash heads (`ple_ngram_embd.{h}.weight`, head h holding rows [offset[h], offset[h] + size[h])).
Files may be split `NAME-0000k-of-0000N.gguf`; every file of the set is searched.

A split-head table stores only the rows the hash reaches (rows_used); the prepared table keeps the
model's geometry (rows_stored, a multiple of 128, the same as the joined table and the safetensors
checkpoints, so global ids and tensor-parallel blocks line up) and fills the rows past rows_used
with zero bytes, which every GGUF type decodes to 0.0. No token ever hashes to them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES, QK_K

from ..core.constants import (
    DEFAULT_SEED,
    GGML_TYPES,
    GGUF_ARCHITECTURE,
    GGUF_JOINED_TENSOR,
    GGUF_SPLIT_NAME,
    Encoding,
    row_bytes_for,
)
from ..core.errors import BadInput
from ..ngram import NgramSpec, check_table_bounds, primes_from, running_offsets
from .base import Segment, SourceFile, TableSource
from .gguf_header import SUPPORTED_TYPES, TensorInfo, k_quant_refusal, read_gguf_header

HEAD_NAME = re.compile(r"^ple_ngram_embd\.(\d+)\.weight$")
ENCODINGS = {GGMLQuantizationType(type_id): encoding for encoding, (_, type_id) in GGML_TYPES.items()}


def gguf_files(path: Path) -> list[Path]:
    """The files of one GGUF model: a file (and its split siblings) or the model in a folder."""
    if path.is_dir():
        candidates = sorted(path.glob("*.gguf"))
        if not candidates:
            raise BadInput(f"no *.gguf files in {path}")
        models = sorted({_model_key(p) for p in candidates})
        if len(models) > 1:
            raise BadInput(f"{path} holds {len(models)} GGUF models ({', '.join(models[:4])}); "
                           f"pass one .gguf file instead of the folder")
        first = next(p for p in candidates if _model_key(p) == models[0])
    else:
        first = path
    match = GGUF_SPLIT_NAME.match(first.name)
    if not match:
        return [first]
    stem, count = match.group("stem"), int(match.group("count"))
    siblings = first.parent.glob(f"{_glob_escape(stem)}-*-of-*.gguf")
    found = {int(m.group("index")): p for p in siblings
             if (m := GGUF_SPLIT_NAME.match(p.name)) and m.group("stem") == stem}
    counts = {int(GGUF_SPLIT_NAME.match(p.name).group("count")) for p in found.values()}
    if counts != {count} or count < 1:
        raise BadInput(f"split files of {stem} disagree on their count ({sorted(counts)})")
    missing = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1) if i not in found]
    if missing:
        raise BadInput(f"split GGUF {stem} lacks {', '.join(missing[:5])} "
                       f"({len(missing)} of {count} files missing)")
    return [found[i] for i in range(1, count + 1)]


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _model_key(path: Path) -> str:
    match = GGUF_SPLIT_NAME.match(path.name)
    return match.group("stem") if match else path.name


def spec_from_metadata(metadata: dict[str, Any], arch: str = GGUF_ARCHITECTURE,
                       divisible_by: int = 128) -> NgramSpec:
    """The hash spec of a GGUF model from its `{arch}.ple.*` keys (plain Python values).

    The stored multipliers, head sizes and offsets are the hash; everything else is checked
    against them: lengths, offsets as running sums from 0, head sizes as consecutive primes,
    and the multipliers the seed derives from the vocabulary size. GGUF keeps no
    `ngram_vocab_size_base`; the first head size stands in for it (it gives the same primes).
    """
    prefix = f"{arch}.ple."
    keys = {"multipliers": prefix + "layer_multipliers", "offsets": prefix + "head_offsets",
            "sizes": prefix + "head_vocab_sizes", "ngram_size": prefix + "ngram_size",
            "heads_per_ngram": prefix + "heads_per_ngram", "eos": prefix + "eos_token_id",
            "row_values": f"{arch}.embedding_length_per_layer_input",
            "vocab_size": f"{arch}.vocab_size"}
    missing = [key for name, key in keys.items() if name != "vocab_size" and key not in metadata]
    if missing:
        raise BadInput(f"GGUF metadata lacks {', '.join(missing)}: not a {arch} n-gram PLE model")
    if keys["vocab_size"] not in metadata:
        # The manifest records the vocabulary size, and the multipliers are checked against it.
        raise BadInput(f"GGUF metadata lacks {keys['vocab_size']} (and tokenizer.ggml.tokens, whose "
                       f"count stands in for it): the vocabulary size is unknown")
    values = {name: metadata[key] for name, key in keys.items()}
    values["seed"] = metadata.get(prefix + "seed", DEFAULT_SEED)
    integers = all(type(v) is int for n, v in values.items() if n not in ("multipliers", "offsets", "sizes"))
    lists = all(isinstance(values[n], (list, tuple)) and all(type(v) is int for v in values[n])
                for n in ("multipliers", "offsets", "sizes"))
    if not (integers and lists):
        raise BadInput(f"GGUF metadata {prefix}* must hold integers (never floats: the "
                       f"multipliers need 45 bits)")
    ngram_size, heads_per_ngram = values["ngram_size"], values["heads_per_ngram"]
    multipliers, offsets, sizes = (tuple(values[n]) for n in ("multipliers", "offsets", "sizes"))
    if ngram_size < 2 or heads_per_ngram < 1 or values["row_values"] < 1:
        raise BadInput(f"GGUF metadata: ngram_size {ngram_size}, heads_per_ngram "
                       f"{heads_per_ngram}, {values['row_values']} values per row are out of range")
    heads = (ngram_size - 1) * heads_per_ngram
    if len(multipliers) != ngram_size or len(offsets) != heads or len(sizes) != heads:
        raise BadInput(f"GGUF metadata: {len(multipliers)} multipliers, {len(offsets)} head "
                       f"offsets and {len(sizes)} head sizes; expected {ngram_size}, {heads}, {heads}")
    check_table_bounds(heads, sum(sizes), "GGUF metadata")
    if any(m <= 0 or m % 2 == 0 or m >= 2**63 for m in multipliers):
        raise BadInput(f"GGUF metadata multipliers {list(multipliers)} must be odd and positive")
    running = running_offsets(sizes)
    if offsets != running:
        raise BadInput(f"GGUF metadata head offsets {list(offsets)} are not the running sums "
                       f"of the head sizes {list(running)}")
    if sizes[0] < 2 or tuple(primes_from(sizes[0], heads)) != sizes:
        raise BadInput(f"GGUF metadata head sizes {list(sizes)} are not consecutive primes")
    vocab_size, seed = values["vocab_size"], values["seed"]
    derived = NgramSpec.derive(
        vocab_size=vocab_size, eos_token_id=values["eos"], ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram, seed=seed, ngram_vocab_size_base=sizes[0],
        make_ngram_vocab_size_divisible_by=divisible_by, ple_embed_dim=values["row_values"] * heads,
        where="GGUF metadata")
    if derived.multipliers != multipliers:
        raise BadInput(f"GGUF metadata multipliers {list(multipliers)} disagree with "
                       f"{list(derived.multipliers)}, derived from vocab_size {vocab_size} "
                       f"and seed {seed}")
    return NgramSpec(vocab_size, values["eos"], ngram_size, heads_per_ngram, seed, 0,
                     values["row_values"] * heads, sizes[0], divisible_by, multipliers, sizes, offsets)


def _read_files(files: list[Path]) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorInfo] = {}
    for number, path in enumerate(files):
        header = read_gguf_header(path)
        for key, value in header.metadata.items():
            if key.startswith("split."):
                _check_split_key(path, key, value, number, len(files))
            elif key in metadata and metadata[key] != value:
                raise BadInput(f"{path.name} sets {key} to {value!r}, another file of the set to "
                               f"{metadata[key]!r}")
            else:
                metadata[key] = value
        for tensor in header.tensors:
            if tensor.name in tensors:
                raise BadInput(f"tensor {tensor.name} is in both {tensors[tensor.name].path.name} "
                               f"and {path.name}")
            tensors[tensor.name] = tensor
    return metadata, tensors


def _check_split_key(path: Path, key: str, value: Any, number: int, count: int) -> None:
    expected = {"split.no": number, "split.count": count}.get(key)
    if expected is not None and value != expected:
        raise BadInput(f"{path.name}: {key} is {value} but the file is number {number} of "
                       f"{count} found; a split file is missing or misnamed")


def _encoding_of(tensors: list[TensorInfo], width: int) -> Encoding:
    """The table's encoding; `width` is the row width the metadata gives."""
    kinds = sorted({t.ggml_type.name for t in tensors})
    if len(kinds) > 1:
        raise BadInput(f"the table's tensors mix GGML types {', '.join(kinds)}")
    ggml_type = tensors[0].ggml_type
    if ggml_type in ENCODINGS:
        return ENCODINGS[ggml_type]
    if GGML_QUANT_SIZES[ggml_type][0] == QK_K and width % QK_K:
        raise BadInput(k_quant_refusal("the table", ggml_type, width))
    raise BadInput(f"the table is GGML type {ggml_type.name}, unsupported; expected one of {SUPPORTED_TYPES}")


def _check_dims(tensor: TensorInfo, width: int, rows: int | None) -> int:
    """The tensor's row count, after checking it is [width, rows]. Rows of `width` values are then
    whole blocks: the header's parse refuses a tensor whose rows are not (gguf_header._tensor_bytes)."""
    if len(tensor.dims) != 2 or tensor.dims[0] != width:
        raise BadInput(f"{tensor.name} has ggml dims {list(tensor.dims)}; expected [{width}, rows] "
                       f"({width} values a row, from embedding_length_per_layer_input)")
    if rows is not None and tensor.dims[1] != rows:
        raise BadInput(f"{tensor.name} has {tensor.dims[1]} rows; the metadata's head size is {rows}")
    return tensor.dims[1]


def open_gguf(path: str | Path) -> TableSource:
    """Find and validate the n-gram table of a GGUF model (a .gguf file, split set, or folder)."""
    path = Path(path)
    files = gguf_files(path)
    metadata, tensors = _read_files(files)
    architecture = metadata.get("general.architecture")
    if architecture != GGUF_ARCHITECTURE:
        raise BadInput(f"not a Qwen3.8-Flash-Next model: general.architecture is {architecture!r}, expected "
                       f"{GGUF_ARCHITECTURE!r} (Gemma 3n/4 use the same tensor names for a different table)")
    if f"{GGUF_ARCHITECTURE}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in metadata:
        metadata[f"{GGUF_ARCHITECTURE}.vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    spec = spec_from_metadata(metadata, GGUF_ARCHITECTURE)
    width = spec.values_per_row

    joined = tensors.get(GGUF_JOINED_TENSOR)
    heads = {int(m.group(1)): t for name, t in tensors.items() if (m := HEAD_NAME.match(name))}
    if joined is not None and heads:
        raise BadInput(f"both {GGUF_JOINED_TENSOR} and {len(heads)} ple_ngram_embd head tensors; "
                       f"a model holds one table")
    if joined is None and not heads:
        raise BadInput(f"no n-gram PLE table ({GGUF_JOINED_TENSOR} or ple_ngram_embd.{{h}}.weight) "
                       f"in {', '.join(f.name for f in files)}")
    if joined is not None:
        encoding = _encoding_of([joined], width)
        num_rows = _check_dims(joined, width, None)
        if num_rows < spec.rows_used:
            raise BadInput(f"{joined.name} has {num_rows} rows but the hash reaches row "
                           f"{spec.rows_used - 1}")
        row_bytes = row_bytes_for(encoding, width)
        segments = [Segment(joined.path, joined.offset, 0, num_rows, row_bytes)]
        table_tensors = [joined]
    else:
        wrong = sorted(set(heads) ^ set(range(spec.heads)))
        if wrong:
            raise BadInput(f"split table: head tensors {', '.join(map(str, wrong))} missing or "
                           f"extra; expected ple_ngram_embd.0-{spec.heads - 1}.weight")
        table_tensors = [heads[h] for h in range(spec.heads)]
        encoding = _encoding_of(table_tensors, width)
        for head, tensor in enumerate(table_tensors):
            _check_dims(tensor, width, spec.head_sizes[head])
        row_bytes = row_bytes_for(encoding, width)
        segments = [Segment(tensor.path, tensor.offset, offset, size, row_bytes)
                    for tensor, offset, size in zip(table_tensors, spec.head_offsets, spec.head_sizes)]
        if spec.rows_stored > spec.rows_used:
            segments.append(Segment(None, 0, spec.rows_used, spec.rows_stored - spec.rows_used,
                                    row_bytes))
    name, type_id = GGML_TYPES[encoding]
    extra = {"ggml_type": name, "ggml_type_id": type_id,
             "table_layout": "joined" if joined is not None else "split",
             "tensors": [t.name for t in table_tensors],
             "zero_rows": [spec.rows_used, spec.rows_stored] if joined is None else None}
    return TableSource(format="gguf", model_dir=path, encoding=encoding, values_per_row=width,
                       parts=[segments], spec=spec,
                       files=[SourceFile(f.name, f.stat().st_size) for f in files], extra=extra)
