"""Cold gathers measured inside a memory cgroup (v1) whose limit leaves less room than advice wants.

A serving service capped at a few GiB holds its model and buffers (the ballast) and leaves a small
margin for the page cache. Pages advised ahead of the copy beyond that margin are reclaimed before
use and then fault back one page at a time. `measure` runs one cold gather in a child process
placed in a fresh cgroup before it starts (so every page it faults or advises is charged there),
whose ballast fills the limit but for `headroom_bytes`, and reports major faults, time, RssFile and
the cgroup's usage. Needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory.

    python bench/memcap.py REQUEST.json   (the child; `measure` builds the request)
"""
from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# The child runs this file as a script: the package is found beside bench/ (as the benches find it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.tools.benchmark import evict, major_faults  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
_NAMES = itertools.count()


def cgroups_unavailable() -> str | None:
    """Why memory cgroups cannot be made here, or None when they can."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    probe = CGROUP_ROOT / f"ple-prep-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a memory cgroup under {CGROUP_ROOT}: {exc.strerror}"
    return None


def status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (RssFile, RssAnon, VmRSS), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def own_cgroup() -> Path:
    """This process's memory cgroup folder."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / path.lstrip("/")
    raise OSError("this process is in no memory cgroup")


def cgroup_value(name: str, cgroup: Path | None = None) -> int:
    return int(((cgroup or own_cgroup()) / name).read_text())


def cgroup_stat(field: str, cgroup: Path | None = None) -> int:
    """One field of the cgroup's memory.stat (`cache`: page cache charged to it, in bytes)."""
    for line in ((cgroup or own_cgroup()) / "memory.stat").read_text().splitlines():
        name, value = line.split()
        if name == field:
            return int(value)
    raise KeyError(field)


def measure(table: str | Path, ids: np.ndarray, *, limit_bytes: int, headroom_bytes: int,
            options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One cold gather of `ids` in a child capped at `limit_bytes`, `headroom_bytes` left free.

    `options` go to `open_table` (read_path, window_pages, window_bytes). A child the cgroup's OOM
    killer ended gives only `oom_killed` True and the cgroup's failcnt.
    """
    return _run_capped({"kind": "gather", "table": str(table), "headroom_bytes": headroom_bytes,
                        "options": options or {}}, [ids], limit_bytes)


def measure_footprint(table: str | Path, requests: list[np.ndarray], *, options: dict[str, Any],
                      limit_bytes: int = 1 << 50) -> dict[str, Any]:
    """`requests` gathered one after another from a cold start in a child in its own cgroup:
    per request its seconds, the child's RssFile and page tables (VmPTE) and the cgroup's usage."""
    return _run_capped({"kind": "footprint", "table": str(table), "options": options}, requests, limit_bytes)


def _run_capped(request: dict[str, Any], arrays: list[np.ndarray], limit_bytes: int) -> dict[str, Any]:
    cgroup = CGROUP_ROOT / f"ple-prep-{os.getpid()}-{next(_NAMES)}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with tempfile.TemporaryDirectory(prefix="ple-prep-memcap-") as folder:
            request["ids"] = []
            for index, ids in enumerate(arrays):
                np.save(Path(folder) / f"ids{index}.npy", np.asarray(ids, dtype=np.int64))
                request["ids"].append(str(Path(folder) / f"ids{index}.npy"))
            (Path(folder) / "request.json").write_text(json.dumps(request))
            procs = str(cgroup / "cgroup.procs")

            def join_cgroup() -> None:
                with open(procs, "w") as handle:
                    handle.write(str(os.getpid()))

            done = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                                   str(Path(folder) / "request.json")],
                                  capture_output=True, text=True, preexec_fn=join_cgroup)
        killed = _oom_kills(cgroup) > 0
        if done.returncode != 0 and not killed:
            raise RuntimeError(f"the capped child failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        result = {} if killed else json.loads(done.stdout)
        result["oom_killed"] = killed
        result["cgroup_failcnt"] = cgroup_value("memory.failcnt", cgroup)
        return result
    finally:
        cgroup.rmdir()


def _oom_kills(cgroup: Path) -> int:
    """Processes the kernel's OOM killer ended in this cgroup."""
    for line in (cgroup / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def _footprint_child(request: dict[str, Any]) -> dict[str, Any]:
    path = Path(request["table"])
    cgroup = own_cgroup()
    evict(path)
    table = open_table(path, **request["options"])
    budget = table.mapped_budget
    release_seconds: list[float] = []
    if budget is not None:
        release = budget.release

        def timed_release() -> None:
            started = time.perf_counter()
            release()
            release_seconds.append(time.perf_counter() - started)

        budget.release = timed_release
    steps = []
    for name in request["ids"]:
        ids = np.load(name, allow_pickle=False)
        started = time.perf_counter()
        table.gather(ids)
        steps.append({"seconds": time.perf_counter() - started, "rss_file_kib": status_kib("RssFile"),
                      "vm_pte_kib": status_kib("VmPTE"),
                      "usage_bytes": cgroup_value("memory.usage_in_bytes", cgroup)})
    read_path = table.read_path
    table.close()
    return {"read_path": read_path, "steps": steps, "releases": len(release_seconds),
            "release_seconds": release_seconds}


def _child(request_file: str) -> dict[str, Any]:
    request = json.loads(Path(request_file).read_text())
    if request["kind"] == "footprint":
        return _footprint_child(request)
    path = Path(request["table"])
    ids = np.load(request["ids"][0], allow_pickle=False)
    cgroup = own_cgroup()
    evict(path)
    table = open_table(path, **request["options"])
    slots = table.slot_of(ids)
    distinct_pages = len(np.unique(slots // table.rows_per_page))
    out = np.empty((len(ids), table.row_bytes), dtype=np.uint8)
    limit = cgroup_value("memory.limit_in_bytes", cgroup)
    # The ballast: anonymous memory the service holds (no swap, so never reclaimed), touched.
    ballast_bytes = max(0, limit - cgroup_value("memory.usage_in_bytes", cgroup) - request["headroom_bytes"])
    ballast = np.ones(ballast_bytes, dtype=np.uint8)
    usage_before = cgroup_value("memory.usage_in_bytes", cgroup)
    cache_before = cgroup_stat("cache", cgroup)
    faults = major_faults()
    started = time.perf_counter()
    table.gather(ids, out=out)
    seconds = time.perf_counter() - started
    faults = major_faults() - faults
    result = {"read_path": table.read_path, "window": table._gatherer.window,
              "rows": len(ids), "distinct_pages": distinct_pages, "major_faults": faults,
              "faults_per_page": round(faults / distinct_pages, 3), "seconds": round(seconds, 4),
              "rows_per_s": round(len(ids) / seconds), "limit_bytes": limit,
              "ballast_bytes": ballast_bytes, "usage_before_bytes": usage_before,
              "usage_after_bytes": cgroup_value("memory.usage_in_bytes", cgroup),
              "cache_growth_bytes": cgroup_stat("cache", cgroup) - cache_before,
              "max_usage_bytes": cgroup_value("memory.max_usage_in_bytes", cgroup),
              "rss_file_kib": status_kib("RssFile"), "own_minor_faults":
                  resource.getrusage(resource.RUSAGE_SELF).ru_minflt}
    del ballast
    table.close()
    return result


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
