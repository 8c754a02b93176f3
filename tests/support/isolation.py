"""A test case run in a forked child, so that a signal or a hang fails the test instead of the run."""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import time
import traceback


def in_child(function, *args, timeout: float = 20.0):
    """`function(*args)` in a forked child: its result, or its exception re-raised here as an
    AssertionError with its traceback; a signal or a hang fails the test."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        # The guarded copies' handler, not faulthandler's dump, takes a SIGBUS here, as in a server.
        faulthandler.disable()
        os.close(reader)
        try:
            outcome = ("ok", function(*args))
        except BaseException as exc:  # the parent reports it
            outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        os.write(writer, pickle.dumps(outcome))
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
    kind, value = pickle.loads(data)
    if kind == "error":
        raise AssertionError(value)
    return value
