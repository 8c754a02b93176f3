"""A corpus of real documents on this machine, split by document into a profile and an evaluation half.

Documents: the Python standard library's .py sources (site-packages left out) and the readable
texts under /usr/share/doc (plain files and .gz changelogs decoded as UTF-8; symlinks, binaries
and exact duplicates left out, so a licence text copied into many packages counts once). Each
document is one request, cut to its first MAX_CHARS characters (a long prompt, not a whole book).
A document goes to the evaluation half when blake2b of its path is odd: the halves are disjoint.
The tokenizer is a byte-level BPE trained with `tokenizers` on the profile half only.

Tokenised halves are cached under CACHE (numpy files) so repeated runs skip tokenising.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from ple_prep.tools.realtext import train_bpe

MAX_CHARS = 65536
VOCAB_SIZE = 32000
TRAIN_CHARS = 16_000_000
CACHE = Path("/work/bigdata/issue3/corpus")
DOC_ROOT = Path("/usr/share/doc")


def documents() -> list[tuple[str, str]]:
    """(name, text) of every document, in a fixed order, exact duplicates dropped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.parts) and not p.is_symlink())
    paths += sorted(p for p in DOC_ROOT.rglob("*") if p.is_file() and not p.is_symlink())
    seen, out = set(), []
    for path in paths:
        try:
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if "\0" in text or not text.strip():
            continue
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if digest in seen:
            continue
        seen.add(digest)
        out.append((str(path), text[:MAX_CHARS]))
    return out


def is_evaluation(name: str) -> bool:
    return hashlib.blake2b(name.encode(), digest_size=8).digest()[0] & 1 == 1


def train_tokenizer(texts: list[str]):
    chosen, total = [], 0
    for text in texts:
        chosen.append(text)
        total += len(text)
        if total >= TRAIN_CHARS:
            break
    return train_bpe(chosen, VOCAB_SIZE)


def _encode(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All documents' tokens end to end (int32) and each document's start offset (int64)."""
    lengths, pieces = [], []
    for first in range(0, len(texts), 256):
        for encoding in tokenizer.encode_batch(texts[first:first + 256]):
            ids = np.array(encoding.ids, dtype=np.int32)
            pieces.append(ids)
            lengths.append(len(ids))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.concatenate(pieces), starts


def load() -> dict:
    """{'profile': (tokens, starts), 'evaluation': (tokens, starts), 'info': {...}}, cached."""
    info_path = CACHE / "info.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        halves = {half: (np.load(CACHE / f"{half}.tokens.npy", allow_pickle=False),
                         np.load(CACHE / f"{half}.starts.npy", allow_pickle=False))
                  for half in ("profile", "evaluation")}
        return halves | {"info": info}
    started = time.perf_counter()
    docs = documents()
    profile_docs = [(n, t) for n, t in docs if not is_evaluation(n)]
    evaluation_docs = [(n, t) for n, t in docs if is_evaluation(n)]
    tokenizer = train_tokenizer([t for _, t in profile_docs])
    halves = {"profile": _encode(tokenizer, [t for _, t in profile_docs]),
              "evaluation": _encode(tokenizer, [t for _, t in evaluation_docs])}
    CACHE.mkdir(parents=True, exist_ok=True)
    for half, (tokens, starts) in halves.items():
        np.save(CACHE / f"{half}.tokens.npy", tokens, allow_pickle=False)
        np.save(CACHE / f"{half}.starts.npy", starts, allow_pickle=False)
    tokenizer.save(str(CACHE / "tokenizer.json"))
    info = {"documents": len(docs), "profile_documents": len(profile_docs),
            "evaluation_documents": len(evaluation_docs),
            "profile_chars": sum(len(t) for _, t in profile_docs),
            "evaluation_chars": sum(len(t) for _, t in evaluation_docs),
            "profile_tokens": int(len(halves["profile"][0])),
            "evaluation_tokens": int(len(halves["evaluation"][0])),
            "vocab_size": VOCAB_SIZE, "max_chars": MAX_CHARS,
            "build_seconds": round(time.perf_counter() - started, 1)}
    info_path.write_text(json.dumps(info, indent=2))
    return halves | {"info": info}


def requests(tokens: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    return [tokens[a:b] for a, b in zip(starts[:-1], starts[1:]) if b > a]


if __name__ == "__main__":
    print(json.dumps(load()["info"], indent=2))
