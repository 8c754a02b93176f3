"""A test case run in a forked child, so that a signal or a hang fails the test instead of the run."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
import traceback


def in_child(function, *args, timeout: float = 20.0):
    """`function(*args)` in a forked child: its result (plain JSON data, its lists as tuples), or
    its exception re-raised here as an AssertionError with its traceback; a signal or a hang fails
    the test."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        # The guarded copies' handler, not faulthandler's dump, takes a SIGBUS here, as in a server.
        faulthandler.disable()
        os.close(reader)
        try:
            outcome = json.dumps(("ok", function(*args)), default=_plain)
        except BaseException as exc:  # the parent reports it
            outcome = json.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        os.write(writer, outcome.encode())
        os._exit(0)
    os.close(writer)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            os.close(reader)
            raise AssertionError(f"hung for {timeout} s")
        time.sleep(0.01)
    data = b""
    while chunk := os.read(reader, 1 << 20):
        data += chunk
    os.close(reader)
    if os.WIFSIGNALED(status):
        raise AssertionError(f"killed by {signal.Signals(os.WTERMSIG(status)).name}")
    kind, value = json.loads(data)
    value = _tuples(value)
    if kind == "error":
        raise AssertionError(value)
    return value


def _tuples(value):
    """JSON's lists as the tuples the cases return."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _plain(value):
    """A set, as the cases return for the outcomes they saw, in JSON: its sorted items."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not plain data")
