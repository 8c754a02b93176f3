"""Notice an open table file rewritten in place under its reader (runtime/table.py checks it)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..core.errors import BadInput

# Where the 16-byte file id sits in the header (docs/FORMAT.md).
_FILE_ID_OFFSET = 72


class FileWatch:
    """Notices the open table file rewritten in place under its reader (docs/RELIABILITY.md).

    A mapped file's pages change when someone rewrites the file in place, MAP_PRIVATE or not.
    `check` costs one clock read; at most once every CHECK_SECONDS it compares the open file's
    size and modification time with those at open and re-reads the header's file id, and from
    then on every gather fails naming the change. A new file renamed over the path is no change:
    this reader keeps its own file, whole, and a reopen picks up the new one.
    """

    CHECK_SECONDS = 1.0

    def __init__(self, path: Path, descriptor: int, file_id: bytes):
        self.path, self.descriptor, self.file_id = path, descriptor, file_id
        self.opened = self._identity(os.fstat(descriptor))
        self.next_check = time.monotonic() + self.CHECK_SECONDS
        self.change: str | None = None

    @staticmethod
    def _identity(status: os.stat_result) -> tuple[int, int]:
        # Not the change time: a rename over the path unlinks this file, which updates it.
        return status.st_size, status.st_mtime_ns

    def check(self) -> None:
        if self.descriptor < 0:
            raise ValueError(f"{self.path.name}: the table is closed")
        if self.change is None and time.monotonic() >= self.next_check:
            self.change = self.changed()
            self.next_check = time.monotonic() + self.CHECK_SECONDS
        if self.change is not None:
            raise BadInput(f"{self.path} changed under this reader ({self.change}): reopen the table")

    def changed(self) -> str | None:
        """What changed in the open file since open, or None."""
        size, modified = self._identity(os.fstat(self.descriptor))
        if size != self.opened[0]:
            return f"its size went from {self.opened[0]} to {size} bytes"
        if os.pread(self.descriptor, 16, _FILE_ID_OFFSET) != self.file_id:
            return "its header's file id changed (another table was written over it)"
        if modified != self.opened[1]:
            return "it was rewritten in place (modification time changed)"
        return None

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1
