"""Prompt files as requests of token ids: .txt (one request), .jsonl (one a line: text, prompt,
chat messages rendered with the checkpoint's template, or token ids) and .npy (token ids)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..core.errors import BadInput
from ..ngram import NgramSpec

# Texts per tokenizer call (the `tokenizers` library encodes a batch on all cores).
TEXT_BATCH = 256


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
        self._template = None
        self._tokenizer_config: dict[str, Any] | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise BadInput(f"{path} not found: text prompts need the checkpoint's tokenizer.json "
                               f"(or give token ids as .npy or .jsonl with token_ids)")
            try:
                self._tokenizer = Tokenizer.from_file(str(path))
            except Exception as exc:  # the binding raises plain Exception on a bad file
                raise BadInput(f"{path} is not a tokenizers file: {exc}") from None
        return self._tokenizer

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        if self._tokenizer_config is None:
            path = self.model_dir / "tokenizer_config.json"
            try:
                self._tokenizer_config = json.loads(path.read_text()) if path.is_file() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadInput(f"{path} is not JSON: {exc}") from None
        return self._tokenizer_config

    def render_chat(self, messages: Any, where: str) -> str:
        from .chat import render_chat

        return render_chat(self.model_dir, self.tokenizer_config, messages, where)

    def requests(self, path: Path) -> Iterator[np.ndarray]:
        """The requests of one prompt file, as int64 token id arrays, in file order."""
        suffix = path.suffix.lower()
        if not path.is_file():
            raise BadInput(f"prompt file {path} not found")
        if suffix == ".npy":
            yield self._checked(self._load_npy(path), str(path))
        elif suffix == ".txt":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise BadInput(f"{path} is not UTF-8 text: {exc}") from None
            yield from self._tokenised([(str(path), _Text(text, True))])
        elif suffix == ".jsonl":
            yield from self._tokenised(self._jsonl_items(path))
        else:
            raise BadInput(f"{path}: prompt files must be .txt, .jsonl or .npy, not {suffix or 'no suffix'!r}")

    def _load_npy(self, path: Path) -> np.ndarray:
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise BadInput(f"{path} is not a numpy .npy array of token ids: {exc}") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise BadInput(f"{path}: expected a 1-D integer array of token ids, got "
                           f"{array.dtype} of shape {array.shape}")
        return array

    def _jsonl_items(self, path: Path) -> Iterator[tuple[str, np.ndarray | _Text]]:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                where = f"{path}:{number}"
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise BadInput(f"{where}: not JSON: {exc}") from None
                if not isinstance(record, dict):
                    raise BadInput(f"{where}: each line must be a JSON object")
                if "token_ids" in record:
                    ids = record["token_ids"]
                    if not isinstance(ids, list) or not all(
                            isinstance(i, int) and not isinstance(i, bool) for i in ids):
                        raise BadInput(f"{where}: token_ids must be a list of integers")
                    yield where, np.array(ids, dtype=np.int64)
                elif isinstance(record.get("text"), str):
                    yield where, _Text(record["text"], True)
                elif isinstance(record.get("prompt"), str):
                    yield where, _Text(record["prompt"], True)
                elif "messages" in record:
                    # Rendered text already holds the template's special tokens.
                    yield where, _Text(self.render_chat(record["messages"], where), False)
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

        for entry in items:
            pending.append(entry)
            if len(pending) >= TEXT_BATCH:
                yield from drain()
        yield from drain()

    def _encode(self, texts: list[_Text]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for flag in (True, False):
            chosen = [i for i, t in enumerate(texts) if t.add_special_tokens is flag]
            if chosen:
                encodings = self.tokenizer.encode_batch([texts[i].text for i in chosen],
                                                        add_special_tokens=flag)
                out.extend(zip(chosen, (np.array(e.ids, dtype=np.int64) for e in encodings)))
        return [ids for _, ids in sorted(out, key=lambda pair: pair[0])]

    def _checked(self, tokens: np.ndarray, where: str) -> np.ndarray:
        tokens = np.asarray(tokens).astype(np.int64, copy=False)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.spec.vocab_size):
            raise BadInput(f"{where}: token ids must be in [0, {self.spec.vocab_size}); "
                           f"found {int(tokens.min())}..{int(tokens.max())}")
        return tokens
