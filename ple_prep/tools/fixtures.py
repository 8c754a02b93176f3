"""Small checkpoints in the model's real layout, written with the `safetensors` library.

Every rule of the real model is kept; only `ngram_vocab_size_base` shrinks (1000 gives 16,896 rows).
The table's shards are spread over several files among unrelated tensors, the scale and the hash
constants sit in other files than the shards, and the last shard may be shorter.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize_file

from ..core.constants import GGUF_FIXTURE_VARIANTS, VALUES_PER_ROW
from ..core.errors import BadInput
from ..ngram import NgramSpec

PREFIX = "model.language_model.layers.1.ple.ple_embedding."
VARIANTS = ("fp8", "bf16", "nvfp4")
FIXTURE_SCALE_BF16 = 0x3953  # bf16 bits of about 2.0e-4, the size of the real scale


# The example checkpoint's geometry: a small ngram_vocab_size_base in the model's real layout.
FIXTURE_BASE = 1000
FIXTURE_SHARDS = 128


def fixture_config(base: int = FIXTURE_BASE, num_shards: int = FIXTURE_SHARDS) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_8FlashNextForCausalLM"],
        "model_type": "qwen3_8_flash_next",
        "vocab_size": 248320,
        "eos_token_id": 248044,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": base,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": num_shards,
        "torch_dtype": "bfloat16",
    }


# Rows of the example table (16 heads of consecutive primes from the base, padded to 128): what
# tests and docs compare with, never typed out.
FIXTURE_ROWS = NgramSpec.from_config(fixture_config()).rows_stored


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to nearest-even bf16 bits."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _shard_tensors(variant: str, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One shard's tensors for one variant, as (name suffix -> array) in stored byte form."""
    if variant == "fp8":
        codes = rng.integers(0, 256, size=(rows, VALUES_PER_ROW), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 0x01  # real tables hold no NaN codes
        return {"weight": codes}
    if variant == "bf16":
        return {"weight": _bf16_bits(rng.normal(0, 0.05, size=(rows, VALUES_PER_ROW)))}
    codes = rng.integers(0, 256, size=(rows, VALUES_PER_ROW // 2), dtype=np.uint8)
    # Block scales from e4m3 codes 0x20-0x4f: positive, normal, no NaN.
    scales = rng.integers(0x20, 0x50, size=(rows, VALUES_PER_ROW // 16), dtype=np.uint8)
    return {"weight": codes, "weight_scale": scales}


_DTYPES = {("fp8", "weight"): "float8_e4m3fn", ("bf16", "weight"): "bfloat16",
           ("nvfp4", "weight"): "uint8", ("nvfp4", "weight_scale"): "float8_e4m3fn"}
# Streams of the seeded generator: each shard and each filler tensor draws from its own, so any
# one file can be written without generating the others (memory stays one file's worth).
_SHARD_STREAM, _FILLER_STREAM = 1, 2


def make_checkpoint(out: str | Path, variant: str = "fp8", *, base: int = FIXTURE_BASE,
                    num_shards: int = FIXTURE_SHARDS, num_files: int = 3, with_index: bool = True,
                    seed: int = 0, prefix: str = PREFIX, with_tokenizer: bool = True) -> Path:
    """Write a checkpoint folder; returns its path. Deterministic for a given seed.

    Shard i goes to file i % num_files; the hash constants sit in the first file and the FP8 scale
    in the last, away from most shards. Files are generated one at a time, so a large table
    (a big `base`) needs memory for one file only: raise `num_files` to shrink it. With
    `with_tokenizer`, also a trained `tokenizer.json` and a `tokenizer_config.json` with a chat
    template (`write_tokenizer`), so text prompts can be profiled.
    """
    if variant not in VARIANTS:
        raise BadInput(f"unknown fixture variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if num_shards < 1 or num_files < 1:
        raise BadInput("a checkpoint needs at least one shard and one file")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = fixture_config(base, num_shards)
    spec = NgramSpec.from_config(config)
    rows = spec.rows_stored
    shard_rows = -(-rows // num_shards)
    if (num_shards - 1) * shard_rows >= rows:
        raise BadInput(f"{rows} rows cannot be split into {num_shards} shards of {shard_rows}")
    weight_map: dict[str, str] = {}
    total_size = 0
    for file_index in range(num_files):
        # Unrelated tensors of other layers, so the table is mixed with other data.
        filler = np.random.default_rng((seed, _FILLER_STREAM, file_index))
        tensors: dict[str, tuple[str, np.ndarray]] = {
            f"model.language_model.layers.{file_index}.mlp.up_proj.weight":
                ("bfloat16", _bf16_bits(filler.normal(size=(64, 32))))}
        for shard in range(file_index, num_shards, num_files):
            start, stop = shard * shard_rows, min(rows, (shard + 1) * shard_rows)
            rng = np.random.default_rng((seed, _SHARD_STREAM, shard))
            for kind, array in _shard_tensors(variant, stop - start, rng).items():
                tensors[f"{prefix}ngram_embedding.shard_{shard}.{kind}"] = (
                    _DTYPES[(variant, kind)], array)
            if variant == "nvfp4":
                tensors[f"{prefix}ngram_embedding.shard_{shard}.weight_scale_2"] = (
                    "float32", np.array([0.0123], dtype=np.float32))
        if variant == "fp8" and file_index == num_files - 1:
            tensors[f"{prefix}ngram_embedding.weight_scale"] = (
                "bfloat16", np.array([FIXTURE_SCALE_BF16], dtype=np.uint16))
        if file_index == 0:
            for suffix, values in (("layer_multipliers", spec.multipliers),
                                   ("ngram_heads_offsets", spec.head_offsets),
                                   ("ngram_heads_vocab_sizes", spec.head_sizes)):
                tensors[f"{prefix}{suffix}"] = ("int64", np.array(values, dtype=np.int64))
        name = f"model-{file_index + 1:05d}-of-{num_files:05d}.safetensors"
        write_safetensors(out / name, tensors)
        weight_map.update({tensor: name for tensor in tensors})
        total_size += sum(array.nbytes for _, array in tensors.values())
        del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if with_index:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if with_tokenizer:
        write_tokenizer(out, config["eos_token_id"])
    return out


# The names make_checkpoint and make_gguf write: the only files `force` may replace in a folder.
_FIXTURE_FILE = re.compile(r"config\.json|model\.safetensors\.index\.json|tokenizer(_config)?\.json"
                           r"|model-\d{5}-of-\d{5}\.(safetensors|gguf)|model\.gguf")


def make_fixture(out: str | Path, variant: str = "fp8", *, force: bool = False, base: int = FIXTURE_BASE,
                 num_shards: int = FIXTURE_SHARDS, gguf_layout: str = "joined", gguf_files: int = 1,
                 seed: int = 0) -> Path:
    """The example checkpoint (`variant` fp8, bf16, nvfp4 or gguf-TYPE) in the folder `out`, whole.

    An existing `out` is replaced only with `force`, and only when it holds nothing but the files a
    fixture has: the new folder is written beside it and renamed over it, so `out` never mixes two
    variants (a folder with both GGUF and safetensors files is one convert refuses) and a refused
    or failed run leaves nothing behind.
    """
    if type(seed) is not int or seed < 0:
        # numpy's generators take no negative seed.
        raise BadInput(f"the fixture seed must be a non-negative integer, not {seed!r}")
    out = Path(out)
    if os.path.lexists(out):
        if not out.is_dir() or out.is_symlink():
            raise BadInput(f"{out} exists and is not a folder; choose another folder")
        names = sorted(path.name for path in out.iterdir())
        strangers = [name for name in names if not _FIXTURE_FILE.fullmatch(name)]
        if names and not force:
            raise BadInput(f"{out} exists; pass --force to replace it")
        if strangers:
            raise BadInput(f"{out} holds files a fixture does not write ({', '.join(strangers[:3])}"
                           f"{', ...' if len(strangers) > 3 else ''}): choose another folder "
                           f"(even --force replaces only a fixture's folder)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    try:
        if variant.startswith("gguf-"):
            make_gguf(partial, variant.removeprefix("gguf-"), layout=gguf_layout, num_files=gguf_files,
                      base=base, seed=seed)
        else:
            make_checkpoint(partial, variant, base=base, num_shards=num_shards, seed=seed)
        if os.path.lexists(out):
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            os.rename(out, old)
            try:
                os.rename(partial, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old)
        else:
            os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


# ChatML, as the Qwen family's templates render a plain conversation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_TRAINING_WORDS = (
    "the a of to and in is it that for on with as was by this be are from at or an which not "
    "table row page read disk cache token model prompt request layer hash head gram value file "
    "memory serve fast storage quick brown fox jumps over lazy dog def return import class self "
    "print if else for while None True False numpy array index order slot").split()


def write_tokenizer(out: Path, eos_token_id: int, vocab_size: int = 800) -> None:
    """Train a small byte-level BPE tokenizer with `tokenizers` on fixed text; deterministic.

    The chat markers sit at the real model's ids (`<|im_end|>` is the EOS id), so a rendered
    conversation's turn ends cut the n-gram windows as they do in the model.
    """
    from tokenizers import decoders

    from .realtext import train_bpe

    rng = np.random.default_rng(1234)
    lines = [" ".join(rng.choice(_TRAINING_WORDS, size=12)) + "." for _ in range(400)]
    tokenizer = train_bpe(lines, vocab_size)
    tokenizer.decoder = decoders.ByteLevel()
    data = json.loads(tokenizer.to_str())
    special = {"<|im_start|>": eos_token_id - 1, "<|im_end|>": eos_token_id,
               "<|endoftext|>": eos_token_id + 1}
    # In the model vocabulary too, so the added tokens keep these ids instead of being renumbered.
    data["model"]["vocab"].update(special)
    data["added_tokens"] = [{"id": token_id, "content": content, "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False, "special": True}
                            for content, token_id in special.items()]
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 262144,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write (dtype name, array of the stored bytes) pairs through the safetensors library.

    The binding's numpy front end has no FP8 or bf16 dtype, so arrays carry the raw stored bytes
    and the dtype is named explicitly.
    """
    arrays = {name: (dtype, np.ascontiguousarray(array)) for name, (dtype, array) in tensors.items()}
    specs = {name: TensorSpec(dtype=dtype, shape=array.shape, data_ptr=array.ctypes.data,
                              data_len=array.nbytes)
             for name, (dtype, array) in arrays.items()}
    serialize_file(specs, str(path), metadata={"format": "pt"})


# --- GGUF fixtures (docs/MODEL.md) ---------------------------------------------------------------

GGUF_TYPES = tuple(variant.removeprefix("gguf-") for variant in GGUF_FIXTURE_VARIANTS)
GGUF_LAYOUTS = ("joined", "split")


def gguf_table_bytes(ggml_type: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A table quantised by `gguf.quants.quantize`, as uint8 `(rows, row_bytes)`.

    The gguf package cannot quantise IQ4_NL, so its blocks are composed directly: an f16 scale
    and 32 random 4-bit indices into the code book.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[ggml_type.upper()]
    if qtype == GGMLQuantizationType.IQ4_NL:
        blocks = rows * VALUES_PER_ROW // 32
        scales = rng.uniform(2e-4, 1e-3, size=(blocks, 1)).astype("<f2").view(np.uint8)
        codes = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
        return np.concatenate([scales, codes], axis=1).reshape(rows, -1)
    values = rng.normal(0, 0.05, size=(rows, VALUES_PER_ROW)).astype(np.float32)
    return np.ascontiguousarray(quantize(values, qtype)).view(np.uint8).reshape(rows, -1)


def add_gguf_metadata(writer: Any, spec: NgramSpec, vocab_size: int = 248320) -> None:
    """The qwen4exp keys the converter reads: the hash constants as 64-bit integers."""
    from gguf import GGUFValueType

    arch = writer.arch
    writer.add_uint32(f"{arch}.vocab_size", vocab_size)
    writer.add_uint32(f"{arch}.embedding_length_per_layer_input", spec.values_per_row)
    writer.add_uint32(f"{arch}.ple.ngram_size", spec.ngram_size)
    writer.add_uint32(f"{arch}.ple.heads_per_ngram", spec.heads_per_ngram)
    writer.add_uint32(f"{arch}.ple.eos_token_id", spec.eos_token_id)
    for key, values in (("layer_multipliers", spec.multipliers), ("head_offsets", spec.head_offsets),
                        ("head_vocab_sizes", spec.head_sizes)):
        writer.add_key_value(f"{arch}.ple.{key}", list(values), GGUFValueType.ARRAY,
                             sub_type=GGUFValueType.UINT64)


def make_gguf(out: str | Path, ggml_type: str = "q8_0", *, layout: str = "joined",
              num_files: int = 1, base: int = FIXTURE_BASE, seed: int = 0,
              arch: str = "qwen4exp") -> Path:
    """Write a GGUF model folder with `GGUFWriter`; returns the folder. Deterministic per seed.

    `layout` "joined" writes `per_layer_token_embd.weight` [160, rows_stored]; "split" writes the
    16 head tensors `ple_ngram_embd.{h}.weight` [160, size[h]] (in a shuffled order). With
    `num_files` > 1 the tensors, among unrelated ones, go to `model-0000k-of-0000N.gguf`.
    """
    from gguf import GGMLQuantizationType, GGUFWriter

    if ggml_type not in GGUF_TYPES:
        raise BadInput(f"unknown GGUF fixture type {ggml_type!r}; choose from {', '.join(GGUF_TYPES)}")
    if layout not in GGUF_LAYOUTS:
        raise BadInput(f"unknown GGUF layout {layout!r}; choose from {', '.join(GGUF_LAYOUTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = NgramSpec.from_config(fixture_config(base))
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[ggml_type.upper()]
    table = gguf_table_bytes(ggml_type, spec.rows_stored, rng)
    if layout == "joined":
        tensors = [("per_layer_token_embd.weight", table)]
    else:
        tensors = [(f"ple_ngram_embd.{h}.weight", table[offset:offset + size])
                   for h, (offset, size) in enumerate(zip(spec.head_offsets, spec.head_sizes))]
        tensors = [tensors[i] for i in rng.permutation(len(tensors))]
    unrelated = [(f"blk.{i}.attn_norm.weight", rng.normal(size=64).astype(np.float32))
                 for i in range(2)]
    tensors = unrelated[:1] + tensors + unrelated[1:]
    per_file = -(-len(tensors) // num_files) if num_files > 1 else 0
    writer = GGUFWriter(out / "model.gguf", arch, split_max_tensors=per_file)
    add_gguf_metadata(writer, spec)
    for name, array in tensors:
        if array.dtype == np.uint8:
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
