"""The vLLM schedule's feed: new requests' later prompt chunks read ahead, a sample recorded."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from ple_prep.integrations.vllm import backend, failures, traffic
from ple_prep.integrations.vllm.backend import PrefetchedRows
from ple_prep.integrations.vllm.settings import Settings
from ple_prep.ngram import NgramSpec, row_ids
from ple_prep.offline.profile import load_profile
from ple_prep.runtime import gather, open_table


@dataclasses.dataclass
class NewRequest:
    """The fields traffic.py reads of vLLM 0.33.0's NewRequestData (vllm/v1/core/sched/output.py)."""
    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0


@dataclasses.dataclass
class Schedule:
    """The fields traffic.py reads of vLLM 0.33.0's SchedulerOutput."""
    scheduled_new_reqs: list
    num_scheduled_tokens: dict
    finished_req_ids: set = dataclasses.field(default_factory=set)


@pytest.fixture
def served(monkeypatch, fp8_table):
    monkeypatch.setattr(traffic, "_SERVED", traffic._Served())
    monkeypatch.setattr(traffic, "_tokenizer_sha256", lambda: None)
    table = open_table(fp8_table, read_path="mapped", host_cache_bytes=4 << 20)
    yield table
    table.close()


def test_a_new_requests_later_chunks_are_read_ahead(served, tmp_path):
    table = served
    traffic.serve(table, 100, Settings("/t.bin", record_profile=str(tmp_path / "served.prof")), record=True)
    tokens = np.random.default_rng(4).integers(0, 800, 300).tolist()
    traffic.on_schedule(Schedule([NewRequest("r1", tokens, num_computed_tokens=20)], {"r1": 64}))
    traffic._SERVED.worker.shutdown(wait=True)
    (job,) = traffic._SERVED.jobs["r1"]
    assert job.wait(30) and job.error is None
    spec = NgramSpec.from_json(table.manifest["ngram"])
    later = row_ids(tokens, spec)[84:]  # after the computed tokens and the first chunk
    slots = np.unique(table.slot_of(later.reshape(-1)))
    assert job.rows_read == int((slots >= 100).sum())
    assert len(job.chunks) == -(-(300 - 84) // 64)
    read = table.host_cache.rows_read
    table.gather_slots(slots[slots >= 100])
    assert table.host_cache.rows_read == read  # all there already (the GPU tier's slots left out)
    recorder = traffic._SERVED.recorder
    assert recorder.seen == 1
    recorder.sample_every = 1
    traffic.on_schedule(Schedule([NewRequest("r2", tokens[:50])], {"r2": 50}, {"r1"}))
    recorder.close()
    assert load_profile(tmp_path / "served.prof").requests == 1
    assert "r1" not in traffic._SERVED.jobs


def test_without_a_configured_table_the_wrapper_only_calls_through():
    class Runner:
        def _update_states(self, scheduler_output):
            return ("updated", scheduler_output)

    module = type("module", (), {"GPUModelRunner": Runner})
    traffic.install(module)
    traffic.install(module)  # once only
    assert Runner._update_states.ple_prep_feed
    assert Runner()._update_states("schedule") == ("updated", "schedule")


def test_the_v2_runners_steps_feed_the_schedule_but_its_dummy_runs_do_not(served, monkeypatch):
    seen = []
    monkeypatch.setattr(traffic, "on_schedule", seen.append)

    class Runner:  # vLLM 0.33.0's V2 runner (vllm/v1/worker/gpu/model_runner.py): no _update_states
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kwargs):
            return ("ran", scheduler_output, dummy_run)

    module = type("module", (), {"GPUModelRunner": Runner})
    traffic.install(module)
    traffic.install(module)  # once only
    assert Runner().execute_model("step") == ("ran", "step", False)
    assert Runner().execute_model("dummy", None, dummy_run=True) == ("ran", "dummy", True)
    assert seen == ["step"]


def test_vllms_warmup_requests_are_neither_read_ahead_nor_recorded(served, tmp_path):
    traffic.serve(served, 0, Settings("/t.bin", record_profile=str(tmp_path / "served.prof")), record=True)
    tokens = list(range(200))
    warmups = ["_warmup_0_", "_v2_mixed_warmup_prefill_", "_step5_dsa_warmup_decode_", "_sparse_mla_v2_warmup_prefill_"]
    traffic.on_schedule(Schedule([NewRequest(name, tokens) for name in warmups], dict.fromkeys(warmups, 10)))
    assert traffic._SERVED.worker is None and traffic._SERVED.jobs == {}
    assert traffic._SERVED.recorder.seen == 0
    traffic._SERVED.recorder.close()


def test_a_request_finished_before_its_read_ahead_was_stored_has_it_cancelled(served):
    traffic.serve(served, 0, Settings("/t.bin"), record=False)
    gate = concurrent.futures.ThreadPoolExecutor(1)
    traffic._SERVED.worker = gate
    hold = threading.Event()
    gate.submit(hold.wait)  # the feed thread busy with an earlier prompt
    tokens = np.random.default_rng(5).integers(0, 800, 300).tolist()
    traffic.on_schedule(Schedule([NewRequest("r1", tokens)], {"r1": 16}))
    traffic.on_schedule(Schedule([], {}, {"r1"}))  # it finished meanwhile
    hold.set()
    gate.shutdown(wait=True)
    assert traffic._SERVED.jobs == {} and traffic._SERVED.feeding == set() and traffic._SERVED.finished == set()


def test_a_request_finished_while_its_read_ahead_is_stored_has_it_cancelled(served, monkeypatch):
    traffic.serve(served, 0, Settings("/t.bin"), record=False)
    made, cancelled = [], []
    read_ahead = served.read_ahead

    def finishing_meanwhile(chunks, **kwargs):  # the finish lands while this thread makes its job
        job = read_ahead(chunks, **kwargs)
        cancel = job.cancel
        job.cancel = lambda: (cancelled.append(job), cancel())
        made.append(job)
        traffic.on_schedule(Schedule([], {}, {"r1"}))
        return job

    monkeypatch.setattr(served, "read_ahead", finishing_meanwhile)
    tokens = np.random.default_rng(6).integers(0, 800, 300).tolist()
    traffic.on_schedule(Schedule([NewRequest("r1", tokens)], {"r1": 16}))
    traffic._SERVED.worker.shutdown(wait=True)
    (job,) = made
    assert traffic._SERVED.jobs == {} and traffic._SERVED.feeding == set() and traffic._SERVED.finished == set()
    assert cancelled == [job] or job.done  # a job that read everything already has nothing to stop


class FailedLookup:
    """A watched lookup whose step failed, as PrefetchedRows raises it."""

    def check(self):
        raise OSError(5, "Input/output error", "ple.bin")


@dataclasses.dataclass
class StepOutput:
    """The field traffic.py tells a step's output by, of vLLM 0.33.0's ModelRunnerOutput."""
    sampled_token_ids: list


class AsyncStepOutput:
    """vLLM 0.33.0's AsyncModelRunnerOutput: get_output waits for the step's tokens."""

    def get_output(self):
        return StepOutput([[7]])


def test_no_steps_output_is_handed_over_while_a_lookup_has_failed(monkeypatch):
    monkeypatch.setattr(traffic, "_SERVED", traffic._Served())

    class Worker:  # vLLM 0.33.0's Worker (vllm/v1/worker/gpu_worker.py)
        def execute_model(self, scheduler_output):
            return None if scheduler_output == "nothing sampled" else StepOutput([[3]])

        def sample_tokens(self, grammar_output):
            return AsyncStepOutput()

    module = type("module", (), {"Worker": Worker})
    traffic.install_output_check(module)
    traffic.install_output_check(module)  # once only
    worker = Worker()
    assert worker.execute_model("step") == StepOutput([[3]])
    assert worker.sample_tokens(None).get_output() == StepOutput([[7]])
    lookup = FailedLookup()
    traffic.watch(lookup)
    with pytest.raises(OSError, match="Input/output error"):
        worker.execute_model("step")
    assert worker.execute_model("nothing sampled") is None
    pending = worker.sample_tokens(None)  # the tokens still on the device: nothing to check yet
    with pytest.raises(OSError, match="Input/output error"):
        pending.get_output()


def test_read_ahead_off_feeds_nothing(served):
    traffic.serve(served, 0, Settings("/t.bin", read_ahead=False), record=False)
    traffic.on_schedule(Schedule([NewRequest("r1", list(range(200)))], {"r1": 10}))
    assert traffic._SERVED.worker is None and traffic._SERVED.jobs == {}


@pytest.mark.needs_helper
def test_a_failed_step_is_raised_by_the_next_schedule_and_every_later_one(served):
    """A FULL CUDA graph replays the lookup without calling the plugin: the schedule's update raises
    the failed step's error (naming the id) in vLLM's worker, and so does every later schedule
    (vLLM's engine stops at the first: no later step may pass for served)."""
    table = served
    rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16)
    try:
        traffic.watch(rows)
        ids = torch.from_numpy(np.arange(16, dtype=np.int64).reshape(1, 16) + table.first_row)
        ids[0, 3] = table.first_row + table.num_rows + 5
        rows.start(ids)  # no finish: a graph replay's Python calls are none
        deadline = time.monotonic() + 30
        while rows.pending_error() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(2):
            with pytest.raises(IndexError, match=f"row id {table.first_row + table.num_rows + 5} is outside"):
                traffic.on_schedule(Schedule([], {}))
    finally:
        rows.close()


@pytest.mark.needs_helper
def test_another_workers_failed_step_is_raised_before_this_workers_output_is_handed_over(served, monkeypatch,
                                                                                         tmp_path):
    """Two workers of one instance (two lookups here; processes in tests/vllm_plugin): the service
    thread of worker 1 writes its failed step into its record; worker 0 raises it, naming worker 1
    and the cause, at the next schedule and before any output. A step of worker 1's own raises its
    own error, as before."""
    table = served
    monkeypatch.setattr(failures, "records_folder", lambda: tmp_path)
    workers = [failures.SharedFailures("instance-7", rank, 2, folder=tmp_path) for rank in range(2)]
    rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16,
                          failure_record=workers[1].own, holder="worker rank 1 of 2")
    try:
        traffic.watch(rows, workers[1])
        assert workers[0].first_error() is None
        ids = torch.from_numpy(np.arange(16, dtype=np.int64).reshape(1, 16) + table.first_row)
        ids[0, 3] = table.first_row + table.num_rows + 5
        rows.start(ids)
        deadline = time.monotonic() + 30
        while rows.pending_error() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        error = workers[0].first_error()
        assert isinstance(error, failures.FailedOnAnotherRank)
        assert str(error) == (f"the PLE lookup of worker rank 1 of 2 failed a step: IndexError: row id "
                              f"{table.first_row + table.num_rows + 5} is outside the table")
        assert workers[1].first_error() is None  # its own: the lookup raises it, with its own type
        with pytest.raises(IndexError):
            traffic.on_schedule(Schedule([], {}))
        monkeypatch.setattr(traffic, "_SERVED", traffic._Served())
        traffic.watch(PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16), workers[0])
        for _ in range(2):
            with pytest.raises(failures.FailedOnAnotherRank, match="worker rank 1 of 2 failed a step"):
                traffic.raise_failed_lookups()
    finally:
        rows.close()
    workers[0].remove()
    assert not list(tmp_path.iterdir())
    workers[1].remove()  # the other worker's exit finds it gone


@pytest.mark.parametrize("raise_on_nan_logits", [None, "1"])
def test_the_first_schedule_warns_once_of_workers_that_share_no_records(served, tmp_path, caplog, monkeypatch,
                                                                        raise_on_nan_logits):
    """Workers 0 and 1 of 3 describe themselves in this host's file, worker 2 (another host) never
    does: the first schedule names rank 2 in one warning, which names the variable that stops vLLM at
    a step whose logits are NaN; with that variable set, a line of information says so instead; where
    every worker shares the file, nothing."""
    if raise_on_nan_logits is None:
        monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)
    else:
        monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", raise_on_nan_logits)
    caplog.set_level("INFO", logger=traffic.logger.name)
    level, said = ("INFO", "where vLLM raises it") if raise_on_nan_logits else \
        ("WARNING", "set VLLM_RAISE_ON_LOGIT_NANS=1, and vLLM stops at such a step")
    for world, described, warned in ((3, (0, 1), True), (2, (0, 1), False)):
        traffic._SERVED = traffic._Served()
        workers = [failures.SharedFailures(f"instance-{world}", rank, world, folder=tmp_path) for rank in described]
        for worker in workers:
            worker.own.describe(name="ple.bin", holder=f"worker rank {worker.rank} of {world}", capacity=64,
                                read_timeout=30.0)
        traffic.watch(PrefetchedRows(served, device="cpu", resident_bytes=0, max_tokens=4, heads=16), workers[0])
        caplog.clear()
        for _ in range(2):
            traffic.on_schedule(Schedule([], {}))
        lines = [(record.levelname, record.getMessage()) for record in caplog.records]
        if warned:
            assert len(lines) == 1 and lines[0][0] == level, lines
            assert "worker ranks 2 of 3 do not share" in lines[0][1] and said in lines[0][1]
        else:
            assert not lines
        for worker in workers:
            worker.remove()


class NanLogitsWorker:
    """vLLM 0.33.0's Worker whose runner raises at a step whose logits hold NaN
    (VLLM_RAISE_ON_LOGIT_NANS): at once without asynchronous scheduling, else at get_output."""

    error = f"{traffic.NAN_LOGITS}: {{'request-3': 160}}"

    def execute_model(self, scheduler_output):
        raise RuntimeError(self.error)

    def sample_tokens(self, grammar_output):
        error = self.error

        class Pending:
            def get_output(self):
                raise RuntimeError(error)

        return Pending()


def test_nan_logits_vllm_raises_name_a_lookup_failed_on_another_host(served, tmp_path, monkeypatch):
    """A lookup failed on another host (rank 2 of 3, whose records this host never sees) gives every
    rank NaN values and no record here: the error vLLM raises at the step's NaN logits is raised as
    FailedOnAnotherHost, naming rank 2 and carrying vLLM's error as its cause. Where every rank
    shares this host's records, or the error is another, it passes unchanged; a failure this host's
    records show is raised as itself."""
    monkeypatch.setattr(traffic, "_SERVED", traffic._Served())
    module = type("module", (), {"Worker": NanLogitsWorker})
    traffic.install_output_check(module)
    worker = NanLogitsWorker()
    for world, unseen in ((3, True), (2, False)):
        traffic._SERVED = traffic._Served()
        shared = [failures.SharedFailures(f"nan-{world}", rank, world, folder=tmp_path) for rank in (0, 1)]
        for record in shared:
            record.own.describe(name="ple.bin", holder=f"worker rank {record.rank} of {world}", capacity=64,
                                read_timeout=30.0)
        traffic.watch(PrefetchedRows(served, device="cpu", resident_bytes=0, max_tokens=4, heads=16), shared[0])
        for call in (lambda: worker.execute_model("step"), lambda: worker.sample_tokens(None).get_output()):
            with pytest.raises(RuntimeError) as raised:
                call()
            if unseen:
                assert type(raised.value) is failures.FailedOnAnotherHost
                assert str(raised.value) == (
                    f"vLLM found NaN in this step's logits ({NanLogitsWorker.error}). Worker ranks 2 of 3 run on "
                    "another host, whose failed PLE lookups this host's records do not show: a lookup failed there "
                    "gives every rank NaN values, and that host's log names the cause")
                assert str(raised.value.__cause__) == NanLogitsWorker.error
            else:
                assert type(raised.value) is RuntimeError and str(raised.value) == NanLogitsWorker.error
        for record in shared:
            record.remove()
    monkeypatch.setattr(NanLogitsWorker, "error", "CUDA error: an illegal memory access was encountered")
    traffic._SERVED = traffic._Served()
    failed = FailedLookup()  # watched weakly: held here
    traffic.watch(failed, failures.SharedFailures("nan-other", 0, 3, folder=tmp_path))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        worker.execute_model("step")
    monkeypatch.setattr(NanLogitsWorker, "error", f"{traffic.NAN_LOGITS}: {{'request-3': 160}}")
    with pytest.raises(OSError, match="Input/output error"):  # this host's own failure, as itself
        worker.execute_model("step")


def test_an_error_raised_without_the_service_thread_is_written_to_the_record(tmp_path):
    """EmbeddingSource's errors (and a start's own refusals) are written as a message, once: the first stays."""
    (worker,) = [failures.SharedFailures("instance-8", 0, 1, folder=tmp_path)]
    record = worker.own
    kept = backend._KeptFailure(record)
    for message in ("first", "second"):
        kept.keep(OSError(5, message))
    other = failures.SharedFailures("instance-8", 1, 2, folder=tmp_path)
    assert str(other.first_error()) == "the PLE lookup of rank 0 failed a step: OSError: [Errno 5] first"
    worker.remove()


@pytest.mark.parametrize("source", [pytest.param("StepLookup", marks=pytest.mark.needs_helper), "EmbeddingSource"])
def test_a_rank_with_others_to_tell_completes_a_failed_step_with_nan_values(served, monkeypatch, tmp_path, source):
    """Where a failed lookup raises at finish (EmbeddingSource, without the helper; StepLookup on the
    CPU), before the ranks' all-reduce: with other ranks (a record), the step's values are NaN
    instead, the error is kept and shared, and raised by the next check and start."""
    table = served
    if source == "EmbeddingSource":
        monkeypatch.setattr(gather, "_native", None)
    worker, other = (failures.SharedFailures("instance-9", rank, 2, folder=tmp_path) for rank in range(2))
    rows = PrefetchedRows(table, device="cpu", resident_bytes=0, max_tokens=4, heads=16,
                          failure_record=worker.own, holder="worker rank 0 of 2")
    assert type(rows.source).__name__ == source
    try:
        ids = torch.from_numpy(np.arange(32, dtype=np.int64).reshape(2, 16) + table.first_row)
        rows.start(ids)
        assert not torch.isnan(rows.finish().float()).any()
        ids[1, 3] = table.first_row + table.num_rows + 5
        rows.start(ids)
        values = rows.finish()
        assert values.shape == (2, 16 * table.values_per_row) and torch.isnan(values.float()).all()
        message = f"row id {table.first_row + table.num_rows + 5} is outside"
        with pytest.raises(IndexError, match=message):
            rows.check()
        with pytest.raises(IndexError, match=message):
            rows.start(ids)
        assert f"worker rank 0 of 2 failed a step: IndexError: {message}" in str(other.first_error())
    finally:
        rows.close()
        worker.remove()


@pytest.mark.parametrize("small_disk", ["4k"], indirect=True)
def test_a_full_shared_memory_is_an_error_at_construction_not_a_signal_at_the_first_write(small_disk):
    """/dev/shm full (a tmpfs of one page, filled): the records cannot be allocated, which is an
    OSError naming ENOSPC where they are made; a file only sized would be a SIGBUS at the first write.
    In a process of its own, so that a signal fails the test instead of ending the suite."""
    (small_disk / "filler").write_bytes(bytes(4096))
    code = ("import errno, sys\n"
            "from pathlib import Path\n"
            "from ple_prep.integrations.vllm.failures import SharedFailures\n"
            "try:\n"
            f"    shared = SharedFailures('instance-10', 1, 2, folder=Path({str(small_disk)!r}))\n"
            "    shared.own.describe(name='t.bin', holder='worker rank 1 of 2', capacity=16, read_timeout=30.0)\n"
            "except OSError as error:\n"
            "    sys.exit(7 if error.errno == errno.ENOSPC else 1)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, (result.returncode, result.stderr[-2000:])
