"""What the PLE lookup did, where an operator looks: a periodic line in vLLM's log, and Prometheus counters.

Each worker's `PreparedTableEmbedding` keeps a `StatsLog`: every `stats_seconds`
(`PLE_PREP_STATS_SECONDS`, default 60; 0: no lines) it logs the lookup's counts since its last line,
when there were steps; a failed step is logged whatever that setting. Where vLLM's metrics gather
the workers' (`PROMETHEUS_MULTIPROC_DIR` set, as vLLM sets it with more than one API server, or as
the operator sets it), the same counts go to Prometheus counters (with each line, every
EXPORT_SECONDS where there are no lines, and once more at exit) on vLLM's `/metrics`:
`ple_prep_steps_total`, `ple_prep_rows_total{tier="gpu"|"page_cache"|"host_cache"|"disk"}`,
`ple_prep_read_ahead_rows_total` (host-cache rows that read-ahead had brought),
`ple_prep_pages_read_total`, `ple_prep_read_bytes_total`, `ple_prep_late_steps_total`,
`ple_prep_late_seconds_total` (at most the time the GPU waited at the PLE layer),
`ple_prep_failed_steps_total` and `ple_prep_copied_bytes_total`. A single API server without
that variable exports none: vLLM's `/metrics` then shows that process's metrics alone. With tensor
parallelism each rank counts every id of a step, the stand-ins for the other ranks' rows among them.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Mapping

from vllm.logger import init_logger

logger = init_logger(__name__)

# The Prometheus counters: name -> (help, the counts' keys it sums, scale); rows also by tier.
_COUNTERS = {
    "ple_prep_steps": ("PLE lookup steps", ("starts",), 1),
    "ple_prep_pages_read": ("PLE table pages read from the disk", ("pages_read",), 1),
    "ple_prep_read_bytes": ("Bytes of the PLE table read from the disk", ("bytes_read",), 1),
    "ple_prep_read_ahead_rows": ("PLE rows served from the host cache that read-ahead had brought",
                                 ("rows_read_ahead",), 1),
    "ple_prep_late_steps": ("PLE steps whose rows were not ready when the GPU reached the PLE layer", ("late",), 1),
    "ple_prep_late_seconds": ("Host seconds of the late PLE steps: at most the GPU's wait", ("late_host_ns",), 1e-9),
    "ple_prep_failed_steps": ("PLE steps that failed (NaN values, the error raised)", ("failed",), 1),
    "ple_prep_copied_bytes": ("Bytes the PLE lookup copied to the GPU", ("copied_bytes",), 1),
}
_TIERS = {"gpu": "rows_resident", "page_cache": "rows_page_cache", "host_cache": "rows_host_cache",
          "disk": "rows_disk"}
# How often a failed step is looked for, to log its cause.
ERROR_POLL_SECONDS = 0.5
# How often the counters reach Prometheus where no stats lines are logged.
EXPORT_SECONDS = 10.0


def format_stats(prefix: str, counts: Mapping[str, int], seconds: float) -> str:
    """One log line of a lookup's counts over `seconds`."""
    ids = max(1, counts["ids"])
    off_gpu = max(1, counts["ids"] - counts["rows_resident"])
    return (f"PLE {prefix}: {counts['starts']} steps in {seconds:.1f} s, {counts['ids']} rows: "
            f"{100 * counts['rows_resident'] / ids:.1f}% GPU, {100 * counts['rows_page_cache'] / ids:.1f}% page cache, "
            f"{100 * counts['rows_host_cache'] / ids:.1f}% host cache, "
            f"{100 * counts['rows_disk'] / ids:.1f}% disk ({counts['pages_read']} pages, "
            f"{counts['bytes_read'] / 2**20:.1f} MiB read); read-ahead covered "
            f"{100 * counts['rows_read_ahead'] / off_gpu:.1f}% of the rows off the GPU; "
            f"{counts['late']} steps late at the PLE layer (GPU wait <= {counts['late_host_ns'] / 1e6:.2f} ms); "
            f"{counts['failed']} failed; host {counts['host_ns'] / max(1, counts['starts']) / 1e3:.1f} us a step, "
            f"{counts['copied_bytes'] / 2**20:.1f} MiB to the GPU")


class PrometheusCounters:
    """The counters above, in prometheus_client's multiprocess mode (None where it cannot export)."""

    def __init__(self):
        from prometheus_client import Counter

        self.counters = {name: Counter(name, text) for name, (text, _, _) in _COUNTERS.items()}
        self.rows = Counter("ple_prep_rows", "PLE rows served, by tier", ["tier"])

    @classmethod
    def where_exported(cls) -> "PrometheusCounters | None":
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return None
        try:
            return cls()
        except (ImportError, ValueError) as error:  # no prometheus_client, or registered twice
            logger.warning("ple-prep: no Prometheus counters (%s)", error)
            return None

    def add(self, counts: Mapping[str, int]) -> None:
        for name, (_, keys, scale) in _COUNTERS.items():
            value = sum(counts[key] for key in keys) * scale
            if value:
                self.counters[name].inc(value)
        for tier, key in _TIERS.items():
            if counts[key]:
                self.rows.labels(tier=tier).inc(counts[key])


_prometheus: PrometheusCounters | None = None
_prometheus_lock = threading.Lock()


def prometheus() -> PrometheusCounters | None:
    """The process's counters, made once (every lookup of the process adds to them)."""
    global _prometheus
    with _prometheus_lock:
        if _prometheus is None:
            _prometheus = PrometheusCounters.where_exported()
        return _prometheus


class StatsLog:
    """Every `seconds` (0: no lines), the lookup's counts since the last time: a log line (when there
    were steps) and the Prometheus counters (every EXPORT_SECONDS without lines); `flush` does it
    now. A failed step is logged within ERROR_POLL_SECONDS, naming its cause, whether or not the
    caller has been told yet (in a FULL CUDA graph no call of the plugin runs: the next step's
    schedule raises it, traffic.py). A lookup without counters (EmbeddingSource's, which raises its
    errors itself) has no thread."""

    def __init__(self, prefix: str, rows, seconds: float):
        # A weak reference: the thread must not keep the lookup (its buffers, its reader) alive.
        self.prefix, self._rows, self.seconds = prefix, weakref.ref(rows), seconds
        self._last = dict(rows.stats())
        self._since = time.monotonic()
        self._failed = self._last.get("failed", 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exporter = prometheus()
        if self._last:
            threading.Thread(target=_run, args=(weakref.ref(self), self._stop, seconds or EXPORT_SECONDS,
                                                seconds > 0), name="ple-prep-stats", daemon=True).start()
            atexit.register(_close, weakref.ref(self))

    @property
    def rows(self):
        rows = self._rows()
        if rows is None:
            self._stop.set()
        return rows

    def log_failures(self) -> None:
        rows = self.rows
        failed = 0 if rows is None else rows.stats().get("failed", 0)
        if failed > self._failed:
            error = rows.pending_error()
            cause = "raised already" if error is None else f"{type(error).__name__}: {error}"
            logger.error("PLE lookup of %s: %d step(s) failed, their values are NaN: %s", self.prefix,
                         failed - self._failed, cause)
            self._failed = failed

    def flush(self, line: bool = True) -> dict[str, int]:
        """The counts since the last flush, exported, and logged as a line if `line`."""
        rows = self.rows
        if rows is None:
            return {}
        with self._lock:
            now, since = dict(rows.stats()), time.monotonic()
            window = {key: now[key] - self._last.get(key, 0) for key in now}
            seconds, self._last, self._since = since - self._since, now, since
        if window.get("starts"):
            if line:
                logger.info(format_stats(self.prefix, window, seconds))
            if self._exporter is not None:
                self._exporter.add(window)
        return window

    def close(self) -> None:
        """Stop the thread; the counts since the last flush still reach Prometheus (and the log)."""
        self._stop.set()
        self.flush(line=self.seconds > 0)


def _close(log: weakref.ref) -> None:
    current = log()
    if current is not None:
        current.close()


def _run(log: weakref.ref, stop: threading.Event, seconds: float, line: bool) -> None:
    """The thread of a StatsLog, which it does not keep alive: it ends with the log or its lookup."""
    due = seconds
    while not stop.wait(min(ERROR_POLL_SECONDS, seconds)):
        current = log()
        if current is None:
            return
        current.log_failures()
        due -= min(ERROR_POLL_SECONDS, seconds)
        if due <= 0:
            current.flush(line)
            due = seconds
        del current
