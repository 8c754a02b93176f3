"""A cgroup v1 blkio group that slows reads of one disk to one a second, for the disk-stall tests."""
from __future__ import annotations

import os
import time

import pytest

BLKIO = "/sys/fs/cgroup/blkio"


class SlowedDisk:
    """`with SlowedDisk(path) as disk:` a blkio group for the disk holding `path` (the test skips
    without root or the controller); `throttle()` slows its reads to one a second and `unthrottle()`
    lifts that; `enter()` moves this process into the group (every thread, or only the calling one)
    and `leave()` back. Leaving the block waits for throttled reads still in flight, then removes
    the group."""

    def __init__(self, path, name: str = "ple-prep-test"):
        if os.getuid() != 0 or not os.path.exists(f"{BLKIO}/blkio.throttle.read_iops_device"):
            pytest.skip("needs root and the cgroup v1 blkio controller")
        device = os.stat(path).st_dev
        self.device = f"{os.major(device)}:{os.minor(device)}"
        self.group = f"{BLKIO}/{name}-{os.getpid()}"

    def __enter__(self) -> "SlowedDisk":
        os.mkdir(self.group)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1.5)  # the throttled reads left in flight finish: a group with tasks cannot go
        os.rmdir(self.group)

    def throttle(self, reads_per_second: int = 1) -> None:
        with open(f"{self.group}/blkio.throttle.read_iops_device", "w") as file:
            file.write(f"{self.device} {reads_per_second}")

    def unthrottle(self) -> None:
        self.throttle(0)

    def enter(self, every_thread: bool = True) -> None:
        with open(f"{self.group}/{'cgroup.procs' if every_thread else 'tasks'}", "w") as file:
            file.write(str(os.getpid()))

    def leave(self, every_thread: bool = True) -> None:
        with open(f"{BLKIO}/{'cgroup.procs' if every_thread else 'tasks'}", "w") as file:
            file.write(str(os.getpid()))
