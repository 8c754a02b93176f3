"""One harness for tests that kill a real `ple-prep` process: start the CLI in a child, wait for a
condition (with a deadline, sleeping between looks), and SIGKILL it."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
# Kills the child itself when the audit event of its N-th os.rename fires (before the rename).
_KILL_AT_RENAME = """
import os, signal
renames = 0
def hook(event, args):
    global renames
    if event == "os.rename":
        renames += 1
        if renames == KILL_AT_RENAME:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
"""


def start_cli(args: list[str], *, setup: str = "", kill_at_rename: int = 0) -> subprocess.Popen:
    """`ple-prep ARGS` in a child process; `setup` is Python run first (say, a smaller block size);
    with `kill_at_rename` N the child kills itself just before its N-th rename."""
    code = "import sys\n" + setup + "\n"
    if kill_at_rename:
        code += f"KILL_AT_RENAME = {kill_at_rename}\n" + _KILL_AT_RENAME
    code += "from ple_prep.cli import cli\ncli(sys.argv[1:], prog_name='ple-prep')\n"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_until(condition: Callable[[], bool], *, timeout: float, process: subprocess.Popen | None = None,
               interval: float = 0.002) -> bool:
    """True once `condition()` holds; False when `process` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if process is not None and process.poll() is not None:
            return False
        time.sleep(interval)
    return False


def reap(process: subprocess.Popen, timeout: float = 120) -> int:
    """Wait (with a deadline) for a child that ends by itself, say one killing itself at a rename."""
    try:
        return process.wait(timeout)
    finally:
        if process.stderr is not None:
            process.stderr.close()


def kill(process: subprocess.Popen) -> int:
    """SIGKILL the child (if it still runs) and reap it; its exit status (-9 when killed)."""
    process.kill()
    status = process.wait()
    if process.stderr is not None:
        process.stderr.close()
    return status


def file_size_at_least(pattern_folder: Path, pattern: str, size: int) -> Callable[[], bool]:
    """A condition: some file of `pattern` in the folder has at least `size` bytes."""
    def check() -> bool:
        for path in pattern_folder.glob(pattern):
            try:
                if path.stat().st_size >= size:
                    return True
            except FileNotFoundError:
                pass
        return False
    return check
