"""The model's n-gram hash: token ids to the 16 table rows each token reads (docs/MODEL.md).

numpy (and the compiled helper of core/native/ where built) and no file formats (each converter
reads its own metadata into an `NgramSpec`), so a serving stack can hash with the runtime alone.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from .core.constants import DEFAULT_SEED
from .core.errors import BadInput

try:
    from .core import _native
except ImportError:  # built without a C compiler: numpy does the same work
    _native = None

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(value: int) -> int:
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _is_prime(number: int) -> bool:
    if number < 2:
        return False
    if number % 2 == 0:
        return number == 2
    divisor = 3
    while divisor * divisor <= number:
        if number % divisor == 0:
            return False
        divisor += 2
    return True


# Far above the model's 16 heads and 320M rows, far below what would make the prime search hang.
MAX_HEADS = 4096
MAX_TABLE_ROWS = 2**32 - 1


def check_table_bounds(heads: int, rows: int, where: str) -> None:
    """Refuse hostile geometry before the prime search, whose cost grows with both."""
    if heads > MAX_HEADS or not 0 < rows <= MAX_TABLE_ROWS:
        raise BadInput(f"{where}: {heads} hash heads and {rows} rows are beyond any PLE table "
                       f"(at most {MAX_HEADS} heads and {MAX_TABLE_ROWS} rows)")


def running_offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Each head's first row: the running sums of the head sizes, from 0."""
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))


def primes_from(start: int, count: int) -> list[int]:
    """The `count` primes from `start` on: the head sizes of a table whose base is `start`."""
    primes, candidate = [], start
    while len(primes) < count:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes


# The config fields the hash depends on, with the defaults the reference code uses.
CONFIG_FIELDS = (
    "vocab_size",
    "eos_token_id",
    "ple_layer_ids",
    "ple_embed_dim",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "split_ngram_parts",
    "seed",
)


@dataclasses.dataclass(frozen=True)
class NgramSpec:
    """Everything needed to turn token ids into global row ids, plus the table's geometry."""

    vocab_size: int
    eos_token_id: int
    ngram_size: int
    heads_per_ngram: int
    seed: int
    ple_ordinal: int
    ple_embed_dim: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    multipliers: tuple[int, ...]
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]

    @property
    def heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def values_per_row(self) -> int:
        return self.ple_embed_dim // self.heads

    @property
    def rows_used(self) -> int:
        return self.head_offsets[-1] + self.head_sizes[-1]

    @property
    def rows_stored(self) -> int:
        divisor = self.make_ngram_vocab_size_divisible_by
        return -(-self.rows_used // divisor) * divisor

    @classmethod
    def from_config(cls, config: Mapping[str, Any], ple_ordinal: int = 0) -> "NgramSpec":
        """Derive the constants from the model's config fields (`config.json`, or its `text_config`)."""
        config = config.get("text_config", config)
        missing = [f for f in CONFIG_FIELDS[:-2] if f not in config]
        if missing:
            raise BadInput(f"config.json lacks {', '.join(missing)}")
        names = ("vocab_size", "eos_token_id", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
                 "make_ngram_vocab_size_divisible_by", "ple_embed_dim")
        fields = {name: config[name] for name in names}
        eos = fields["eos_token_id"]
        fields["eos_token_id"] = eos[0] if isinstance(eos, list) and eos else eos
        fields["seed"] = config.get("seed") if config.get("seed") is not None else DEFAULT_SEED
        # Never coerced: 1000.5, "248320" or true is a broken config, not a hash parameter.
        wrong = [name for name, value in fields.items() if type(value) is not int]
        if wrong:
            raise BadInput(f"config.json: {', '.join(wrong)}: expected an integer (not a float, string or boolean)")
        return cls.derive(**fields, ple_ordinal=ple_ordinal, where="config.json")

    @classmethod
    def derive(cls, *, vocab_size: int, eos_token_id: int, ngram_size: int, heads_per_ngram: int,
               seed: int, ngram_vocab_size_base: int, make_ngram_vocab_size_divisible_by: int,
               ple_embed_dim: int, ple_ordinal: int = 0, where: str = "the model") -> "NgramSpec":
        """The spec the model derives from its hash parameters: multipliers from the seed, head
        sizes as the consecutive primes from the base (docs/MODEL.md)."""
        base, divisible_by, embed_dim = ngram_vocab_size_base, make_ngram_vocab_size_divisible_by, ple_embed_dim
        if not (vocab_size > 0 and ngram_size >= 2 and heads_per_ngram > 0 and base > 1
                and divisible_by > 0 and seed >= 0):
            raise BadInput(f"{where}: hash fields out of range")
        heads = (ngram_size - 1) * heads_per_ngram
        check_table_bounds((ple_ordinal + 1) * heads, heads * base, where)
        if embed_dim % heads:
            raise BadInput(f"ple_embed_dim {embed_dim} is not a multiple of {heads} heads")
        half_bound = max(1, ((2**63 - 1) // vocab_size) // 2)
        base_seed = seed + 10007 * ple_ordinal
        multipliers = tuple(
            2 * (splitmix64((base_seed + _GOLDEN * (i + 1)) & _MASK64) % half_bound) + 1
            for i in range(ngram_size)
        )
        first_head = ple_ordinal * heads
        sizes = tuple(primes_from(base, first_head + heads)[first_head:])
        offsets = running_offsets(sizes)
        return cls(vocab_size, eos_token_id, ngram_size, heads_per_ngram, seed, ple_ordinal,
                   embed_dim, base, divisible_by, multipliers, sizes, offsets)

    def check_constants(self, multipliers: Sequence[int] | None, head_offsets: Sequence[int] | None,
                        head_sizes: Sequence[int] | None, where: str) -> None:
        """Refuse stored hash constants that disagree with the ones derived from the config."""
        for name, stored, derived in (("multipliers", multipliers, self.multipliers),
                                      ("head offsets", head_offsets, self.head_offsets),
                                      ("head sizes", head_sizes, self.head_sizes)):
            if stored is not None and tuple(int(v) for v in stored) != derived:
                raise BadInput(f"{where} {name} {list(stored)} disagree with config.json "
                               f"{list(derived)}; the checkpoint and its config do not belong together")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"rows_stored": self.rows_stored}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "NgramSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in fields}
        return cls(**values)


def row_ids(tokens: Sequence[int] | np.ndarray, spec: NgramSpec,
            context: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Global row ids, int64 `(len(tokens), heads)`, in head order.

    `context` is the request's previous `ngram_size - 1` tokens, oldest first (fewer are padded
    with EOS); None starts a new request. Hashing a request in chunks, each with the last tokens
    of the one before as context, gives the same ids as hashing it whole.
    """
    mixed = mixed_values(tokens, spec, context)
    ids = np.empty((len(mixed), spec.heads), dtype=np.int64)
    for column, order in enumerate(range(2, spec.ngram_size + 1)):
        first = (order - 2) * spec.heads_per_ngram
        ids[:, first:first + spec.heads_per_ngram] = rows_of_mixed(mixed[:, column], order, spec)
    return ids


def mixed_values(tokens: Sequence[int] | np.ndarray, spec: NgramSpec,
                 context: Sequence[int] | np.ndarray | None = None,
                 request_starts: np.ndarray | None = None) -> np.ndarray:
    """The mixed hash of each position's n-gram, uint64 `(len(tokens), ngram_size - 1)`.

    Column j is order j + 2. One mixed value decides all `heads_per_ngram` rows of that order
    (`rows_of_mixed`), so it names the group of rows one n-gram reads. `request_starts` (sorted
    positions) hashes several new requests laid end to end in one call; it excludes `context`.
    """
    return mixed_columns(tokens, spec, context, request_starts).T


def mixed_columns(tokens: Sequence[int] | np.ndarray, spec: NgramSpec,
                  context: Sequence[int] | np.ndarray | None = None,
                  request_starts: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """`mixed_values` transposed: uint64 `(ngram_size - 1, len(tokens))`, each order's values
    contiguous (into `out`, a C-contiguous array of that shape, when given). The compiled helper's
    loop where it is built, numpy's otherwise (same bits)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
    history = spec.ngram_size - 1
    previous = np.full(history, spec.eos_token_id, dtype=np.int64)
    if context is not None:
        context = np.asarray(context, dtype=np.int64).reshape(-1)[-history:]
        if len(context):
            previous[history - len(context):] = context
    starts = np.zeros(0, np.int64) if request_starts is None else np.asarray(request_starts, dtype=np.int64)
    if len(starts) and (starts[0] < 0 or np.any(starts[1:] < starts[:-1])):
        raise ValueError("request_starts must be sorted positions (not negative)")
    mixed = np.empty((history, len(tokens)), dtype=np.uint64) if out is None else out
    if _native is not None:
        _native.ngram_mix(tokens, previous, np.ascontiguousarray(starts), np.array(spec.multipliers, np.uint64),
                          spec.eos_token_id, mixed)
        return mixed
    padded = np.concatenate([previous, tokens]).astype(np.uint64)
    count = len(tokens)
    eos64 = np.uint64(spec.eos_token_id)
    # ctx[s] for every position: the token s steps back, EOS once a cut (or the request start) is seen.
    cut = np.zeros(count, dtype=bool)
    with np.errstate(over="ignore"):
        running = padded[history:] * np.uint64(spec.multipliers[0])
        for step in range(1, spec.ngram_size):
            earlier = padded[history - step: history - step + count]
            value = np.where(cut, eos64, earlier)
            if len(starts):
                before_start = (starts[:, None] + np.arange(step)).reshape(-1)
                value[before_start[before_start < count]] = eos64
            cut |= value == eos64
            running = running ^ (value * np.uint64(spec.multipliers[step]))
            mixed[step - 1] = running
    return mixed


def rows_of_mixed(mixed: np.ndarray, order: int, spec: NgramSpec) -> np.ndarray:
    """Global row ids, int64 `(len(mixed), heads_per_ngram)`, of n-grams of `order` by mixed hash."""
    mixed = np.asarray(mixed, dtype=np.uint64).reshape(-1)
    rows = np.empty((len(mixed), spec.heads_per_ngram), dtype=np.int64)
    for k in range(spec.heads_per_ngram):
        rows[:, k] = row_of_head(mixed, order, k, spec)
    return rows


def row_of_head(mixed: np.ndarray, order: int, k: int, spec: NgramSpec) -> np.ndarray:
    """Global row ids (int64) that head k of the n-grams of `order` reads, by mixed hash."""
    head = (order - 2) * spec.heads_per_ngram + k
    return (np.asarray(mixed, dtype=np.uint64) % np.uint64(spec.head_sizes[head])).astype(np.int64) \
        + spec.head_offsets[head]
