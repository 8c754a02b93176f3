"""A thread running Python bytecode without pause, for benches that measure beside a busy engine."""
from __future__ import annotations

import threading


class PythonBusy:
    """A thread running Python bytecode without pause, as vLLM's scheduler does between steps: it holds
    the GIL but for the interpreter's switch interval."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        total = 0
        while not self._stop.is_set():
            for k in range(1000):
                total += k * k

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
