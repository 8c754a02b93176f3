"""Profile prompt files on every core: the inputs cut into pieces, one process a share of them,
the counts merged exactly (sums of integer counts, in any order).

Pieces are whole files, except that a large .jsonl is cut at line boundaries (so one big log file
still uses every core). The pieces are cut into shares of about equal bytes, one a core: the
calling process hashes the first, a worker process each other one, each with one `Profiler`
reusing its working memory throughout; the workers hand back their counts and the parent adds
them up. Tokenizing happens in each process (each loads the tokenizer once). Workers are forked
before the parent's own share begins: they start in milliseconds and inherit the imported
modules, and the parent has started no tokenizer threads yet.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import hashlib
import multiprocessing
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

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
    in this process, each other in a worker process of its own. A worker hands its result back
    through `write_share` into a folder that `read_share` reads (plain data: the counts never
    travel pickled). The three functions must be module-level (the workers import them)."""
    split_files = sorted({p.path for p in pieces if not p.whole})
    shares = _shares(pieces, workers) if workers > 1 else [list(range(len(pieces)))]
    if len(shares) == 1:
        results = [profile_share(model_dir, spec, heldout_every, pieces, progress)]
        digests = {path: file_sha256(path, "prompt file") for path in split_files}
    else:
        results = [None] * len(shares)
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                              else "spawn")
        # Tokens done per share, written by the share's worker alone, read here for the progress.
        done = context.RawArray("q", len(shares))
        scratch_root = scratch_folder(sum(p.size for p in pieces))
        # Objects the workers inherit are left out of their garbage collector's passes, which would
        # otherwise write to (and so copy) every page of them.
        gc.freeze()
        try:
            with tempfile.TemporaryDirectory(prefix="ple-prep-profile-", dir=scratch_root) as scratch, \
                    concurrent.futures.ProcessPoolExecutor(len(shares) - 1, mp_context=context, initializer=_inherit,
                                                           initargs=(done,)) as pool, \
                    concurrent.futures.ThreadPoolExecutor(1) as hashing:
                folders = [Path(scratch) / str(n) for n in range(len(shares))]
                futures = {pool.submit(_share_into, profile_share, write_share, folders[n], n, model_dir, spec,
                                       heldout_every, [pieces[i] for i in share]): n
                           for n, share in enumerate(shares) if n}
                # The files cut into pieces are hashed whole on a thread (hashlib releases the GIL),
                # share 0 is profiled here, while the workers profile the others.
                digests = hashing.submit(lambda: {path: file_sha256(path, "prompt file") for path in split_files})
                reported = 0

                def advance(tokens: int) -> None:
                    nonlocal reported
                    if progress is not None:
                        progress(tokens + sum(done) - reported)
                        reported = sum(done)

                results[0] = profile_share(model_dir, spec, heldout_every, [pieces[i] for i in shares[0]], advance)
                waiting = set(futures)
                while waiting:
                    finished, waiting = concurrent.futures.wait(waiting, PROGRESS_SECONDS,
                                                                concurrent.futures.FIRST_COMPLETED)
                    for future in finished:
                        future.result()
                        results[futures[future]] = read_share(folders[futures[future]])
                    advance(0)
                digests = digests.result()
        finally:
            gc.unfreeze()
    for share, result in zip(shares, results):
        for index, entry in zip(share, result["pieces"]):
            if entry["sha256"] is None:
                entry["sha256"] = digests[pieces[index].path]
    return results


_done: Any = None


def _inherit(done: Any) -> None:
    """In a worker, at its start: the shared progress counts."""
    global _done
    _done = done


def _share_into(profile_share: Callable[..., dict[str, Any]], write_share: Callable[[dict[str, Any], Path], None],
                folder: Path, number: int, *args: Any) -> None:
    """In a worker: share `number` profiled and written into `folder`, its tokens counted in the
    shared progress as they go."""

    def advance(tokens: int) -> None:
        _done[number] += tokens

    folder.mkdir()
    write_share(profile_share(*args, advance), folder)
