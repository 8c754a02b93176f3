"""The prepared file's constants and the model's fixed names, in one table-like module.

Nothing here imports more than the standard library, so the runtime can use it with numpy alone.
"""
from __future__ import annotations

import enum
import re
import struct

# --- Prepared file, format v2 (docs/FORMAT.md) -------------------------------------------------

MAGIC = b"PLEPREP\x00"
# Written: 2. Read: 1 too (its order map holds two more arrays; docs/FORMAT.md, "Compatibility").
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
DEFAULT_PAGE_SIZE = 4096
# Little-endian fixed header: magic, then u32 version, page_size, row_bytes, rows_per_page, encoding,
# values_per_row, then u64 num_rows, first_row, num_placed, order_offset, data_offset, then the
# 16-byte file id and the 32-byte spec digest of the manifest (format/manifest.py: spec_digest).
# HEADER_SIZE bytes in all, the unused tail zero.
HEADER_STRUCT = struct.Struct("<8sIIIIIIQQQQQ16s32s")
HEADER_SIZE = 128
# The row-order map starts right after the header; its arrays are uint32 (row ids < 2**32).
ORDER_OFFSET = HEADER_SIZE
ORDER_DTYPE = "<u4"
MAX_ROWS = 2**32 - 1
# The row-order map of an access-ordered table may cost at most this fraction of the table's bytes
# by default, counted as a server holds it (format/order.py, lookup_index_bytes: 2 bits a table row
# and each placed row's slot in the bits the slots need). A placed n-gram costs one page read
# instead of eight whether resident or not, so byte for byte the index is worth more than resident
# pages even at a 1% budget: the cap is set to place every group of a profile of real text even
# where a third of the rows are shared (BENCHMARKS.md, "Page reads per token by resident budget").
DEFAULT_MAP_FRACTION = 0.015
# One CRC-32 per block of the data region; 64 MiB keeps a 48 GiB table's manifest small.
CHECKSUM_BLOCK_BYTES = 64 << 20
MANIFEST_SUFFIX = ".json"


class Encoding(enum.IntEnum):
    """How one row's bytes encode its values. The stored values are part of the format (v1 and v2)."""

    FP8_E4M3 = 1
    BF16 = 2
    NVFP4_PACKED = 3
    GGUF_F32 = 10
    GGUF_F16 = 11
    GGUF_BF16 = 12
    GGUF_Q8_0 = 13
    GGUF_Q4_0 = 14
    GGUF_Q4_1 = 15
    GGUF_Q5_0 = 16
    GGUF_Q5_1 = 17
    GGUF_IQ4_NL = 18

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> "Encoding":
        try:
            return cls[label.upper()]
        except KeyError:
            raise ValueError(f"unknown encoding {label!r}") from None


# {encoding: (values per block, bytes per block)}; a row is a whole number of blocks.
ENCODING_BLOCKS: dict[Encoding, tuple[int, int]] = {
    Encoding.FP8_E4M3: (1, 1),
    Encoding.BF16: (1, 2),
    # 16 four-bit codes (8 bytes) and their one e4m3 block scale, stored as 80 codes then 10 scales.
    Encoding.NVFP4_PACKED: (16, 9),
    Encoding.GGUF_F32: (1, 4),
    Encoding.GGUF_F16: (1, 2),
    Encoding.GGUF_BF16: (1, 2),
    Encoding.GGUF_Q8_0: (32, 34),
    Encoding.GGUF_Q4_0: (32, 18),
    Encoding.GGUF_Q4_1: (32, 20),
    Encoding.GGUF_Q5_0: (32, 22),
    Encoding.GGUF_Q5_1: (32, 24),
    Encoding.GGUF_IQ4_NL: (32, 18),
}


# GGML type of each GGUF encoding: (name, type id as stored in a GGUF tensor info). The ids are
# GGML's own (ggml.h), repeated here so the runtime and manifest need no `gguf` import.
GGML_TYPES: dict[Encoding, tuple[str, int]] = {
    Encoding.GGUF_F32: ("F32", 0),
    Encoding.GGUF_F16: ("F16", 1),
    Encoding.GGUF_Q4_0: ("Q4_0", 2),
    Encoding.GGUF_Q4_1: ("Q4_1", 3),
    Encoding.GGUF_Q5_0: ("Q5_0", 6),
    Encoding.GGUF_Q5_1: ("Q5_1", 7),
    Encoding.GGUF_Q8_0: ("Q8_0", 8),
    Encoding.GGUF_IQ4_NL: ("IQ4_NL", 20),
    Encoding.GGUF_BF16: ("BF16", 30),
}


def row_bytes_for(encoding: Encoding, values_per_row: int) -> int:
    values_per_block, bytes_per_block = ENCODING_BLOCKS[encoding]
    if values_per_row % values_per_block:
        raise ValueError(
            f"{values_per_row} values per row is not a whole number of "
            f"{encoding.label} blocks of {values_per_block}"
        )
    return values_per_row // values_per_block * bytes_per_block


# --- The model ------------------------------------------------------------------------------------

VALUES_PER_ROW = 160
DEFAULT_SEED = 1234
# Every tensor of the n-gram PLE module has this in its name (docs/MODEL.md).
PLE_NAME_PART = ".ple.ple_embedding."
SCALE_SUFFIX = ".ple.ple_embedding.ngram_embedding.weight_scale"
NVFP4_GLOBAL_SCALE_SUFFIXES = ("weight_scale_2", "weight_global_scale")
MULTIPLIERS_SUFFIX = ".ple.ple_embedding.layer_multipliers"
HEAD_OFFSETS_SUFFIX = ".ple.ple_embedding.ngram_heads_offsets"
HEAD_SIZES_SUFFIX = ".ple.ple_embedding.ngram_heads_vocab_sizes"
SAFETENSORS_MAX_HEADER = 100_000_000

# --- GGUF (docs/MODEL.md) ------------------------------------------------------------------------

GGUF_ARCHITECTURE = "qwen4exp"
GGUF_JOINED_TENSOR = "per_layer_token_embd.weight"
# Split GGUF files: NAME-0000k-of-0000N.gguf.
GGUF_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# make-fixture variants that write GGUF models, one per supported GGML type.
GGUF_FIXTURE_VARIANTS = tuple(f"gguf-{name.lower()}" for name, _ in GGML_TYPES.values())
