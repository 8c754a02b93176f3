"""Real text for benchmarks: the Python standard library's sources, tokenised, through the real hash.

Uniform random row ids mislead (no repeats, no hot rows); real text gives the repeats and the skew
a served model sees. The standard library is on every host that runs ple-prep, so `ple-prep bench`
needs no download. Tokens come from a byte-level BPE trained with `tokenizers` on the same sources
(deterministic for a given vocabulary size). Each source file is one request (fresh hash context).
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..ngram import NgramSpec, row_ids

DEFAULT_VOCAB_SIZE = 16000
TRAIN_BYTES = 2_000_000


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, in a fixed order, tests and site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages", "test", "tests"} & set(p.parts))


def _texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE trained with `tokenizers` on `texts`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@functools.lru_cache(maxsize=2)
def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE trained on the first TRAIN_BYTES of the sources (once per process)."""
    texts, total = [], 0
    for text in _texts(stdlib_sources()):
        texts.append(text)
        total += len(text)
        if total >= TRAIN_BYTES:
            break
    return train_bpe(texts, vocab_size)


def real_text_row_ids(spec: NgramSpec, num_tokens: int, *, part: int = 0, parts: int = 1,
                      tokenizer=None) -> np.ndarray:
    """int64 `(num_tokens, heads)` row ids of real text; `part` of `parts` picks disjoint files.

    Files are taken in a fixed shuffled order, every `parts`-th from `part`, so part 0 and part 1
    of 2 (say, a profile and a measurement) share no text.
    """
    tokenizer = tokenizer or train_tokenizer()
    paths = stdlib_sources()
    shuffled = [paths[i] for i in np.random.default_rng(0).permutation(len(paths))][part::parts]
    chunks, total = [], 0
    for text in _texts(shuffled):
        tokens = tokenizer.encode(text).ids
        if not tokens:
            continue
        chunks.append(row_ids(tokens[:num_tokens - total], spec))
        total += len(chunks[-1])
        if total >= num_tokens:
            break
    if total < num_tokens:
        raise ValueError(f"the standard library holds only {total} tokens here, {num_tokens} asked")
    return np.concatenate(chunks)
