"""Concurrency: 8 threads and 2 processes gathering from one table at once get bit-exact rows."""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support.environment import child_environment

from ple_prep.runtime import open_table
from ple_prep.tools.benchmark import evict

THREADS = 8
PROCESSES = 2
ROUNDS = 40
BATCH = 4096
# A child process hands its digests back as JSON on stdout (nothing pickled either way).
CHILD = ("import json, sys\nsys.path.insert(0, {tests!r})\nfrom test_concurrency import _gather_digests\n"
         "print(json.dumps(_gather_digests(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))\n"
         ).format(tests=str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def shared_table(fp8_checkpoint, tmp_path_factory, converted_table):
    """A table with placed rows (so lookups go through the order map) and its source rows."""
    made = converted_table(fp8_checkpoint, tmp_path_factory.mktemp("concurrent") / "t.bin", with_rows=True,
                           placed=lambda rows, _: np.random.default_rng(6).choice(rows, 2000, replace=False))
    return made.path, made.rows


def _ids(worker: int, round_number: int, num_rows: int) -> np.ndarray:
    return np.random.default_rng([worker, round_number]).integers(0, num_rows, BATCH)


def _gather_digests(path: str, worker: int, num_rows: int) -> list[str]:
    """In a child process: open the table itself and hash every round's rows."""
    with open_table(path) as table:
        return [hashlib.sha256(table.gather(_ids(worker, r, num_rows))).hexdigest()
                for r in range(ROUNDS)]


def _threads_gather(table, expected: np.ndarray) -> list[int]:
    """Rows that differ from the source, per thread, with THREADS threads sharing one Table."""
    start = threading.Barrier(THREADS)

    def work(worker: int) -> int:
        start.wait()
        wrong = 0
        for r in range(ROUNDS):
            ids = _ids(worker, r, len(expected))
            wrong += int(np.count_nonzero(np.any(table.gather(ids) != expected[ids], axis=1)))
        return wrong

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(work, range(THREADS)))


def test_gather_from_eight_threads_and_two_processes_at_once_is_bit_exact(shared_table):
    path, expected = shared_table
    evict(path)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(100 + p), str(len(expected))],
                                 stdout=subprocess.PIPE, text=True, env=child_environment())
                for p in range(PROCESSES)]
    with open_table(path) as table:
        wrong = _threads_gather(table, expected)
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [child.returncode for child in children] == [0] * PROCESSES
    digests = [json.loads(output) for output in outputs]
    assert wrong == [0] * THREADS
    for p, worker_digests in enumerate(digests):
        assert worker_digests == [hashlib.sha256(expected[_ids(100 + p, r, len(expected))]).hexdigest()
                                  for r in range(ROUNDS)]


def test_gather_from_eight_threads_without_read_ahead_advice_is_bit_exact(shared_table):
    path, expected = shared_table
    evict(path)
    with open_table(path, window_pages=0) as table:
        assert _threads_gather(table, expected) == [0] * THREADS
