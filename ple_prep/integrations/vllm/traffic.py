"""Read-ahead and traffic recording fed from the requests vLLM schedules, and failed lookups raised.

The seams, in each worker process (wrapped once, when vLLM imports their module: the plugin's import
hook in __init__.py; with no table configured nothing is registered and the wrappers only call
through; docs/SERVING.md, "Host cache and read-ahead"):
- the schedule: vLLM 0.33.0 runs one of two model runners, each reading a step's scheduler output
  before the model runs. `install` wraps `GPUModelRunner._update_states(scheduler_output)` of the
  V1 runner (vllm/v1/worker/gpu_model_runner.py) and `GPUModelRunner.execute_model` of the V2
  runner (vllm/v1/worker/gpu/model_runner.py, its default on CUDA) but for its dummy runs, to call
  `on_schedule` first. It raises there the error of a lookup's failed step (`watch`), which FULL
  graph replays cannot raise, and reads `scheduled_new_reqs` (each new request's
  `prompt_token_ids` and `num_computed_tokens`, what a prefix-cache hit already holds),
  `num_scheduled_tokens` (the size of the first chunk, which runs now) and `finished_req_ids`.
- a step's output: `install_output_check` wraps the worker's `execute_model` and `sample_tokens`
  (vllm/v1/worker/gpu_worker.py) so that a step's output is handed to the engine only after the
  failed lookups are raised (an asynchronous output when its tokens are on the host, so the GPU
  is past the step and its lookup was served): tokens sampled from a failed step's NaN values
  never reach a client. Where vLLM raises at a step whose logits hold NaN (VLLM_RAISE_ON_LOGIT_NANS),
  the error names a lookup failed on another host as their likely cause, which this host's
  records cannot show.

For a new request whose prompt needs more than its first chunk, the rest of the prompt is hashed
(the table's hash spec, which the plugin checked against the layer's constants) on a thread of
this module, cut into chunks of the first chunk's size, and handed to `Table.read_ahead` of each
table served in this process (each ETP rank's table keeps the ids in its row range; slots of the
GPU tier are left out). A request that finishes before its read-ahead does cancels it. With a
recorder configured, each new request's prompt is offered to it (`TrafficRecorder.add_request`,
which keeps a sample). docs/RUNTIME.md ("Host cache and read-ahead") says what this covers and
what it does not (decode tokens are not known ahead; under ETP spanning DP a worker sees only its
own DP rank's requests).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ...ngram import NgramSpec, row_ids
from ...runtime import TrafficRecorder
from .failures import FailedOnAnotherHost

logger = logging.getLogger(__name__)

# How vLLM 0.33.0's error for a step whose logits hold NaN begins (raise_if_nan_logits,
# vllm/v1/worker/utils.py; tests/vllm_plugin checks it against vLLM's own).
NAN_LOGITS = "NaNs detected in logits"

# The request ids of the steps vLLM 0.33.0 runs to warm its kernels up before serving (docs/SERVING.md,
# "Host cache and read-ahead"): no one's prompt, neither read ahead nor recorded.
WARMUP_REQUEST_PREFIXES = ("_warmup_", "_v2_mixed_warmup", "_step5_dsa_warmup", "_sparse_mla_v2_warmup")


class _Served:
    """What this process serves: tables (with the slots their GPU tier holds) and a recorder."""

    def __init__(self) -> None:
        self.tables: list[tuple[Any, int]] = []
        self.spec: NgramSpec | None = None
        self.recorder: TrafficRecorder | None = None
        self.jobs: dict[str, list] = {}
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        # The storages' lookups, whose failed steps each schedule raises (`watch`), and the records
        # of the instance's other workers (failures.py).
        self.lookups: weakref.WeakSet = weakref.WeakSet()
        self.shared: list = []
        self.unshared_unchecked = True  # the first schedule looks for workers that share no records
        # Requests whose read-ahead the feed thread has not stored yet (`_read_ahead`), and those
        # of them that finished meanwhile; the lock orders a finish and the store of its jobs.
        self.feeding: set[str] = set()
        self.finished: set[str] = set()
        self.jobs_lock = threading.Lock()


_SERVED = _Served()


def serve(table, skip_slots: int, settings, *, record: bool) -> None:
    """Feed `table` (its first `skip_slots` slots on the GPU) from the requests scheduled in this
    process, as `settings` ask (read_ahead, record_profile; `record`: this process records). Both
    lookups the storage uses (StepLookup's service thread, EmbeddingSource) read through the
    table's host cache, which read-ahead fills."""
    served = _SERVED
    served.spec = NgramSpec.from_json(table.manifest["ngram"])
    if settings.read_ahead and table.host_cache is not None:
        served.tables.append((table, skip_slots))
    if record and settings.record_profile and served.recorder is None:
        served.recorder = TrafficRecorder(served.spec, settings.record_profile, tokenizer_sha256=_tokenizer_sha256(),
                                          model=table.manifest.get("source", {}).get("model", "served"))
        atexit.register(served.recorder.close)


def _tokenizer_sha256() -> str | None:
    """sha256 of the served model's tokenizer.json, as `ple-prep profile` records it (so that
    `profile merge` takes this profile with the operator's), or None where there is no such file."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().model_config
    folder = getattr(config, "tokenizer", None) or getattr(config, "model", None)
    path = os.path.join(str(folder), "tokenizer.json") if folder else ""
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def watch(rows, shared=None) -> None:
    """Raise the error of a failed step of `rows` (PrefetchedRows) at the next schedule and before
    any later step's output is handed over: a run of FULL CUDA graphs replays the lookup with no
    call of the plugin, which would otherwise raise it only at the next step that is not one.
    `shared` (failures.SharedFailures): the same for the lookups of the instance's other workers."""
    _SERVED.lookups.add(rows)
    if shared is not None and shared not in _SERVED.shared:
        _SERVED.shared.append(shared)


def raise_failed_lookups() -> None:
    """Raise the error of a watched lookup's failed step (PrefetchedRows keeps raising it), then
    another worker's (a record keeps it)."""
    for rows in list(_SERVED.lookups):
        rows.check()
    for shared in _SERVED.shared:
        error = shared.first_error()
        if error is not None:
            raise error


def _warn_of_unshared_ranks() -> None:
    """Once, at the first schedule (every worker has built its lookups by then: vLLM's profile run
    and captures are collective): name the ranks whose failures this worker cannot read, and the
    variable that stops vLLM at a step their failure made NaN."""
    _SERVED.unshared_unchecked = False
    for shared, ranks in _ranks_on_other_hosts():
        if raises_on_nan_logits():
            logger.info("ple-prep: %s do not share this host's failure records (%s): a PLE lookup failed there "
                        "makes the step's logits NaN here, where vLLM raises it (VLLM_RAISE_ON_LOGIT_NANS)",
                        ranks, shared.path)
        else:
            logger.warning("ple-prep: %s do not share this host's failure records (%s): they run on another host "
                           "or behind another /dev/shm. A PLE lookup failed there is raised on its own host only, "
                           "and tokens of its failed step may reach clients from here: set "
                           "VLLM_RAISE_ON_LOGIT_NANS=1, and vLLM stops at such a step, whose logits are NaN "
                           "(docs/SERVING.md, \"vLLM\")", ranks, shared.path)


def _ranks_on_other_hosts():
    """(records, "worker ranks 2, 3 of 4") for each instance's records that some ranks never
    described themselves in: ranks on another host, or behind another /dev/shm."""
    for shared in _SERVED.shared:
        unseen = shared.unseen_ranks()
        if unseen:
            yield shared, f"worker ranks {', '.join(map(str, unseen))} of {len(shared.records)}"


def raises_on_nan_logits() -> bool:
    """Whether vLLM raises at a step whose logits hold NaN: VLLM_RAISE_ON_LOGIT_NANS, read as
    vllm/envs.py reads it (an integer, 0 when unset)."""
    try:
        return bool(int(os.environ.get("VLLM_RAISE_ON_LOGIT_NANS", "0")))
    except ValueError:
        return False


def _name_nan_logits(error: RuntimeError) -> None:
    """For vLLM's error at a step whose logits hold NaN (VLLM_RAISE_ON_LOGIT_NANS): raise a failed
    lookup's error if this host's records have one, else, where ranks on another host serve lookups
    whose failures no record here shows, an error naming them as the likely cause; otherwise return
    (the caller raises vLLM's error)."""
    if not str(error).startswith(NAN_LOGITS):
        return
    raise_failed_lookups()
    for _, ranks in _ranks_on_other_hosts():
        raise FailedOnAnotherHost(
            f"vLLM found NaN in this step's logits ({error}). {ranks.capitalize()} run on another host, whose "
            "failed PLE lookups this host's records do not show: a lookup failed there gives every rank NaN "
            "values, and that host's log names the cause") from error


def _naming_nan_logits(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, vLLM's error at NaN logits raised as `_name_nan_logits` names it."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as error:
        _name_nan_logits(error)
        raise


def on_schedule(scheduler_output: Any) -> None:
    """One step's schedule: raise a failed lookup's error; read ahead the new requests' later
    chunks; record; cancel finished ones."""
    served = _SERVED
    raise_failed_lookups()
    if served.unshared_unchecked:
        _warn_of_unshared_ranks()
    if served.spec is None:
        return
    for request_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
        with served.jobs_lock:
            if request_id in served.feeding:
                served.finished.add(request_id)
            jobs = served.jobs.pop(request_id, ())
        _cancel(jobs)
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
    for request in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        tokens = request.prompt_token_ids
        if not tokens or str(request.req_id).startswith(WARMUP_REQUEST_PREFIXES):
            continue
        if served.recorder is not None:
            served.recorder.add_request(tokens)
        first = int(scheduled.get(request.req_id, 0))
        start = int(request.num_computed_tokens) + first
        if not served.tables or first <= 0 or start >= len(tokens):
            continue
        if served.worker is None:
            served.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-prep-read-ahead-feed")
        served.feeding.add(request.req_id)  # before the feed thread can see it: no lock needed
        served.worker.submit(_read_ahead, request.req_id, np.asarray(tokens, dtype=np.int64), start, first)


def _read_ahead(request_id: str, tokens: np.ndarray, start: int, chunk_tokens: int) -> None:
    served = _SERVED
    jobs = []
    try:
        ids = row_ids(tokens[start:], served.spec, context=tokens[max(0, start - served.spec.ngram_size + 1):start])
        chunks = [ids[k:k + chunk_tokens] for k in range(0, len(ids), chunk_tokens)]
        for table, skip_slots in served.tables:
            if request_id in served.finished:  # it finished while this thread was busy before it
                break
            low, high = table.row_range
            owned = [chunk[(chunk >= low) & (chunk < high)] for chunk in chunks]
            job = table.read_ahead(owned, skip_slots=skip_slots)
            if job is not None:
                jobs.append(job)
    except Exception as error:  # noqa: BLE001 (read-ahead only speeds serving up; it never fails a request)
        logger.warning("ple-prep read-ahead for request %s failed: %s", request_id, error)
    finally:
        with served.jobs_lock:
            served.feeding.discard(request_id)
            finished = request_id in served.finished
            served.finished.discard(request_id)
            if not finished:
                served.jobs[request_id] = jobs
    if finished:  # it finished before its jobs were stored: nobody else cancels them
        _cancel(jobs)


def _cancel(jobs) -> None:
    for job in jobs:
        if not job.done:
            job.cancel()


def install(module: Any) -> None:
    """Make the `GPUModelRunner` of one of vLLM's runner modules call `on_schedule` first (once):
    the V1 runner's `_update_states`, else the V2 runner's `execute_model` but for dummy runs."""
    runner = getattr(module, "GPUModelRunner", None)
    if not _wrap_once(runner, "_update_states", _feeding_updates, "ple_prep_feed"):
        _wrap_once(runner, "execute_model", _feeding_steps, "ple_prep_feed")


def install_output_check(module: Any) -> None:
    """Make the `Worker` of vLLM's worker module hand a step's output over only after
    `raise_failed_lookups` (once): at once for an output already on the host, for an asynchronous
    one when its `get_output` has it."""
    worker = getattr(module, "Worker", None)
    for name in ("execute_model", "sample_tokens"):
        _wrap_once(worker, name, _checking_outputs, "ple_prep_checked")


def _wrap_once(owner: Any, name: str, wrapper_of, mark: str) -> bool:
    """Replace `owner.name` by `wrapper_of(owner.name)`, marked `mark`, unless it is marked already;
    whether `owner` has that method."""
    method = getattr(owner, name, None)
    if method is None:
        return False
    if not getattr(method, mark, False):
        wrapper = wrapper_of(method)
        setattr(wrapper, mark, True)
        setattr(owner, name, wrapper)
    return True


def _feeding_updates(update):
    def _update_states(self, scheduler_output, *args, **kwargs):
        on_schedule(scheduler_output)
        return update(self, scheduler_output, *args, **kwargs)

    return _update_states


def _feeding_steps(execute):
    def execute_model(self, scheduler_output, *args, dummy_run: bool = False, **kwargs):
        if not dummy_run:
            on_schedule(scheduler_output)
        return execute(self, scheduler_output, *args, dummy_run=dummy_run, **kwargs)

    return execute_model


def _checking_outputs(method):
    def checked(self, *args, **kwargs):
        output = _naming_nan_logits(method, self, *args, **kwargs)
        if output is None or not (_SERVED.lookups or _SERVED.shared):
            return output
        get_output = getattr(output, "get_output", None)
        if callable(get_output):  # an asynchronous output: its tokens are on the host once it returns
            def get_output_checked():
                result = _naming_nan_logits(get_output)
                raise_failed_lookups()
                return result

            output.get_output = get_output_checked
        elif hasattr(output, "sampled_token_ids"):  # a step's output, its tokens already on the host
            raise_failed_lookups()
        return output

    return checked
