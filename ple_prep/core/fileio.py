"""Files in and out, safely: exact positioned reads, bounded reads of inputs, atomic creation of outputs.

Inputs: only regular files are opened (a FIFO, device or socket is refused at once, never read),
and JSON or text has a size cap and a nesting-depth cap checked before it is parsed.
Outputs: every file the tools write is created by `create_partial` (O_CREAT|O_EXCL|O_NOFOLLOW under
a name nobody can predict, in the destination folder), fsynced, and renamed over its final name by
`publish`; `atomic_output` does all three for a file written in one go. Standard library only.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .errors import BadInput

# Permission bits of every published file, less the process umask (docs/RELIABILITY.md).
OUTPUT_MODE = 0o644
# Caps on inputs read whole: JSON files (config.json, the safetensors index, tokenizer_config.json,
# a manifest) and their nesting. Real files are a few MB and nest fewer than 20 levels.
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
PARTIAL_SUFFIX = ".partial"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A JSON string, escapes included (unrolled so that it runs in linear time).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def read_exactly(descriptor: int, buffer: memoryview, offset: int, name: str) -> None:
    """Fill `buffer` from `offset`; a file that ends first (truncated) is BadInput, never a short read."""
    while len(buffer):
        count = os.preadv(descriptor, [buffer], offset)
        if count <= 0:
            raise BadInput(f"{name} ended early at byte {offset}: the file was truncated")
        buffer, offset = buffer[count:], offset + count


# --- Inputs -----------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, what: str = "file") -> int:
    """A read-only descriptor of `path`, which must be (or link to) a regular file.

    O_NONBLOCK makes opening a FIFO return at once, so it is refused rather than waited on; the
    flag is cleared again for the regular file's reads. BadInput when missing or not regular.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise BadInput(f"{what} {path} not found") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket
            raise BadInput(f"{what} {path} is a socket, not a regular file") from None
        raise BadInput(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise BadInput(f"{what} {path} is {_kind(mode)}, not a regular file")
        fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


@contextlib.contextmanager
def open_input(path: str | Path, what: str = "file") -> Iterator[BinaryIO]:
    """`open(path, "rb")` for a regular file only (see `open_regular`)."""
    with os.fdopen(open_regular(path, what), "rb") as handle:
        yield handle


def read_bounded(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The whole of a regular file of at most `limit` bytes; BadInput on a larger one."""
    with open_input(path, what) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise BadInput(f"{what} {path} is {max(size, len(data)):,} bytes, over the "
                       f"{limit >> 20} MiB limit for this input")
    return data


def check_json_depth(data: bytes, max_depth: int, where: str) -> None:
    """Refuse JSON nesting deeper than `max_depth` before any parser recurses into it.

    Strings are removed, then everything but brackets; each pass deletes the innermost pairs, so
    well-formed JSON is empty after as many passes as it nests deep. Unmatched brackets in shallow
    text are left for the parser to report.
    """
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for passes in range(max_depth + 1):
        # Unmatched brackets left after `passes` passes nest at most passes + len(brackets) deep.
        if passes + len(brackets) <= max_depth:
            return
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    raise BadInput(f"{where} nests deeper than {max_depth} levels (or its brackets do not "
                       f"match): refused before parsing")


def parse_json(data: bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON from bytes, nesting checked first; BadInput when it is not JSON."""
    check_json_depth(data, max_depth, where)
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadInput(f"{where} is not JSON: {exc}") from None


def load_json(path: str | Path, what: str = "file", *, limit: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON input file, bounded in size and depth before it is parsed."""
    return parse_json(read_bounded(path, limit, what), f"{what} {path}", max_depth)


# --- Outputs ----------------------------------------------------------------------------------------

def partial_path(final: Path, token: str | None = None) -> Path:
    """A temporary name for `final` in its folder: `.{name}.{pid}-{token}.partial`.

    The pid tells a live writer's file from a dead one's (`partial_owner`); the random token makes
    the name impossible to guess in advance. Files written together may share one token.
    """
    return final.with_name(f".{final.name}.{os.getpid()}-{token or secrets.token_hex(8)}{PARTIAL_SUFFIX}")


def partial_owner(final: Path, candidate: Path) -> int | None:
    """The pid in a temporary name of `final`, or None when `candidate` is not one."""
    prefix = f".{final.name}."
    name = candidate.name
    if not name.startswith(prefix) or not name.endswith(PARTIAL_SUFFIX):
        return None
    pid = name[len(prefix):-len(PARTIAL_SUFFIX)].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def create_exclusive(path: Path, mode: int = OUTPUT_MODE) -> int:
    """A new file at `path` for writing; fails if anything, a symlink included, is already there."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def create_partial(final: Path, token: str | None = None, mode: int = OUTPUT_MODE) -> tuple[int, Path]:
    """(descriptor, path) of a new temporary file for `final`, created exclusively."""
    for _ in range(16):
        path = partial_path(final, token)
        try:
            return create_exclusive(path, mode), path
        except FileExistsError:
            if token is not None:
                raise
    raise BadInput(f"cannot create a temporary file beside {final}")


def fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(temporary: Path, final: Path, *, sync_folder: bool = True) -> None:
    """Rename a complete, fsynced temporary file over `final` (a symlink there is replaced, not followed)."""
    os.replace(temporary, final)
    if sync_folder:
        fsync_folder(final.parent)


@contextlib.contextmanager
def partial_output(final: Path, token: str | None = None, mode: int = OUTPUT_MODE, *,
                   publish_when_done: bool = False) -> Iterator[tuple[BinaryIO, Path]]:
    """A new temporary file for `final` and its path, for the block to write; then flushed, fsynced,
    closed and, with `publish_when_done`, renamed over `final`. On any error it is removed."""
    descriptor, temporary = create_partial(final, token, mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            yield handle, temporary
            handle.flush()
            os.fsync(handle.fileno())
        if publish_when_done:
            publish(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_output(final: str | Path, mode: int = OUTPUT_MODE) -> Iterator[BinaryIO]:
    """Write `final` in one go: a binary file that appears at its name only once complete.

    On any error the temporary file is removed and `final` is untouched.
    """
    with partial_output(Path(final), mode=mode, publish_when_done=True) as (handle, _):
        yield handle


def write_atomic(final: str | Path, data: bytes, mode: int = OUTPUT_MODE) -> None:
    with atomic_output(final, mode) as handle:
        handle.write(data)


def check_output(out: Path, *, force: bool, inputs: Iterable[Path] = (), protected_folder: Path | None = None,
                 replaceable: Callable[[Path], bool] = lambda path: False, what: str = "command",
                 option: str = "--out") -> None:
    """BadInput unless `out` may be written: its folder exists, it is not a folder, it is not (the
    same file as) one of `inputs`, and an existing file is replaced only with `force`. Anything else
    there (a FIFO, a device, a socket) is never replaced; a symlink is (the link, not its target).

    Outputs never replace inputs, `force` or not; nor does one replace a file of `protected_folder`
    (a checkpoint's folder) unless `replaceable` says ple-prep wrote it. Call this before any
    work, so that a bad output is refused at once.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise BadInput(f"output folder {out.parent} does not exist")
    if out.is_dir():
        raise BadInput(f"{out} is a folder; give a file name")
    if not os.path.lexists(out):
        return
    mode = os.lstat(out).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise BadInput(f"{out} is {_kind(mode)}, not a regular file: ple-prep never replaces one")
    for path in inputs:
        if os.path.exists(path) and os.path.exists(out) and os.path.samefile(out, path):
            raise BadInput(f"{out} is {path}, an input of this {what}: choose another {option}")
    if (protected_folder is not None and out.parent.resolve() == protected_folder.resolve()
            and not replaceable(out)):
        raise BadInput(f"{out} is a file of the checkpoint folder {protected_folder} that ple-prep did not "
                       f"write: choose another {option} (even --force never replaces it)")
    if not force:
        raise BadInput(f"{out} exists; pass --force to replace it")


# --- One writer per output -------------------------------------------------------------------------

def lock_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.lock")


@contextlib.contextmanager
def output_lock(final: str | Path) -> Iterator[None]:
    """Hold `.{name}.lock` beside `final` while writing it; a second writer fails at once.

    flock(2) locks die with their process, so a lock file a killed writer left is simply taken
    over. The holder removes the file on exit; a waiter that locked a file already removed tries
    again on the current one.
    """
    final = Path(final)
    path = lock_path(final)
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, OUTPUT_MODE)
        except OSError as exc:
            raise BadInput(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
            os.close(descriptor)
            raise BadInput(f"another ple-prep process{f' (pid {holder})' if holder.isdigit() else ''} "
                           f"is writing {final}; wait for it or choose another output") from None
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        mine = os.fstat(descriptor)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(descriptor)
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(descriptor)


# statfs f_type of file systems on block devices (ext2/3/4, xfs, btrfs, f2fs), whose native AIO is
# asynchronous: their O_DIRECT reads are never served inside io_submit, which a device fast enough
# (a virtual disk answering from its host's cache) can make the probe of DirectReader believe.
BLOCK_FILE_SYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0xF2F52010})


def file_system_type(descriptor: int) -> int | None:
    """statfs's f_type of the file open at `descriptor`, or None where fstatfs cannot tell."""
    try:
        fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    result = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux, f_type first
    if fstatfs(descriptor, result) != 0:
        return None
    return ctypes.c_long.from_buffer(result).value & 0xFFFFFFFF


def on_block_file_system(descriptor: int) -> bool:
    """Whether the file open at `descriptor` is on one of BLOCK_FILE_SYSTEMS."""
    return file_system_type(descriptor) in BLOCK_FILE_SYSTEMS


def reopen_direct(descriptor: int) -> int:
    """A new descriptor of the file open at `descriptor` (whatever its path names now), with
    O_DIRECT where its file system allows it, else buffered."""
    path = f"/proc/self/fd/{descriptor}"
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0) | _CLOEXEC)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return os.open(path, os.O_RDONLY | _CLOEXEC)
