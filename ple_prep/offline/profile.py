"""Profile prompts through the model's hash: which rows real requests read, and which together.

A profile counts, for every n-gram group a token reads (the `heads_per_ngram` rows one order's
mixed hash selects, `ngram.rows_of_mixed`), how many tokens read it; per-row hit counts follow from
the groups. Requests are split by content: a request whose blake2b-64 of its int64 token ids is
0 mod `HELDOUT_EVERY` is held out, so the layout is built from the training part and residency is
measured on the held-out part; shards of a corpus split exactly as one run does, and a request
repeated in the corpus always lands on the same side.

Profile file: zstandard-compressed plain data (nothing pickled). Decompressed it is
    MAGIC (8 bytes) | u64 little-endian header length | header JSON (UTF-8) | .npy records
and the header's `arrays` names the .npy records in order. For each part P (train, heldout):
    P.groups.N        uint64, sorted distinct mixed hashes of the order-N n-grams seen (N = 2..ngram_size)
    P.group_counts.N  uint64, tokens that read each group
    P.rows            int64, sorted distinct global rows read
    P.row_counts      uint64, tokens that read each row
The header also holds the hash spec (`NgramSpec.to_json`), the model's name, the tokenizer's sha256
(or null), `heldout_every` (at least 1), the request and token counts per part, and each input file
(name, bytes, sha256 or null, requests, tokens); counts are non-negative integers, and a reader
refuses a header that breaks any of this, naming the field.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..core.errors import BadInput
from ..core.fileio import (
    atomic_output,
    check_output,
    open_input,
    open_regular,
    parse_json,
)
from ..ngram import NgramSpec, mixed_columns, row_of_head
from .profile_pool import MIN_PARALLEL_BYTES, Piece, default_workers, file_sha256, pieces_of, profile_pieces
from .prompts import PromptReader, read_npy_header

try:
    from ..core import _native
except ImportError:  # built without a C compiler: numpy counts the same
    _native = None

MAGIC = b"PLEPROF\x00"
PER_ROW_ARRAYS = (".rows", ".row_counts")
PROFILE_FORMAT = "ple-prep-profile"
PROFILE_VERSION = 1
HELDOUT_EVERY = 10
PARTS = ("train", "heldout")
MAX_HEADER_BYTES = 64 << 20
MAX_NPY_HEADER_BYTES = 64 << 10
# A profile expands to at most this many times its file size, or MIN_DECOMPRESSED_BOUND: sorted
# 64-bit hashes barely compress, so real profiles stay under 4x; a zip bomb is refused.
MAX_COMPRESSION_RATIO = 64
MIN_DECOMPRESSED_BOUND = 64 << 20
# Tokens hashed per vectorised batch; requests are laid end to end to amortise numpy overhead.
BATCH_TOKENS = 1 << 21
ZSTD_LEVEL = 3


@dataclasses.dataclass
class PartCounts:
    """The counts of one part: requests, tokens, and per order the groups seen with their counts."""

    requests: int
    tokens: int
    groups: dict[int, tuple[np.ndarray, np.ndarray]]

    def rows(self, spec: NgramSpec) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct global rows read, and how many tokens read each (uint64)."""
        # Heads hold disjoint row ranges in head order, so per-head results concatenate sorted.
        ids, counts = zip(*self.rows_by_head(spec)) if self.groups else ((), ())
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64)
        return np.concatenate(ids), np.concatenate(counts)

    def rows_by_head(self, spec: NgramSpec) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`rows`, one head at a time in head order (memory: one head's rows)."""
        for order, (values, group_counts) in sorted(self.groups.items()):
            total = int(group_counts.sum(dtype=np.uint64))
            for k in range(spec.heads_per_ngram):
                yield _head_rows(values, group_counts, total, order, k, spec)


@dataclasses.dataclass
class Profile:
    spec: NgramSpec
    tokenizer_sha256: str | None
    model: str
    inputs: list[dict[str, Any]]
    parts: dict[str, PartCounts]
    heldout_every: int = HELDOUT_EVERY

    @property
    def tokens(self) -> int:
        return sum(part.tokens for part in self.parts.values())

    @property
    def requests(self) -> int:
        return sum(part.requests for part in self.parts.values())

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens,
                "train": {"requests": self.parts["train"].requests, "tokens": self.parts["train"].tokens,
                          "groups": sum(len(v) for v, _ in self.parts["train"].groups.values())},
                "heldout": {"requests": self.parts["heldout"].requests,
                            "tokens": self.parts["heldout"].tokens},
                "inputs": len(self.inputs)}


def _sum_by_key(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct sorted keys and the sum of their counts (exact integer sums)."""
    if not len(keys):
        return keys.copy(), counts.astype(np.uint64)
    # Stable: the keys come as runs already sorted (each batch's distinct keys, each profile's),
    # which a stable sort merges in linear time (measured: 12x faster than the default sort here).
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order].astype(np.uint64)
    starts = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1])
    return keys[starts], np.add.reduceat(counts, starts)


def _sum_runs(runs: list[tuple[np.ndarray, np.ndarray]], pool: concurrent.futures.Executor | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """`_sum_by_key` of runs of sorted distinct uint64 keys with uint64 counts: with the compiled
    helper, merged two at a time in linear passes (core/native/ngramcount.c), each round's merges
    on `pool` when given."""
    runs = [run for run in runs if len(run[0])]
    if not runs:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if _native is None:
        return _sum_by_key(np.concatenate([keys for keys, _ in runs]), np.concatenate([c for _, c in runs]))
    while len(runs) > 1:
        pairs = [runs[i:i + 2] for i in range(0, len(runs), 2)]
        runs = list((pool.map if pool is not None else map)(lambda pair: _merged(*pair) if len(pair) > 1 else pair[0],
                                                            pairs))
    return runs[0]


def _merged(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray]:
    size = len(first[0]) + len(second[0])
    keys, counts = np.empty(size, np.uint64), np.empty(size, np.uint64)
    count = _native.merge_counts(*first, *second, keys, counts)
    keys.resize(count, refcheck=False)  # realloc: no copy
    counts.resize(count, refcheck=False)
    return keys, counts


class _Pair:
    """A keys and a counts array (uint64) of one capacity, reused from batch to batch: a fresh
    array's pages are zeroed on first touch, which on a virtual machine costs more than a merge."""

    def __init__(self) -> None:
        self.keys = self.counts = np.zeros(0, np.uint64)

    def room(self, size: int, keep: int = 0) -> None:
        """At least `size` items, the first `keep` kept."""
        if len(self.keys) < size:
            # Twice the size: untouched pages cost nothing, each growth pages in a fresh array.
            keys, counts = np.empty(2 * size, np.uint64), np.empty(2 * size, np.uint64)
            keys[:keep], counts[:keep] = self.keys[:keep], self.counts[:keep]
            self.keys, self.counts = keys, counts

    def run(self, bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[bounds[0]:bounds[1]], self.counts[bounds[0]:bounds[1]]


def _sum_in_range(keys: np.ndarray, counts: np.ndarray, low: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`_sum_by_key` for keys in [low, low + size): a dense count when the keys are many (no
    sort); float64 sums are exact while the total stays below 2**53."""
    if _is_sparse(len(keys), size, int(counts.sum(dtype=np.uint64))):
        return _sum_by_key(keys, counts)
    dense = np.bincount(keys - low, weights=counts.astype(np.float64), minlength=size)
    present = np.flatnonzero(dense)
    return present + low, dense[present].astype(np.uint64)


def _is_sparse(keys: int, size: int, total: int) -> bool:
    return keys * 16 < size or total >= 2**53


def _head_rows(values: np.ndarray, counts: np.ndarray, total: int, order: int, k: int,
               spec: NgramSpec) -> tuple[np.ndarray, np.ndarray]:
    """Head k of `order`'s rows for groups `values` counted `counts` (summing to `total`): sorted
    distinct rows and the tokens that read each, as `_sum_in_range` gives them."""
    head = (order - 2) * spec.heads_per_ngram + k
    low, size = spec.head_offsets[head], spec.head_sizes[head]
    if _native is None:
        return _sum_in_range(row_of_head(values, order, k, spec), counts, low, size)
    rows, sums = np.empty(len(values), np.int64), np.empty(len(values), np.uint64)
    count = _native.head_rows(np.ascontiguousarray(values, np.uint64), np.ascontiguousarray(counts, np.uint64),
                              size, low, not _is_sparse(len(values), size, total), rows, sums)
    rows.resize(count, refcheck=False)  # realloc: no copy
    sums.resize(count, refcheck=False)
    return rows, sums


class _KeyCounter:
    """Counts uint64 keys arriving in batches: each batch sorted and counted into a run, pending runs
    merged into the total when they outgrow it (with the compiled helper, in reused memory)."""

    def __init__(self) -> None:
        self.size = 0
        self.total, self.spare, self.arena, self.other = _Pair(), _Pair(), _Pair(), _Pair()
        self.runs: list[tuple[int, int]] = []  # pending runs laid end to end in the arena
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # pending runs without the helper
        self.pending_size = 0
        self.handed_out = False

    def add(self, values: np.ndarray, scratch: np.ndarray) -> None:
        """Count `values` (uint64, contiguous; sorted in place) with `scratch`, uint64 of at least
        their length, as working memory."""
        if _native is None:
            keys, counts = np.unique(values, return_counts=True)
            self.pending.append((keys, counts.astype(np.uint64)))
            count = len(keys)
        else:
            values.sort()
            count = _native.run_lengths(values, values, scratch)
            end = self.pending_size + count
            self.arena.room(end, keep=self.pending_size)
            self.arena.keys[self.pending_size:end] = values[:count]
            self.arena.counts[self.pending_size:end] = scratch[:count]
            self.runs.append((self.pending_size, end))
        self.pending_size += count
        if self.pending_size > max(self.size, BATCH_TOKENS):
            self._compact()

    def _compact(self) -> None:
        if self.pending:
            self.total.keys, self.total.counts = _sum_runs([self.result_arrays(), *self.pending])
            self.size, self.pending = len(self.total.keys), []
        elif self.runs:
            # The pending runs (about equal sizes) merged two at a time between the arena and
            # `other`, then the total once.
            source, target, runs = self.arena, self.other, self.runs
            while len(runs) > 1:
                target.room(runs[-1][1])
                merged, at = [], 0
                for first, second in zip(runs[::2], runs[1::2] + [None]):
                    if second is None:
                        count = first[1] - first[0]
                        target.keys[at:at + count], target.counts[at:at + count] = source.run(first)
                    else:
                        count = _native.merge_counts(*source.run(first), *source.run(second),
                                                     target.keys[at:], target.counts[at:])
                    merged.append((at, at + count))
                    at += count
                runs, source, target = merged, target, source
            self.spare.room(self.size + runs[0][1] - runs[0][0])
            self.size = _native.merge_counts(*self.result_arrays(), *source.run(runs[0]), self.spare.keys,
                                             self.spare.counts)
            # A total handed out (`result`) is never written into again: not kept as the spare.
            self.total, self.spare = self.spare, _Pair() if self.handed_out else self.total
            self.runs, self.handed_out = [], False
        self.pending_size = 0

    def result_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.total.keys[:self.size], self.total.counts[:self.size]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """The keys counted so far and their counts (views: the counter never writes them again)."""
        self._compact()
        self.handed_out = True
        return self.result_arrays()


def is_heldout(tokens: np.ndarray, every: int = HELDOUT_EVERY) -> bool:
    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i8").data, digest_size=8)
    return int.from_bytes(digest.digest(), "little") % every == 0


class Profiler:
    """Feeds requests (token id arrays) through the hash and counts the groups they read."""

    def __init__(self, spec: NgramSpec, heldout_every: int = HELDOUT_EVERY):
        self.spec = spec
        self.heldout_every = heldout_every
        self.orders = tuple(range(2, spec.ngram_size + 1))
        self._counters = {part: {order: _KeyCounter() for order in self.orders} for part in PARTS}
        self._requests = {part: 0 for part in PARTS}
        self._tokens = {part: 0 for part in PARTS}
        self._buffer: dict[str, list[np.ndarray]] = {part: [] for part in PARTS}
        self._buffered = 0
        # Working memory reused by every batch: fresh pages cost more than the hashing.
        self._batch = np.zeros(0, np.int64)
        self._mixed = np.zeros(0, np.uint64)
        self._scratch = np.zeros(0, np.uint64)

    def add_request(self, tokens: np.ndarray) -> None:
        """One new request; empty requests read nothing and are not counted."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            return
        part = "heldout" if is_heldout(tokens, self.heldout_every) else "train"
        self._requests[part] += 1
        self._tokens[part] += len(tokens)
        if len(tokens) > BATCH_TOKENS:
            self._add_long(part, tokens)
            return
        if self._buffered + len(tokens) > BATCH_TOKENS:  # batches stay within the working memory
            self.flush()
        self._buffer[part].append(tokens)
        self._buffered += len(tokens)

    def _add_long(self, part: str, tokens: np.ndarray) -> None:
        """A request longer than a batch, hashed a batch at a time: each window gets the tokens
        before it as context, so the values are those of the whole request in one call."""
        history = self.spec.ngram_size - 1
        for start in range(0, len(tokens), BATCH_TOKENS):
            context = tokens[max(0, start - history):start] if start else None
            self._count(part, tokens[start:start + BATCH_TOKENS], context=context)

    def _count(self, part: str, tokens: np.ndarray, **where: Any) -> None:
        count = len(tokens)
        if len(self._scratch) < count:  # once: batches hold at most BATCH_TOKENS
            self._mixed = np.empty(len(self.orders) * max(count, BATCH_TOKENS), np.uint64)
            self._scratch = np.empty(max(count, BATCH_TOKENS), np.uint64)
        mixed = mixed_columns(tokens, self.spec, out=self._mixed[:len(self.orders) * count].reshape(-1, count),
                              **where)
        for column, order in enumerate(self.orders):
            self._counters[part][order].add(mixed[column], self._scratch)

    def flush(self) -> None:
        for part, requests in self._buffer.items():
            if not requests:
                continue
            lengths = np.fromiter((len(r) for r in requests), dtype=np.int64, count=len(requests))
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            total = int(starts[-1] + lengths[-1])
            if len(self._batch) < total:
                self._batch = np.empty(max(total, BATCH_TOKENS), np.int64)
            tokens = np.concatenate(requests, out=self._batch[:total])
            self._count(part, tokens, request_starts=starts)
            requests.clear()
        self._buffered = 0

    def counts(self) -> dict[str, PartCounts]:
        """What was counted so far, per part."""
        self.flush()
        counts = {part: PartCounts(self._requests[part], self._tokens[part],
                                   {order: self._counters[part][order].result() for order in self.orders})
                  for part in PARTS}
        return counts

    def finish(self, *, model: str, tokenizer_sha256: str | None,
               inputs: list[dict[str, Any]]) -> Profile:
        return Profile(self.spec, tokenizer_sha256, model, inputs, self.counts(), self.heldout_every)


def tokenizer_fingerprint(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer.json"
    return file_sha256(path, "tokenizer") if path.is_file() else None


def _profile_share(model_dir: Path, spec: NgramSpec, heldout_every: int, pieces: list[Piece],
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Hash one share: its parts' counts and, per piece, its requests, tokens and (for a whole
    file) sha256."""
    reader = PromptReader(model_dir, spec)
    profiler = Profiler(spec, heldout_every)
    per_piece = []
    for piece in pieces:
        requests = tokens = 0
        digest = hashlib.sha256() if piece.whole else None
        for request in reader.requests(piece.path, piece.start, piece.stop, piece.first_line, digest):
            profiler.add_request(request)
            requests += bool(len(request))
            tokens += len(request)
            if progress is not None:
                progress(len(request))
        per_piece.append({"requests": requests, "tokens": tokens,
                          "sha256": digest.hexdigest() if digest is not None else None})
    return {"parts": profiler.counts(), "pieces": per_piece}


def _write_share(share: dict[str, Any], folder: Path) -> None:
    """A worker's share as plain data (JSON and .npy arrays, nothing pickled) for `_read_share`."""
    names = []
    for part, counts in share["parts"].items():
        for order, (keys, group_counts) in sorted(counts.groups.items()):
            for kind, array in (("keys", keys), ("counts", group_counts)):
                names.append(f"{part}.{order}.{kind}")
                np.save(folder / f"{names[-1]}.npy", np.ascontiguousarray(array), allow_pickle=False)
    header = {"pieces": share["pieces"], "arrays": names,
              "parts": {part: [c.requests, c.tokens, sorted(c.groups)] for part, c in share["parts"].items()}}
    (folder / "share.json").write_text(json.dumps(header))


def _read_share(folder: Path) -> dict[str, Any]:
    header = json.loads((folder / "share.json").read_text())

    def array(name: str) -> np.ndarray:
        # Mapped, not copied: they are read once, by the merge.
        return np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    parts = {part: PartCounts(requests, tokens, {order: (array(f"{part}.{order}.keys"),
                                                         array(f"{part}.{order}.counts"))
                                                 for order in orders})
             for part, (requests, tokens, orders) in header["parts"].items()}
    return {"parts": parts, "pieces": header["pieces"]}


def profile_files(model: str | Path, prompt_files: Iterable[str | Path], *,
                  progress: Callable[[int], None] | None = None,
                  spec: NgramSpec | None = None, workers: int | None = None) -> Profile:
    """Profile prompt files against a checkpoint (its hash spec and tokenizer), on `workers`
    processes (default: every core this process may use, unless the input is small; 1: in this
    process). The result does not depend on the number of workers (offline/profile_pool.py)."""
    model_dir = Path(model)
    if spec is None:
        from ..converters import read_spec

        spec = read_spec(model_dir)
    if model_dir.is_file():
        model_dir = model_dir.parent
    paths = [Path(p) for p in prompt_files]
    if not paths:
        raise BadInput("give at least one prompt file")
    sizes = _regular_sizes(paths)
    pieces = pieces_of(paths, sizes)
    if workers is None:
        workers = 1 if sum(sizes) < MIN_PARALLEL_BYTES else default_workers()
    shares = profile_pieces(_profile_share, _write_share, _read_share, model_dir, spec, HELDOUT_EVERY, pieces,
                            workers, progress)
    parts = _merged_parts([share["parts"] for share in shares])
    inputs = [{"name": path.name, "bytes": size, "sha256": None, "requests": 0, "tokens": 0}
              for path, size in zip(paths, sizes)]
    for piece, entry in zip(pieces, (entry for share in shares for entry in share["pieces"])):
        found = inputs[piece.file]
        found["sha256"] = entry["sha256"]
        found["requests"] += entry["requests"]
        found["tokens"] += entry["tokens"]
    return Profile(spec, tokenizer_fingerprint(model_dir), model_dir.name, inputs, parts, HELDOUT_EVERY)


def _regular_sizes(paths: list[Path]) -> list[int]:
    """Each prompt file's size: one stat a file; BadInput naming the absent ones, then the first
    that is not a regular file (core/fileio.open_regular says what it is)."""
    found = []
    for path in paths:
        try:
            found.append(os.stat(path))
        except OSError:
            found.append(None)
    missing = [str(path) for path, status in zip(paths, found) if status is None and not os.path.lexists(path)]
    if missing:
        raise BadInput(f"prompt file{'s' if len(missing) > 1 else ''} not found: {', '.join(missing)}")
    for number, (path, status) in enumerate(zip(paths, found)):
        if status is None or not stat.S_ISREG(status.st_mode):
            os.close(open_regular(path, "prompt file"))
            found[number] = os.stat(path)
    return [status.st_size for status in found]


def _merged_parts(counted: list[dict[str, PartCounts]]) -> dict[str, PartCounts]:
    """The sum of several counts of disjoint requests: exactly what one count of them all gives."""
    if len(counted) == 1:
        return counted[0]
    # The merges of one round are independent: threads (the helper releases the GIL) where there
    # are several shares, as on a machine with many cores.
    threads = min(len(counted) // 2, default_workers())
    with concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        parts = {}
        for part in PARTS:
            groups = {}
            for order in counted[0][part].groups:
                groups[order] = _sum_runs([c[part].groups[order] for c in counted], pool)
            parts[part] = PartCounts(sum(c[part].requests for c in counted),
                                     sum(c[part].tokens for c in counted), groups)
    return parts


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile of everything the given ones profiled; equal to profiling it all in one run."""
    if not profiles:
        raise BadInput("nothing to merge")
    first = profiles[0]
    for other in profiles[1:]:
        if other.spec != first.spec:
            raise BadInput("the profiles were made with different hash specs (different models)")
        if other.tokenizer_sha256 != first.tokenizer_sha256:
            raise BadInput("the profiles were made with different tokenizers")
        if other.heldout_every != first.heldout_every:
            raise BadInput("the profiles hold out different fractions of requests")
    seen: dict[tuple[str, str], int] = {}
    for number, profile in enumerate(profiles, 1):
        for entry in profile.inputs:
            key = (entry["name"], entry["sha256"])
            if seen.setdefault(key, number) != number:
                raise BadInput(f"profiles {seen[key]} and {number} both counted {entry['name']} (same "
                               f"sha256): merging would count its requests twice; give each profile once")
    parts = _merged_parts([p.parts for p in profiles])
    return Profile(first.spec, first.tokenizer_sha256, first.model,
                   [entry for p in profiles for entry in p.inputs], parts, first.heldout_every)


# --- The file ---------------------------------------------------------------------------------------

def is_profile(path: Path) -> bool:
    """A ple-prep profile (its magic, decompressed): what a profile may replace in a checkpoint folder."""
    import zstandard

    try:
        with open_input(path) as handle, zstandard.ZstdDecompressor().stream_reader(handle) as stream:
            return _read_exact(stream, len(MAGIC)) == MAGIC
    except (OSError, BadInput, zstandard.ZstdError):
        return False


def check_profile_output(out: str | Path, *, force: bool = False, inputs: Iterable[str | Path] = (),
                         model: str | Path | None = None) -> None:
    """BadInput unless `out` may take a profile: never one of `inputs` (the prompt files or the
    profiles merged) nor a file of `model`'s checkpoint folder other than a profile."""
    folder = None if model is None else Path(model) if Path(model).is_dir() else Path(model).parent
    check_output(Path(out), force=force, inputs=[Path(p) for p in inputs], protected_folder=folder,
                 replaceable=is_profile)


def save_profile(profile: Profile, out: str | Path, *, force: bool = False, inputs: Iterable[str | Path] = (),
                 model: str | Path | None = None) -> None:
    """Write the profile under a temporary name and rename it when complete (checked as by
    `check_profile_output`)."""
    import zstandard

    out = Path(out)
    check_profile_output(out, force=force, inputs=inputs, model=model)
    names = [name for part in PARTS
             for name in [f"{part}.{kind}.{order}" for order in sorted(profile.parts[part].groups)
                          for kind in ("groups", "group_counts")] + [f"{part}.rows", f"{part}.row_counts"]]
    header = {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": profile.model,
        "spec": profile.spec.to_json(), "tokenizer_sha256": profile.tokenizer_sha256,
        "heldout_every": profile.heldout_every, "inputs": profile.inputs,
        "parts": {part: {"requests": profile.parts[part].requests, "tokens": profile.parts[part].tokens}
                  for part in PARTS},
        "arrays": names,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    # The per-row counts are worked out on another thread (the compiled helper releases the GIL)
    # while the groups are compressed: compression is the one step that cannot be split.
    with concurrent.futures.ThreadPoolExecutor(1) as pool, atomic_output(out) as handle, \
            zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(handle, closefd=False) as stream:
        rows = {part: pool.submit(profile.parts[part].rows, profile.spec) for part in PARTS}
        stream.write(MAGIC + struct.pack("<Q", len(header_bytes)) + header_bytes)
        for part in PARTS:
            for _, (keys, group_counts) in sorted(profile.parts[part].groups.items()):
                _write_npy(stream, keys.astype(np.uint64, copy=False))
                _write_npy(stream, group_counts.astype(np.uint64, copy=False))
            row_ids, row_counts = rows[part].result()
            _write_npy(stream, row_ids.astype(np.int64, copy=False))
            _write_npy(stream, row_counts.astype(np.uint64, copy=False))


def _write_npy(stream: Any, array: np.ndarray) -> None:
    """`np.lib.format.write_array`'s bytes, the data passed as it is (no copy in 16 MiB chunks)."""
    array = np.ascontiguousarray(array)
    np.lib.format.write_array_header_1_0(stream, np.lib.format.header_data_from_array_1_0(array))
    stream.write(memoryview(array).cast("B"))


def decompressed_bound(compressed_bytes: int) -> int:
    """Most bytes a profile of this compressed size may expand to (docs/INPUTS.md)."""
    return max(MIN_DECOMPRESSED_BOUND, MAX_COMPRESSION_RATIO * compressed_bytes)


class _BoundedReader:
    """Reads exact byte counts from the decompressing stream, never past the file's bound."""

    def __init__(self, stream: Any, file_size: int, path: Path):
        self.stream, self.file_size, self.path = stream, file_size, path
        self.left = decompressed_bound(file_size)

    def take(self, size: int, what: str) -> int:
        if size > self.left:
            raise BadInput(f"{self.path}: {what} declares {size:,} bytes, more than the rest of what a "
                           f"{self.file_size:,}-byte profile may expand to ({MAX_COMPRESSION_RATIO}x its "
                           f"size, at least {MIN_DECOMPRESSED_BOUND >> 20} MiB); refused before reading it")
        self.left -= size
        return size

    def read(self, size: int, what: str) -> bytes:
        data = _read_exact(self.stream, self.take(size, what))
        if len(data) != size:
            raise BadInput(f"{self.path}: corrupt profile (it ends inside {what})")
        return data

    def read_array(self, name: str, keep: bool = True) -> np.ndarray | None:
        """One .npy record, its declared size checked before anything is allocated; with `keep`
        False its data is read through a small buffer and dropped (None)."""
        prefix = self.read(8, f"array {name}")
        major = prefix[6]
        if prefix[:6] != b"\x93NUMPY" or major not in (1, 2, 3):
            raise BadInput(f"{self.path}: corrupt profile (array {name} is not a .npy record)")
        size_bytes = self.read(2 if major == 1 else 4, f"array {name}")
        header_len = int.from_bytes(size_bytes, "little")
        if header_len > MAX_NPY_HEADER_BYTES:
            raise BadInput(f"{self.path}: corrupt profile (array {name} has a {header_len}-byte header)")
        record = io.BytesIO(prefix + size_bytes + self.read(header_len, f"array {name}"))
        try:
            shape, dtype = read_npy_header(record)  # 1-D: the order of its axes says nothing
        except ValueError as exc:
            raise BadInput(f"{self.path}: corrupt profile (array {name}: {exc})") from None
        if dtype not in (np.dtype("<u8"), np.dtype("<i8")) or len(shape) != 1:
            raise BadInput(f"{self.path}: corrupt profile (array {name} is {dtype} {shape}, "
                           f"not a 1-D 64-bit integer array)")
        self.take(shape[0] * 8, f"array {name}")
        array = np.empty(shape[0] if keep else min(shape[0], 1 << 21), dtype)
        if not keep:
            left = shape[0] * 8
            while left:
                count = self.stream.readinto(memoryview(array).cast("B")[:min(left, array.nbytes)])
                if not count:
                    raise BadInput(f"{self.path}: corrupt profile (it ends inside array {name})")
                left -= count
            return None
        view = memoryview(array).cast("B")
        while len(view):
            count = self.stream.readinto(view[:1 << 24])
            if not count:
                raise BadInput(f"{self.path}: corrupt profile (it ends inside array {name})")
            view = view[count:]
        return array


def load_profile(path: str | Path, parts: tuple[str, ...] = PARTS) -> Profile:
    """Read a profile file, checking its structure; BadInput on anything malformed. Only the
    counts of `parts` are kept (the others read and dropped: their groups come back empty), so a
    tool that needs one part at a time holds one.

    Memory stays within the file's decompressed bound: every declared size is checked against
    what is left of it before anything is allocated or decompressed.
    """
    import zstandard

    path = Path(path)
    try:
        with open_input(path, "profile") as handle, \
                zstandard.ZstdDecompressor().stream_reader(handle) as stream:
            reader = _BoundedReader(stream, os.fstat(handle.fileno()).st_size, path)
            if _read_exact(stream, reader.take(len(MAGIC), "the magic")) != MAGIC:
                raise BadInput(f"{path} is not a ple-prep profile")
            (length,) = struct.unpack("<Q", reader.read(8, "the header length"))
            if length > MAX_HEADER_BYTES:
                raise BadInput(f"{path}: profile header of {length} bytes is too large")
            header = parse_json(reader.read(length, "the header"), f"profile {path} header")
            names = header.get("arrays") if isinstance(header, dict) else None
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise BadInput(f"{path}: corrupt profile (no list of arrays)")
            # The per-row arrays are for other readers: the counts follow from the groups (and
            # would take 16 bytes a row seen: 460 MB for a real-text profile of the model).
            arrays = {name: reader.read_array(name, keep=not name.endswith(PER_ROW_ARRAYS)
                                              and name.split(".", 1)[0] in parts) for name in names}
    except zstandard.ZstdError as exc:
        raise BadInput(f"{path} is not a ple-prep profile (zstandard: {exc})") from None
    except BadInput:
        raise
    except (struct.error, KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{path}: corrupt profile ({exc})") from None
    return _from_parts(header, arrays, path, parts)


def _read_exact(stream: Any, size: int) -> bytes:
    """`size` bytes from a stream that may return fewer per read; short at the end of data."""
    chunks, remaining = [], size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _from_parts(header: Any, arrays: dict[str, np.ndarray | None], path: Path,
                parts_kept: tuple[str, ...] = PARTS) -> Profile:
    if not isinstance(header, dict) or header.get("format") != PROFILE_FORMAT:
        raise BadInput(f"{path} is not a ple-prep profile")
    if header.get("version") != PROFILE_VERSION:
        raise BadInput(f"{path}: profile version {header.get('version')} is not {PROFILE_VERSION}")
    _check_header_fields(header, path)
    try:
        spec = NgramSpec.from_json(header["spec"])
        parts = {}
        for part in PARTS:
            groups = {}
            for order in range(2, spec.ngram_size + 1):
                keys = arrays[f"{part}.groups.{order}"]
                counts = arrays[f"{part}.group_counts.{order}"]
                if part not in parts_kept:
                    keys = counts = np.zeros(0, np.uint64)
                if (keys.dtype != np.uint64 or counts.dtype != np.uint64 or keys.shape != counts.shape
                        or keys.ndim != 1 or np.any(keys[1:] <= keys[:-1])):
                    raise BadInput(f"{path}: corrupt profile (groups of order {order})")
                groups[order] = (keys, counts)
            parts[part] = PartCounts(header["parts"][part]["requests"], header["parts"][part]["tokens"], groups)
        return Profile(spec, header["tokenizer_sha256"], header["model"], header["inputs"], parts,
                       header["heldout_every"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{path}: corrupt profile ({exc})") from None


def _check_header_fields(header: dict[str, Any], path: Path) -> None:
    """The header's fields as `save_profile` writes them; BadInput naming the first that is not."""
    def count(value: Any) -> bool:
        return type(value) is int and value >= 0

    def text_or_null(entry: dict[str, Any], key: str) -> bool:
        return key in entry and (entry[key] is None or isinstance(entry[key], str))

    spec, inputs, parts = header.get("spec"), header.get("inputs"), header.get("parts")
    lists = ("multipliers", "head_sizes", "head_offsets")
    fields = [
        ("spec", isinstance(spec, dict) and all(
            isinstance(spec.get(name), list) and all(type(v) is int for v in spec[name]) if name in lists
            else type(spec.get(name)) is int for name in (f.name for f in dataclasses.fields(NgramSpec))),
         "an object of the hash's integers"),
        ("model", isinstance(header.get("model"), str), "a string"),
        ("tokenizer_sha256", text_or_null(header, "tokenizer_sha256"), "a string or null"),
        ("heldout_every", type(header.get("heldout_every")) is int and header["heldout_every"] >= 1,
         "a positive integer"),
        ("inputs", isinstance(inputs, list) and all(
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and text_or_null(entry, "sha256")
            and all(count(entry.get(key)) for key in ("bytes", "requests", "tokens")) for entry in inputs),
         "a list of {name, sha256 (or null), bytes, requests, tokens}, the counts non-negative integers"),
    ] + [(f"parts.{part}", isinstance(parts, dict) and isinstance(parts.get(part), dict)
          and all(count(parts[part].get(key)) for key in ("requests", "tokens")),
          "{requests, tokens}, non-negative integers") for part in PARTS]
    for name, ok, expected in fields:
        if not ok:
            raise BadInput(f"{path}: corrupt profile (header field {name} must be {expected})")
