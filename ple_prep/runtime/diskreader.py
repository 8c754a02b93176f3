"""The disk tier's reader for a read path (runtime/table.py's open_table): O_DIRECT and native AIO
(runtime/direct.py) or buffered preadv on threads (runtime/pread.py), falling back from the first
to the second, where the caller let the default choose, on a file system that cannot serve it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.errors import BadInput
from .direct import DirectReader, DirectUnavailable
from .pread import PREAD_THREADS, PreadReader


def open_disk_reader(read_path: str, may_fall_back: bool, descriptor: int, path: Path, header, queue_depth: int,
                     timeout: float, sums: np.ndarray | None) -> tuple[DirectReader | PreadReader | None, str | None]:
    """(the reader, or None for "mapped"; why it fell back, or None). `descriptor` is the table's
    validated file: the direct reader reopens it through /proc, the pread reader duplicates it, so
    both read that file whatever `path` names now."""
    direct, note = None, None
    if read_path == "direct":
        try:
            direct = DirectReader(f"/proc/self/fd/{descriptor}", header, queue_depth, name=str(path),
                                  timeout=timeout, page_sums=sums)
        except DirectUnavailable as exc:
            if not may_fall_back:
                raise BadInput(f"cannot read {path.name} with O_DIRECT: {exc.strerror}; "
                               f"open it with read_path='pread'") from None
            note = f"O_DIRECT unavailable ({exc.strerror}): rows are read with pread"
            read_path = "pread"
        if direct is not None and direct.synchronous and may_fall_back:
            direct.close()
            direct = None
            note = ("O_DIRECT reads complete inside io_submit on this file system (one at a time, out of reach "
                    "of the read timeout): rows are read with pread")
            read_path = "pread"
        elif direct is not None and direct.synchronous:  # asked for: kept, and the caller told what it costs
            note = ("O_DIRECT reads complete inside io_submit on this file system: this table's own reads run one "
                    "at a time, and a hung one is out of reach of the read timeout (read_path='pread' keeps it "
                    "in reach)")
    if read_path == "pread":
        direct = PreadReader(descriptor, header, min(queue_depth, PREAD_THREADS), name=str(path), timeout=timeout,
                             page_sums=sums)
    return direct, note
