"""Prompt files as requests of token ids: .txt (one request), .jsonl (one a line: text, prompt,
chat messages rendered with the checkpoint's template, or token ids) and .npy (token ids)."""
from __future__ import annotations

import codecs
import dataclasses
import io
import itertools
import math
import os
import re
import tokenize
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from ..core.errors import BadInput
from ..core.fileio import (
    MAX_JSON_DEPTH,
    check_json_depth,
    load_json,
    open_input,
    open_regular,
    parse_json,
    read_bounded,
)
from ..ngram import NgramSpec

# Texts per tokenizer call (the `tokenizers` library encodes a batch on all cores).
TEXT_BATCH = 256
# The tokenizer needs ~200 bytes of memory per byte it encodes at once: texts longer than
# PIECE_CHARS are encoded in pieces cut between words, and one call encodes at most BATCH_CHARS.
PIECE_CHARS = 1 << 18
BATCH_CHARS = 1 << 20
# Caps on prompt-side inputs: one .jsonl line, tokenizer.json, tokenizer_config.json.
MAX_LINE_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 256 << 20
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20


@dataclasses.dataclass
class _Text:
    text: str
    add_special_tokens: bool


class PromptReader:
    """Turns prompt files into requests of token ids, tokenising text with the checkpoint's tokenizer."""

    def __init__(self, model_dir: Path, spec: NgramSpec):
        self.model_dir = model_dir
        self.spec = spec
        self._tokenizer = None
        self._tokenizer_config: dict[str, Any] | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            path = self.model_dir / "tokenizer.json"
            if not os.path.lexists(path):
                raise BadInput(f"{path} not found: text prompts need the checkpoint's tokenizer.json "
                               f"(or give token ids as .npy or .jsonl with token_ids)")
            data = read_bounded(path, MAX_TOKENIZER_BYTES, "tokenizer")
            check_json_depth(data, MAX_JSON_DEPTH, f"tokenizer {path}")
            try:
                self._tokenizer = Tokenizer.from_str(data.decode())
            except Exception as exc:  # the binding raises plain Exception on a bad file
                raise BadInput(f"{path} is not a tokenizers file: {exc}") from None
        return self._tokenizer

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        if self._tokenizer_config is None:
            path = self.model_dir / "tokenizer_config.json"
            config = (load_json(path, "tokenizer config", limit=MAX_TOKENIZER_CONFIG_BYTES)
                      if os.path.lexists(path) else {})
            if not isinstance(config, dict):
                raise BadInput(f"{path} is not a JSON object")
            self._tokenizer_config = config
        return self._tokenizer_config

    def render_chat(self, messages: Any, where: str) -> str:
        from .chat import render_chat

        return render_chat(self.model_dir, self.tokenizer_config, messages, where)

    def requests(self, path: Path, start: int = 0, stop: int | None = None,
                 first_line: int = 1, digest: Any = None) -> Iterator[np.ndarray]:
        """The requests of one prompt file, as int64 token id arrays, in file order; for a .jsonl,
        those of its lines in bytes [start, stop) (cut at line breaks), the first numbered
        `first_line` in messages. With `digest` (a hashlib object), the file is read whole and
        every byte goes to it too: the file's checksum without a second read."""
        suffix = path.suffix.lower()
        update = digest.update if digest is not None else _ignore
        if suffix == ".npy":
            yield self._checked(self._load_npy(path, update), str(path))
        elif suffix == ".txt":
            yield self._checked(self._encode_pieces(self._txt_pieces(path, update), True), str(path))
        elif suffix == ".jsonl":
            yield from self._tokenised(self._jsonl_items(path, start, stop, first_line, update))
        else:
            os.close(open_regular(path, "prompt file"))  # a FIFO or a folder is named as such first
            raise BadInput(f"{path}: prompt files must be .txt, .jsonl or .npy, not {suffix or 'no suffix'!r}")

    def _txt_pieces(self, path: Path, update: Callable[[bytes], None] | None = None) -> Iterator[str]:
        """A UTF-8 file's text in pieces of about PIECE_CHARS, each cut between two words (each
        block read also goes to `update`)."""
        update = update or _ignore
        decoder = codecs.getincrementaldecoder("utf-8")()
        pending = ""
        with open_input(path, "prompt file") as handle:
            while True:
                block = handle.read(PIECE_CHARS)
                update(block)
                try:
                    pending += decoder.decode(block, final=not block)
                except UnicodeDecodeError as exc:
                    raise BadInput(f"{path} is not UTF-8 text: {exc.reason} near byte "
                                   f"{handle.tell() - len(block) + exc.start}") from None
                while len(pending) > PIECE_CHARS:
                    cut = _word_boundary(pending, PIECE_CHARS)
                    yield pending[:cut]
                    pending = pending[cut:]
                if not block:
                    break
        yield pending

    def _load_npy(self, path: Path, update: Callable[[bytes], None]) -> np.ndarray:
        with open_input(path, "prompt file") as handle:
            data = handle.read()
        update(data)
        try:
            shape, dtype, start = _npy_header(data)
            # The declared shape must match the bytes there, or numpy would allocate what it says.
            left = len(data) - start
            if dtype.hasobject or math.prod(shape) * dtype.itemsize != left:
                raise BadInput(f"{path}: the .npy header declares {dtype} {shape}, not the "
                               f"{left} bytes that follow it")
            array = (np.frombuffer(data, dtype, offset=start) if len(shape) == 1 else
                     np.load(io.BytesIO(data), allow_pickle=False))
        except (ValueError, OSError, SyntaxError) as exc:
            if isinstance(exc, BadInput):
                raise
            raise BadInput(f"{path} is not a numpy .npy array of token ids: {exc}") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise BadInput(f"{path}: expected a 1-D integer array of token ids, got "
                           f"{array.dtype} of shape {array.shape}")
        return array

    def _jsonl_items(self, path: Path, start: int, stop: int | None, first_line: int,
                     update: Callable[[bytes], None]) -> Iterator[tuple[str, np.ndarray | _Text]]:
        with open_input(path, "prompt file") as handle:
            handle.seek(start)
            lines = iter(lambda: handle.readline(MAX_LINE_BYTES + 1) if stop is None or handle.tell() < stop
                         else b"", b"")
            for number, line in enumerate(lines, first_line):
                update(line)
                where = f"{path}:{number}"
                if len(line) > MAX_LINE_BYTES:
                    raise BadInput(f"{where}: a line longer than {MAX_LINE_BYTES >> 20} MiB; put long "
                                   f"texts in a .txt file (read in pieces)")
                if not line.strip():
                    continue
                record = parse_json(line, where)
                if not isinstance(record, dict):
                    raise BadInput(f"{where}: each line must be a JSON object")
                if "token_ids" in record:
                    ids = record["token_ids"]
                    if not isinstance(ids, list) or not all(
                            isinstance(i, int) and not isinstance(i, bool) for i in ids):
                        raise BadInput(f"{where}: token_ids must be a list of integers")
                    if ids:
                        # Before int64 holds them: JSON integers have no bound.
                        self._check_range(min(ids), max(ids), where)
                    yield where, np.array(ids, dtype=np.int64)
                elif isinstance(record.get("text"), str):
                    yield where, _unicode_text(record["text"], True, where)
                elif isinstance(record.get("prompt"), str):
                    yield where, _unicode_text(record["prompt"], True, where)
                elif "messages" in record:
                    # Rendered text already holds the template's special tokens.
                    yield where, _unicode_text(self.render_chat(record["messages"], where), False, where)
                else:
                    raise BadInput(f"{where}: expected a string 'text' or 'prompt', chat "
                                   f"'messages', or 'token_ids'")

    def _tokenised(self, items: Iterable[tuple[str, np.ndarray | _Text]]) -> Iterator[np.ndarray]:
        pending: list[tuple[str, np.ndarray | _Text]] = []

        def drain() -> Iterator[np.ndarray]:
            texts = [item for _, item in pending if isinstance(item, _Text)]
            encoded = iter(self._encode(texts))
            for where, item in pending:
                yield self._checked(next(encoded) if isinstance(item, _Text) else item, where)
            pending.clear()

        chars = 0
        for entry in items:
            pending.append(entry)
            chars += len(entry[1].text) if isinstance(entry[1], _Text) else 0
            if len(pending) >= TEXT_BATCH or chars >= BATCH_CHARS:
                yield from drain()
                chars = 0
        yield from drain()

    def _encode(self, texts: list[_Text]) -> list[np.ndarray]:
        out: list[tuple[int, np.ndarray]] = [
            (i, self._encode_pieces(_text_pieces(t.text), t.add_special_tokens))
            for i, t in enumerate(texts) if len(t.text) > PIECE_CHARS]
        for flag in (True, False):
            chosen = [i for i, t in enumerate(texts)
                      if t.add_special_tokens is flag and len(t.text) <= PIECE_CHARS]
            if chosen:
                encodings = self.tokenizer.encode_batch([texts[i].text for i in chosen],
                                                        add_special_tokens=flag)
                out.extend(zip(chosen, (np.array(e.ids, dtype=np.int64) for e in encodings)))
        return [ids for _, ids in sorted(out, key=lambda pair: pair[0])]

    def _encode_pieces(self, pieces: Iterator[str], add_special_tokens: bool) -> np.ndarray:
        """One text given in pieces cut between words: the ids of the whole text, with memory for
        one piece at a time in the tokenizer. A text of one piece is encoded as it is."""
        first = next(pieces)
        second = next(pieces, None)
        if second is None:
            return np.array(self.tokenizer.encode(first, add_special_tokens=add_special_tokens).ids,
                            dtype=np.int64)
        parts = [np.array(self.tokenizer.encode(piece, add_special_tokens=False).ids, dtype=np.int32)
                 for piece in itertools.chain([first, second], pieces)]
        if add_special_tokens:
            before, after = self._special_tokens()
            parts = [np.array(before, dtype=np.int32), *parts, np.array(after, dtype=np.int32)]
        return np.concatenate(parts).astype(np.int64)

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text (its post-processor's special tokens)."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        raise BadInput("this tokenizer's special tokens wrap a text in a way pieces cannot follow; "
                       "split long prompts into requests of at most "
                       f"{PIECE_CHARS:,} characters")

    def _checked(self, tokens: np.ndarray, where: str) -> np.ndarray:
        tokens = np.asarray(tokens).astype(np.int64, copy=False)
        if len(tokens):
            self._check_range(int(tokens.min()), int(tokens.max()), where)
        return tokens

    def _check_range(self, low: int, high: int, where: str) -> None:
        if low < 0 or high >= self.spec.vocab_size:
            raise BadInput(f"{where}: token ids must be in [0, {self.spec.vocab_size}); found {low}..{high}")


def _unicode_text(text: str, add_special_tokens: bool, where: str) -> _Text:
    """A text for the tokenizer, which takes valid Unicode only: JSON can spell a lone surrogate
    ("\\ud800"), which no UTF-8 holds."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise BadInput(f"{where}: text must be valid Unicode, encodable as UTF-8 ({exc.reason})") from None
    return _Text(text, add_special_tokens)


def _ignore(data: bytes) -> None:
    """No checksum wanted."""


# What np.save writes for a 1-D array of one dtype (numpy/lib/format.py), parsed without `ast`.
_NPY_1D_HEADER = re.compile(r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (?:False|True), "
                            r"'shape': \((\d+),\), \} *\n")


def _npy_header(data: bytes) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data) of a .npy file's bytes; ValueError if it is not one."""
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        return _npy_header_by_numpy(data)
    size_bytes = 2 if data[6] == 1 else 4
    length = int.from_bytes(data[8:8 + size_bytes], "little")
    start = 8 + size_bytes + length
    found = _NPY_1D_HEADER.fullmatch(data[8 + size_bytes:start].decode("latin-1"))
    if found is None or data[6] not in (1, 2, 3):
        return _npy_header_by_numpy(data)
    try:
        dtype = np.dtype(found[1])
    except TypeError:  # a descr numpy does not know ('<i9'): its parser says so as the others do
        return _npy_header_by_numpy(data)
    return (int(found[2]),), dtype, start


def _npy_header_by_numpy(data: bytes) -> tuple[tuple[int, ...], np.dtype, int]:
    handle = io.BytesIO(data)
    shape, dtype = read_npy_header(handle)
    return shape, dtype, handle.tell()


def read_npy_header(handle: BinaryIO) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of the .npy record at `handle`, by numpy's own parser. It raises
    tokenize.TokenError, RecursionError or TypeError on some broken headers, ValueError on the
    rest: all come out as ValueError."""
    try:
        version = np.lib.format.read_magic(handle)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(handle)
    except (SyntaxError, TypeError, RecursionError, tokenize.TokenError) as exc:
        raise ValueError(f"its header cannot be parsed ({exc})") from None
    return shape, dtype


def _word_boundary(text: str, limit: int) -> int:
    """Where to cut `text` at or before `limit`: before a space between two letters, a place where
    the tokenizer's pre-tokenizer splits too, so the pieces encode as the whole text does. With no
    such place in the last quarter of the piece, at `limit`."""
    position = limit
    while position > limit * 3 // 4:
        position = text.rfind(" ", limit * 3 // 4, position)
        if position <= 0:
            break
        if text[position - 1].isalpha() and position + 1 < len(text) and text[position + 1].isalpha():
            return position
    return limit


def _text_pieces(text: str) -> Iterator[str]:
    while len(text) > PIECE_CHARS:
        cut = _word_boundary(text, PIECE_CHARS)
        yield text[:cut]
        text = text[cut:]
    yield text
