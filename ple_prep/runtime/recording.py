"""A sampled access profile learned from served traffic, written as a profile file.

The order of a prepared table comes from prompts an operator collected; what real traffic reads is
seen only by the serving process. `TrafficRecorder.add_request` takes each request's token ids as
the server schedules it, keeps one request in `sample_every` (a counter: no hashing on the serving
thread), and a thread of its own hashes the kept ones (`ngram.mixed_values`) and counts their n-gram
groups. Every `write_seconds`, and at `close`, the counts are written to `path` (a temporary name,
then a rename) in the profile file format of offline/profile.py, version 1: `ple-prep profile merge`
and `ple-prep convert --profile` take it as they take a profile of prompt files. Requests are split
into the train and held-out parts by the same content rule as `ple-prep profile` (blake2b-64 of
the int64 tokens, 0 mod `heldout_every` held out), so convert's residency hints are measured on
traffic the layout was not built from. docs/RUNTIME.md gives the loop (serve, merge, convert,
replace the file by rename, reopen).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np

from ..core.fileio import atomic_output
from ..ngram import NgramSpec, mixed_values, rows_of_mixed

# The profile file of offline/profile.py (its module docstring gives the layout).
PROFILE_MAGIC = b"PLEPROF\x00"
PROFILE_FORMAT = "ple-prep-profile"
PROFILE_VERSION = 1
PARTS = ("train", "heldout")
HELDOUT_EVERY = 10
ZSTD_LEVEL = 3
# One request in this many is recorded. Hashing costs about as much per token as a warm lookup
# of that token's rows does, so the default keeps recording near 1% of the lookups' cost
# (BENCHMARKS.md, "Host cache and read-ahead").
DEFAULT_SAMPLE_EVERY = 128
DEFAULT_WRITE_SECONDS = 600.0
# Requests waiting for the recording thread at most; more are dropped rather than held in memory.
MAX_QUEUED = 64


def _is_heldout(tokens: np.ndarray, every: int) -> bool:
    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i8").data, digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


class _Counts:
    """Sorted distinct uint64 keys and their counts; batches are merged once they outgrow the total."""

    def __init__(self) -> None:
        self._keys = np.zeros(0, np.uint64)
        self._counts = np.zeros(0, np.uint64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self._pending.append((keys.astype(np.uint64), counts.astype(np.uint64)))
        self._pending_size += len(keys)
        if self._pending_size > max(len(self._keys), 1 << 16):
            self.result()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._pending:
            keys = np.concatenate([self._keys] + [k for k, _ in self._pending])
            counts = np.concatenate([self._counts] + [c for _, c in self._pending])
            if len(keys):
                order = np.argsort(keys, kind="stable")
                keys, counts = keys[order], counts[order]
                starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
                keys, counts = keys[starts], np.add.reduceat(counts, starts)
            self._keys, self._counts = keys, counts
            self._pending, self._pending_size = [], 0
        return self._keys, self._counts


class TrafficRecorder:
    """Records a sample of served requests' n-gram groups into the profile file `path`."""

    def __init__(self, spec: NgramSpec, path: str | Path, *, sample_every: int = DEFAULT_SAMPLE_EVERY,
                 write_seconds: float = DEFAULT_WRITE_SECONDS, tokenizer_sha256: str | None = None,
                 model: str = "served", heldout_every: int = HELDOUT_EVERY):
        if sample_every < 1:
            raise ValueError("sample_every must be >= 1")
        self.spec, self.path = spec, Path(path)
        self.sample_every, self.write_seconds = int(sample_every), float(write_seconds)
        self.tokenizer_sha256, self.model, self.heldout_every = tokenizer_sha256, model, heldout_every
        # An input entry of its own per recorder (host, process, start), so that merging the
        # profiles of several replicas or restarts never refuses them as the same input counted twice.
        self.name = f"served:{socket.gethostname()}:{os.getpid()}:{time.strftime('%Y%m%dT%H%M%S')}"
        self._digest = hashlib.sha256(self.name.encode())
        self._orders = tuple(range(2, spec.ngram_size + 1))
        self._groups = {part: {order: _Counts() for order in self._orders} for part in PARTS}
        self._requests = {part: 0 for part in PARTS}
        self._tokens = {part: 0 for part in PARTS}
        self.seen = self.recorded = self.dropped = 0
        self.cpu_seconds = 0.0  # the recording thread's CPU time hashing and counting
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ple-prep-recorder", daemon=True)
        self._thread.start()

    def add_request(self, tokens) -> bool:
        """A request as scheduled (its token ids, prompt first); True if it is kept for the profile."""
        self.seen += 1
        if self.seen % self.sample_every:
            return False
        try:
            self._queue.put_nowait(np.array(tokens, dtype=np.int64).reshape(-1))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every kept request is counted."""
        self._queue.join()

    def write(self) -> Path:
        """Write what is counted so far to `path` (replacing the last write); returns it."""
        import zstandard

        with self._lock:
            arrays: dict[str, np.ndarray] = {}
            for part in PARTS:
                for order in self._orders:
                    keys, counts = self._groups[part][order].result()
                    arrays[f"{part}.groups.{order}"] = keys
                    arrays[f"{part}.group_counts.{order}"] = counts
                arrays[f"{part}.rows"], arrays[f"{part}.row_counts"] = self._rows(part)
            header = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": self.model,
                      "spec": self.spec.to_json(), "tokenizer_sha256": self.tokenizer_sha256,
                      "heldout_every": self.heldout_every,
                      "inputs": [{"name": self.name, "bytes": 0, "sha256": self._digest.hexdigest(),
                                  "requests": sum(self._requests.values()), "tokens": sum(self._tokens.values())}],
                      "parts": {part: {"requests": self._requests[part], "tokens": self._tokens[part]}
                                for part in PARTS},
                      "arrays": list(arrays)}
        encoded = json.dumps(header, sort_keys=True).encode()
        with atomic_output(self.path) as handle, \
                zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(handle, closefd=False) as stream:
            stream.write(PROFILE_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
            for array in arrays.values():
                np.lib.format.write_array(stream, np.ascontiguousarray(array), allow_pickle=False)
        return self.path

    def close(self) -> None:
        """Count what is queued, write the profile, stop the thread (once: later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self.recorded:
            self.write()

    def _rows(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct rows the part's groups read, and the tokens that read each."""
        rows, counts = [], []
        for order in self._orders:
            keys, group_counts = self._groups[part][order].result()
            rows.append(rows_of_mixed(keys, order, self.spec).reshape(-1))
            counts.append(np.repeat(group_counts, self.spec.heads_per_ngram))
        merged = _Counts()
        merged.add(np.concatenate(rows).astype(np.uint64), np.concatenate(counts))
        keys, counts = merged.result()
        return keys.astype(np.int64), counts

    def _run(self) -> None:
        next_write = time.monotonic() + self.write_seconds
        while True:
            try:
                tokens = self._queue.get(timeout=max(0.0, next_write - time.monotonic()))
            except queue.Empty:
                tokens = ...
            try:
                if tokens is None:
                    return
                if tokens is not ...:
                    self._count(tokens)
                if time.monotonic() >= next_write:
                    next_write = time.monotonic() + self.write_seconds
                    if self.recorded:
                        self.write()
            except Exception as error:  # noqa: BLE001 (kept: a recording never fails serving)
                self.error = error
            finally:
                if tokens is not ...:
                    self._queue.task_done()

    def _count(self, tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        began = time.thread_time()
        part = "heldout" if _is_heldout(tokens, self.heldout_every) else "train"
        mixed = mixed_values(tokens, self.spec)
        with self._lock:
            for column, order in enumerate(self._orders):
                keys, counts = np.unique(mixed[:, column], return_counts=True)
                self._groups[part][order].add(keys, counts)
            self._requests[part] += 1
            self._tokens[part] += len(tokens)
            self._digest.update(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
            self.recorded += 1
        self.cpu_seconds += time.thread_time() - began
