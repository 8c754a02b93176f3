"""Profile prompt files on every core: the inputs cut into pieces, one process a share of them,
the counts merged exactly (sums of integer counts, in any order).

Pieces are whole files, except that a large .jsonl is cut at line boundaries (so one big log file
still uses every core). The pieces are cut into shares of about equal bytes, one a core: the
calling process hashes the first, a worker process each other one, each with one `Profiler`
reusing its working memory throughout; the workers hand back their counts as plain data (JSON
and .npy files, nothing pickled either way) and the parent adds them up. Tokenizing happens in
each process (each loads the tokenizer once). Workers are forked before the parent's own share
begins: they start in milliseconds, inherit the imported modules and their arguments, and the
parent has started no tokenizer threads yet.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..core.errors import BadInput
from ..core.fileio import open_input
from ..ngram import NgramSpec

# A .jsonl larger than this is cut into pieces of about this size, at line boundaries.
PIECE_BYTES = 32 << 20
# Less input than this is profiled in the calling process: starting workers would cost more.
MIN_PARALLEL_BYTES = 8 << 20
# How often the progress of the workers is read.
PROGRESS_SECONDS = 0.5
# Where the workers' results go when it has room: a tmpfs, read back at once, never worth a disk write.
SHM_FOLDER = "/dev/shm"
# The most a share's result takes per byte of its input (a token is at least 4 input bytes, and adds
# at most two n-gram keys and their counts, 32 bytes), for the room asked of SHM_FOLDER.
RESULT_BYTES_PER_INPUT_BYTE = 8


@dataclasses.dataclass(frozen=True)
class Piece:
    """One prompt file (the `file`-th given), or the lines of a .jsonl in bytes [start, stop)
    (`first_line` numbered); `size` bytes either way."""

    path: Path
    file: int
    size: int
    start: int = 0
    stop: int | None = None
    first_line: int = 1

    @property
    def whole(self) -> bool:
        return self.stop is None


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS): every core
        return os.cpu_count() or 1


def pieces_of(paths: list[Path], sizes: list[int]) -> list[Piece]:
    """Every file (of `sizes` bytes) whole, a large .jsonl cut at the first line break after each
    PIECE_BYTES."""
    pieces = []
    for file, (path, size) in enumerate(zip(paths, sizes)):
        if path.suffix.lower() != ".jsonl" or size <= PIECE_BYTES:
            pieces.append(Piece(path, file, size))
            continue
        start, line = 0, 1
        with open_input(path, "prompt file") as handle:
            while start < size:
                handle.seek(start + PIECE_BYTES)
                handle.readline()
                stop = min(size, handle.tell())
                pieces.append(Piece(path, file, stop - start, start, stop, line))
                handle.seek(start)
                line += _count_lines(handle, stop - start)
                start = stop
    return pieces


def _count_lines(handle, length: int) -> int:
    count = 0
    while length > 0:
        block = handle.read(min(length, 8 << 20))
        if not block:
            break
        count += block.count(b"\n")
        length -= len(block)
    return count


def _shares(pieces: list[Piece], count: int) -> list[list[int]]:
    """Piece indices split into `count` runs of about equal bytes (pieces keep their order)."""
    sizes = np.array([p.size for p in pieces], dtype=np.float64)
    bounds = np.searchsorted(np.cumsum(sizes), np.linspace(0, sizes.sum(), count + 1)[1:-1], side="right")
    edges = [0, *sorted(set(bounds.tolist())), len(pieces)]
    return [list(range(a, b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def scratch_folder(input_bytes: int) -> str | None:
    """SHM_FOLDER where it is writable and has room for the results of `input_bytes` of input (a
    small tmpfs, a container's 64 MB /dev/shm say, would fail the run), else None: the temporary
    folder on disk."""
    try:
        room = os.statvfs(SHM_FOLDER)
    except OSError:
        return None
    if not os.access(SHM_FOLDER, os.W_OK) or room.f_bavail * room.f_frsize < RESULT_BYTES_PER_INPUT_BYTE * input_bytes:
        return None
    return SHM_FOLDER


def file_sha256(path: Path, what: str) -> str:
    digest = hashlib.sha256()
    with open_input(path, what) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def profile_pieces(profile_share: Callable[..., dict[str, Any]], write_share: Callable[[dict[str, Any], Path], None],
                   read_share: Callable[[Path], dict[str, Any]], model_dir: Path, spec: NgramSpec,
                   heldout_every: int, pieces: list[Piece], workers: int,
                   progress: Callable[[int], None] | None) -> list[dict[str, Any]]:
    """The results of `profile_share(model_dir, spec, heldout_every, pieces[, progress])` over
    `workers` shares of the pieces, in piece order, each piece's sha256 filled in: the first share
    in this process, each other in a forked worker process of its own. Nothing is pickled either
    way: a worker inherits its arguments, hands its result back through `write_share` into a
    folder that `read_share` reads, and a failure as JSON (`_failure_of`). Where this platform
    cannot fork, every share is profiled here."""
    split_files = sorted({p.path for p in pieces if not p.whole})
    can_fork = "fork" in multiprocessing.get_all_start_methods()
    shares = _shares(pieces, workers) if workers > 1 and can_fork else [list(range(len(pieces)))]
    if len(shares) == 1:
        results = [profile_share(model_dir, spec, heldout_every, pieces, progress)]
        digests = {path: file_sha256(path, "prompt file") for path in split_files}
    else:
        results = [None] * len(shares)
        context = multiprocessing.get_context("fork")
        # Tokens done per share, written by the share's worker alone, read here for the progress.
        done = context.RawArray("q", len(shares))
        scratch_root = scratch_folder(sum(p.size for p in pieces))
        running: dict[int, Any] = {}
        # Objects the workers inherit are left out of their garbage collector's passes, which would
        # otherwise write to (and so copy) every page of them.
        gc.freeze()
        try:
            with tempfile.TemporaryDirectory(prefix="ple-prep-profile-", dir=scratch_root) as scratch:
                folders = [Path(scratch) / str(n) for n in range(len(shares))]
                try:
                    for n, share in enumerate(shares[1:], start=1):
                        running[n] = context.Process(
                            target=_share_into, daemon=True,
                            args=(profile_share, write_share, folders[n], done, n, model_dir, spec, heldout_every,
                                  [pieces[i] for i in share]))
                        running[n].start()
                    with concurrent.futures.ThreadPoolExecutor(1) as hashing:
                        # The files cut into pieces are hashed whole on a thread (hashlib releases the
                        # GIL), share 0 is profiled here, while the workers profile the others.
                        digests = hashing.submit(
                            lambda: {path: file_sha256(path, "prompt file") for path in split_files})
                        reported = 0

                        def advance(tokens: int) -> None:
                            nonlocal reported
                            if progress is not None:
                                progress(tokens + sum(done) - reported)
                                reported = sum(done)

                        results[0] = profile_share(model_dir, spec, heldout_every,
                                                   [pieces[i] for i in shares[0]], advance)
                        while running:
                            multiprocessing.connection.wait([p.sentinel for p in running.values()],
                                                            PROGRESS_SECONDS)
                            for n in [n for n, process in running.items() if not process.is_alive()]:
                                results[n] = _share_result(running.pop(n), folders[n], read_share)
                            advance(0)
                        digests = digests.result()
                finally:
                    for process in running.values():  # this process failed: theirs is wasted work
                        process.terminate()
                    for process in running.values():
                        process.join()
        finally:
            gc.unfreeze()
    for share, result in zip(shares, results):
        for index, entry in zip(share, result["pieces"]):
            if entry["sha256"] is None:
                entry["sha256"] = digests[pieces[index].path]
    return results


# A worker's failure, in its folder: what `_failure_of` wrote.
FAILURE_FILE = "failure.json"


def _share_into(profile_share: Callable[..., dict[str, Any]], write_share: Callable[[dict[str, Any], Path], None],
                folder: Path, done: Any, number: int, *args: Any) -> None:
    """In a worker: share `number` profiled and written into `folder`, its tokens counted in the
    shared progress `done` as they go; a failure written there instead, and the exit status 1."""

    def advance(tokens: int) -> None:
        done[number] += tokens

    folder.mkdir()
    try:
        write_share(profile_share(*args, advance), folder)
    except BaseException as exc:  # handed to the parent, which raises it
        (folder / FAILURE_FILE).write_text(json.dumps(_failure_of(exc)))
        raise SystemExit(1) from None


def _failure_of(exc: BaseException) -> dict[str, Any]:
    """An exception as plain data, enough for `_raised` to make its like again."""
    failure = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError):
        failure |= {"errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}
    return failure


def _share_result(process: Any, folder: Path, read_share: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """A finished worker's result, or the exception of its failure: its own kind for bad input, a
    file's error or memory running out, else a RuntimeError naming it."""
    process.join()
    if process.exitcode == 0:
        return read_share(folder)
    try:
        failure = json.loads((folder / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        raise RuntimeError(f"a profile worker {how}") from None
    raise _raised(failure)


def _raised(failure: dict[str, Any]) -> BaseException:
    kind, message = failure["type"], failure["message"]
    if kind == "BadInput":
        return BadInput(message)
    if failure.get("errno") is not None:
        return OSError(failure["errno"], failure["strerror"], failure["filename"])
    if kind == "MemoryError":
        return MemoryError(message)
    if kind == "KeyboardInterrupt":
        return KeyboardInterrupt()
    return RuntimeError(f"a profile worker failed: {kind}: {message}")
