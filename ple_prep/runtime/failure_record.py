"""A lookup's first failed step, kept in memory that other processes read.

Where several processes serve one model (vLLM's tensor-parallel ranks), the one whose
output the engine takes must raise a step that failed in any of them. So a lookup can be given a
record in memory the others map too (integrations/vllm/failures.py keeps them in a file under
/dev/shm). StepLookup's service thread writes the first failure it keeps into it before it releases
the failed step (runtime/native/steps.c), so by the time any work that used the step's rows is
complete, the record shows it. A lookup without the service thread writes its error's text
(`publish`).

The state word orders the rest: a writer claims the record (EMPTY to BEING_WRITTEN, atomically),
writes the fields, then stores the state; a reader loads the state first. With the compiled helper
those are atomic (release and acquire: runtime/native/failure_record.c), which a weakly ordered CPU (aarch64)
needs; without it there is no service thread to race with, and a lock orders this process's writers.

A record is RECORD_BYTES, 8-byte aligned, native byte order:
     0 int32    state: EMPTY, BEING_WRITTEN, STEP_FAILURE (kind, value, offset) or MESSAGE
     4 int32    kind: the service's failure kinds (STEP_FAILURE_KINDS, steps.c's FAILED_*)
     8 int64    value, 16 int64 offset (steps.c's step_service_error)
    24 int64    the lookup's max_ids, 32 float64 its read timeout (`describe`, for the message)
    64 bytes    the table file's name (128), 192 the record holder's name (64), 256 a message (256)
"""
from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np

from .readcheck import ReadTimeout, bad_sum_error

try:
    from . import _native
except ImportError:  # built only where a C compiler was there at install (setup.py)
    _native = None

RECORD_BYTES = 512
EMPTY, BEING_WRITTEN, STEP_FAILURE, MESSAGE = 0, 1, 2, 3
# runtime/native/steps.c's failure kinds, by number.
STEP_FAILURE_KINDS = ("none", "id", "read", "count", "no_reader", "mapped")
_NAME, _HOLDER, _MESSAGE, _END = 64, 192, 256, RECORD_BYTES
# The service thread writes its three fields in nanoseconds: a reader waits at most this long for them.
_WRITING_SECONDS = 0.1


def step_failure_error(kind: str, value: int, offset: int, *, name: str, read_timeout: float,
                       capacity: int, path: str | os.PathLike | None = None) -> BaseException:
    """The exception of a step the service thread failed (`kind`, `value`, `offset` as
    step_service_error gives them) for a lookup of table file `name` (a stall names its `path`
    where that is known: the mount that stalled)."""
    if kind == "id":
        return IndexError(f"row id {value} is outside the table")
    if kind == "read" and value == -2:
        return ReadTimeout(errno.ETIMEDOUT, f"{path or name}: no read of the PLE step service completed in "
                                            f"{read_timeout:g} s (waiting for byte {offset}): the disk "
                                            f"stalled; this step failed and the next one reads again")
    if kind == "read" and value == -1:
        return OSError(errno.EIO, f"{name}: short O_DIRECT read at byte {offset}: the file shrank")
    if kind == "read" and value == -3:
        return bad_sum_error(name, offset)
    if kind == "read":
        return OSError(value, f"{name}: O_DIRECT read at byte {offset}: {os.strerror(value)}")
    if kind == "mapped":
        return OSError(value, f"{name}: reading rows through the mapping failed at byte {offset} of the file "
                              "(an I/O error, or the file shrank)")
    if kind == "count":
        return ValueError(f"{value} row ids exceed this lookup's max_ids = {capacity}")
    return RuntimeError(f"the PLE step service failed a step ({kind})")


class FailureRecord:
    """One lookup's record in `buffer` (RECORD_BYTES, writable, 8-byte aligned; zeros: empty)."""

    def __init__(self, buffer):
        view = memoryview(buffer).cast("B")
        if len(view) != RECORD_BYTES or view.readonly:
            raise ValueError(f"a failure record is {RECORD_BYTES} writable bytes")
        self.buffer = view
        self._state = np.frombuffer(view, dtype=np.int32, count=2)
        if self._state.ctypes.data % 8:
            raise ValueError("a failure record must be 8-byte aligned")
        self._words = np.frombuffer(view, dtype=np.int64, count=4, offset=8)
        self._timeout = np.frombuffer(view, dtype=np.float64, count=1, offset=32)
        self._lock = threading.Lock()

    def describe(self, *, name: str, holder: str, capacity: int, read_timeout: float) -> None:
        """What a reader's message names: the table file, who holds the lookup (a rank), its limits."""
        self._words[2] = capacity
        self._timeout[0] = read_timeout
        self._put(_NAME, _HOLDER, name)
        self._put(_HOLDER, _MESSAGE, holder)

    @property
    def holder(self) -> str:
        return self._text(_HOLDER, _MESSAGE)

    def publish(self, error: BaseException) -> None:
        """Keep `error` (its type and text) unless the record holds a failure already."""
        with self._lock:
            if not self._claim():
                return
            self._put(_MESSAGE, _END, f"{type(error).__name__}: {error}")
            self._store_state(MESSAGE)

    def _claim(self) -> bool:
        """Take the record for writing if it is empty (against a step service's thread too)."""
        if _native is not None:
            return _native.record_claim(self.buffer)
        if self._state[0] != EMPTY:
            return False
        self._state[0] = BEING_WRITTEN
        return True

    def _store_state(self, state: int) -> None:
        if _native is not None:
            _native.record_state(self.buffer, state)
        else:
            self._state[0] = state

    def _load_state(self) -> int:
        return _native.record_state(self.buffer) if _native is not None else int(self._state[0])

    def error(self) -> BaseException | None:
        """The recorded failure as an exception (a message's as RuntimeError), or None."""
        deadline = time.monotonic() + _WRITING_SECONDS
        while (state := self._load_state()) == BEING_WRITTEN and time.monotonic() < deadline:
            time.sleep(1e-4)
        if state == EMPTY:
            return None
        if state == STEP_FAILURE:
            kind = int(self._state[1])
            value, offset, capacity = (int(word) for word in self._words[:3])
            return step_failure_error(STEP_FAILURE_KINDS[kind] if 0 <= kind < len(STEP_FAILURE_KINDS) else str(kind),
                                      value, offset, name=self._text(_NAME, _HOLDER),
                                      read_timeout=float(self._timeout[0]), capacity=capacity)
        if state == MESSAGE:
            return RuntimeError(self._text(_MESSAGE, _END))
        return RuntimeError(f"a PLE lookup failed a step (its record is in state {state})")

    def _put(self, start: int, stop: int, text: str) -> None:
        data = text.encode("utf-8")[:stop - start - 1]
        self.buffer[start:stop] = data + bytes(stop - start - len(data))

    def _text(self, start: int, stop: int) -> str:
        return bytes(self.buffer[start:stop]).split(b"\0", 1)[0].decode("utf-8", "replace")
