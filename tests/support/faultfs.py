"""A FUSE file system that passes a folder through and injects disk faults into chosen byte ranges.

    with FaultFS(source_folder) as fs:          # mounted at fs.mount, in its own process
        fs.fail("t.bin", start, end, "eio")     # reads touching [start, end) fail with EIO
        ...
        fs.clear()                              # the disk recovers

Faults: "eio" (the read fails with EIO), "short" (the read returns only the bytes before `start`),
"zeros" (the bytes in the range read as zeros), "delay" (the read waits `seconds` first), "hang"
(the read waits until the rule is cleared). The server runs in a child process: a test that faults
on a mapping of the mount while holding the GIL must not stop the server answering. Rules reach it
through a JSON file it re-reads when its modification time changes.

FUSE needs /dev/fuse, libfuse2 (apt-get install libfuse2) and fusepy (pip install fusepy); where
any is missing or mounting is refused, `fuse_unavailable()` says why and the tests skip.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAULTS = ("eio", "short", "zeros", "delay", "hang")


def fuse_unavailable() -> str | None:
    """Why FUSE cannot be used here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError, EnvironmentError) as exc:
        return f"fusepy or libfuse2 missing ({exc}): apt-get install libfuse2 && pip install fusepy"
    if not any(os.access(os.path.join(p, "fusermount"), os.X_OK) for p in os.get_exec_path()) and os.getuid():
        return "fusermount missing and not root"
    return None


class FaultFS:
    """The mount of `source` with fault rules, served by a child process."""

    def __init__(self, source: str | Path):
        self.source = Path(source)
        self._folder = Path(tempfile.mkdtemp(prefix="faultfs-"))
        self.mount = self._folder / "mnt"
        self.mount.mkdir()
        self.rules_file = self._folder / "rules.json"
        self._rules: list[dict] = []
        self._write_rules()
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "FaultFS":
        self._process = subprocess.Popen([sys.executable, __file__, str(self.source), str(self.mount),
                                          str(self.rules_file)], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mount):
            if self._process.poll() is not None or time.monotonic() > deadline:
                error = self._process.stderr.read().decode(errors="replace")[-500:] \
                    if self._process.poll() is not None else "timed out"
                self._stop()
                raise OSError(errno.ENODEV, f"FUSE mount failed: {error}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()
        self._stop()

    def _stop(self) -> None:
        if os.path.ismount(self.mount):
            # fusermount comes with the fuse package, not libfuse2; root can unmount without it.
            for command in (["fusermount", "-u", "-z"], ["umount", "-l"]):
                try:
                    if subprocess.run([*command, str(self.mount)], capture_output=True).returncode == 0:
                        break
                except FileNotFoundError:
                    continue
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        for path in (self.rules_file, self.mount):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except OSError:
                pass
        try:
            self._folder.rmdir()
        except OSError:
            pass

    def path(self, name: str) -> Path:
        return self.mount / name

    def fail(self, name: str, start: int, end: int, fault: str, seconds: float = 0.0) -> None:
        """Reads of `name` that touch bytes [start, end) get `fault` from now on."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}")
        self._rules.append({"path": "/" + name, "start": int(start), "end": int(end), "fault": fault,
                            "seconds": float(seconds)})
        self._write_rules()

    def clear(self) -> None:
        """No faults from now on (a hung read returns)."""
        self._rules = []
        self._write_rules()

    def _write_rules(self) -> None:
        temporary = self.rules_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(self._rules))
        os.replace(temporary, self.rules_file)


def serve(source: str, mount: str, rules_file: str) -> None:
    """The server (the child process): a read-only passthrough of `source` with the rules applied."""
    import fuse

    class Server(fuse.Operations):
        def __init__(self):
            self.rules: list[dict] = []
            self.stamp = None

        def _current_rules(self) -> list[dict]:
            try:
                stamp = os.stat(rules_file).st_mtime_ns
                if stamp != self.stamp:
                    with open(rules_file) as file:
                        self.rules = json.load(file)
                    self.stamp = stamp
            except (OSError, ValueError):
                pass
            return self.rules

        def getattr(self, path, fh=None):
            status = os.lstat(source + path)
            return {key: getattr(status, key) for key in ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid",
                                                          "st_atime", "st_mtime", "st_ctime")}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(source + path)

        def open(self, path, flags):
            return os.open(source + path, os.O_RDONLY)

        def release(self, path, fh):
            os.close(fh)

        def read(self, path, size, offset, fh):
            end = offset + size
            for rule in self._current_rules():
                if rule["path"] != path or not (offset < rule["end"] and rule["start"] < end):
                    continue
                fault = rule["fault"]
                if fault == "eio":
                    raise fuse.FuseOSError(errno.EIO)
                if fault == "delay":
                    time.sleep(rule["seconds"])
                elif fault == "hang":
                    while rule in self._current_rules():
                        time.sleep(0.05)
                elif fault == "short":
                    size = max(0, rule["start"] - offset)
            data = os.pread(fh, size, offset)
            for rule in self._current_rules():
                if rule["path"] == path and rule["fault"] == "zeros" and offset < rule["end"] and rule["start"] < end:
                    low, high = max(rule["start"], offset) - offset, min(rule["end"], end) - offset
                    data = data[:low] + bytes(max(0, min(high, len(data)) - low)) + data[high:]
            return data

    # No attribute caching: a short read makes the kernel shrink its idea of the file size, which
    # the next getattr must put right once the fault is cleared.
    fuse.FUSE(Server(), mount, foreground=True, nothreads=False, ro=True, allow_other=os.getuid() == 0,
              attr_timeout=0, entry_timeout=0)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
