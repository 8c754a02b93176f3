"""A failed PLE lookup on any rank of a vLLM instance, raised where vLLM takes the step's output.

With tensor parallelism (vLLM 0.33.0 refuses pipeline parallelism for the PLE model) vLLM takes a
step's output from one worker and only logs another rank's exception. Yet a lookup failed on any
rank of the embedding's group puts its NaN rows into every rank's input (the ranks' all-reduce).
So each worker's lookup keeps its first failure in a record (runtime/failure_record.py) in one file
per instance, shared by the workers of this host (`/dev/shm`, one record per world rank), and each
worker raises every rank's failure before it hands a step's output over (traffic.py). The failed
rank's service thread writes its record before it releases the step; the step's output depends on
that rank's rows, so by the time the output's tokens are on the host the record shows the failure.

Ranks on other hosts write their own host's file: a failure there is raised by that host's workers,
as without this file, and here only where vLLM raises at a step whose logits hold NaN
(VLLM_RAISE_ON_LOGIT_NANS), which traffic.py then names as such a failure.
The workers of every data-parallel replica of the instance share one file, so a failure in one
replica stops the others' outputs too: the workers name it by the first rank's instance id
(storage.py), also where each replica's config has its own (vLLM's Ray launcher) or each process's
(torchrun).
"""
from __future__ import annotations

import atexit
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

from ...runtime import RECORD_BYTES, FailureRecord


class FailedOnAnotherRank(RuntimeError):
    """Another worker's PLE lookup failed a step whose output this worker would hand over."""


class FailedOnAnotherHost(FailedOnAnotherRank):
    """vLLM found NaN in a step's logits while workers on another host serve lookups whose failures
    no record of this host shows: the likely cause, named in that host's log (traffic.py)."""


def records_folder() -> Path:
    """Where the instances' files live: shared memory where the host has it."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedFailures:
    """The records of every world rank of one vLLM instance (`instance_id`), this rank's among them."""

    def __init__(self, instance_id: str, rank: int, world_size: int, *, folder: Path | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(instance_id))
        self.path = (folder or records_folder()) / f"ple-prep-failures-{os.getuid()}-{safe_id}"
        size = world_size * RECORD_BYTES
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # Every rank allocates the same size and none shrinks the file, so no rank drops another's
            # record. Allocated, not only sized: a full /dev/shm is ENOSPC here, not a SIGBUS at the
            # first write into the mapping.
            os.posix_fallocate(descriptor, 0, size)
            self._map = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self.rank = rank
        self.records = [FailureRecord(memoryview(self._map)[k * RECORD_BYTES:(k + 1) * RECORD_BYTES])
                        for k in range(world_size)]
        # Every record's state word: one look tells whether any rank failed.
        self._states = np.frombuffer(self._map, dtype=np.int32)[::RECORD_BYTES // 4]
        atexit.register(self.remove)

    @property
    def own(self) -> FailureRecord:
        return self.records[self.rank]

    def first_error(self) -> BaseException | None:
        """The failure of the lowest other rank that failed, naming it, or None (this rank's own
        failure is its lookup's to raise, with its own type)."""
        if not self._states.any():
            return None
        for rank, record in enumerate(self.records):
            error = None if rank == self.rank else record.error()
            if error is not None:
                # A record of a message holds the error's type in its text already.
                cause = str(error) if type(error) is RuntimeError else f"{type(error).__name__}: {error}"
                failed = FailedOnAnotherRank(f"the PLE lookup of {record.holder or f'rank {rank}'} failed a step: "
                                             f"{cause}")
                failed.__cause__ = error
                return failed
        return None

    def unseen_ranks(self) -> list[int]:
        """The ranks whose lookup never described itself in this file: workers that do not share it
        (on another host, or behind another /dev/shm), once every worker has built its lookups."""
        return [rank for rank, record in enumerate(self.records) if not record.holder]

    def remove(self) -> None:
        """Unlink the instance's file (the first rank to exit does; the others keep their mapping)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


_INSTANCES: dict[tuple[str, int, int], SharedFailures] = {}


def shared_failures(instance_id: str, rank: int, world_size: int) -> SharedFailures:
    """This process's records of instance `instance_id` (one object however many layers it serves)."""
    key = (str(instance_id), rank, world_size)
    if key not in _INSTANCES:
        _INSTANCES[key] = SharedFailures(instance_id, rank, world_size)
    return _INSTANCES[key]
