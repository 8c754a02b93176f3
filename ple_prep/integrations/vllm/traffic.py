"""Read-ahead and traffic recording fed from the requests vLLM schedules.

The seam: `GPUModelRunner._update_states(scheduler_output)` of vLLM 0.33.0
(vllm/v1/worker/gpu_model_runner.py), which every worker runs once per step before the model runs.
`install` wraps it (once, in each worker process, when vLLM imports that module: the plugin's
import hook in __init__.py) to call `on_schedule` first; nothing else of vLLM is changed, and with
no table configured nothing is registered and the wrapper only returns. It also raises there the
error of a lookup's failed step (`watch`), which FULL graph replays cannot raise. From the scheduler's
output it reads `scheduled_new_reqs` (each new request's `prompt_token_ids` and
`num_computed_tokens`, what a prefix-cache hit already holds), `num_scheduled_tokens` (the size of
the first chunk, which runs now) and `finished_req_ids`.

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
import weakref
from typing import Any

import numpy as np

from ...ngram import NgramSpec, row_ids
from ...runtime import TrafficRecorder

logger = logging.getLogger(__name__)


class _Served:
    """What this process serves: tables (with the slots their GPU tier holds) and a recorder."""

    def __init__(self) -> None:
        self.tables: list[tuple[Any, int]] = []
        self.spec: NgramSpec | None = None
        self.recorder: TrafficRecorder | None = None
        self.jobs: dict[str, list] = {}
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        # The storages' lookups, whose failed steps each schedule raises (`watch`).
        self.lookups: weakref.WeakSet = weakref.WeakSet()


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


def watch(rows) -> None:
    """Raise the error of a failed step of `rows` (PrefetchedRows) at the next schedule: a run of
    FULL CUDA graphs replays the lookup with no call of the plugin, which would otherwise raise it
    only at the next step that is not one. Raised there, it fails vLLM's step with the cause."""
    _SERVED.lookups.add(rows)


def on_schedule(scheduler_output: Any) -> None:
    """One step's schedule: raise a failed lookup's error; read ahead the new requests' later
    chunks; record; cancel finished ones."""
    served = _SERVED
    for rows in list(served.lookups):
        rows.check()
    if served.spec is None:
        return
    for request_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
        for job in served.jobs.pop(request_id, ()):
            if not job.done:
                job.cancel()
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
    for request in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        tokens = request.prompt_token_ids
        if not tokens:
            continue
        if served.recorder is not None:
            served.recorder.add_request(tokens)
        first = int(scheduled.get(request.req_id, 0))
        start = int(request.num_computed_tokens) + first
        if not served.tables or first <= 0 or start >= len(tokens):
            continue
        if served.worker is None:
            served.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-prep-read-ahead-feed")
        served.worker.submit(_read_ahead, request.req_id, np.asarray(tokens, dtype=np.int64), start, first)


def _read_ahead(request_id: str, tokens: np.ndarray, start: int, chunk_tokens: int) -> None:
    served = _SERVED
    try:
        ids = row_ids(tokens[start:], served.spec, context=tokens[max(0, start - served.spec.ngram_size + 1):start])
        chunks = [ids[k:k + chunk_tokens] for k in range(0, len(ids), chunk_tokens)]
        jobs = []
        for table, skip_slots in served.tables:
            low, high = table.row_range
            owned = [chunk[(chunk >= low) & (chunk < high)] for chunk in chunks]
            jobs.append(table.read_ahead(owned, skip_slots=skip_slots))
        served.jobs[request_id] = [job for job in jobs if job is not None]
    except Exception as error:  # noqa: BLE001 (read-ahead only speeds serving up; it never fails a request)
        logger.warning("ple-prep read-ahead for request %s failed: %s", request_id, error)


def install(module: Any) -> None:
    """Wrap `GPUModelRunner._update_states` of vLLM's runner module to call `on_schedule` first (once)."""
    runner = getattr(module, "GPUModelRunner", None)
    update = getattr(runner, "_update_states", None)
    if update is None or getattr(update, "ple_prep_feed", False):
        return

    def _update_states(self, scheduler_output, *args, **kwargs):
        on_schedule(scheduler_output)
        return update(self, scheduler_output, *args, **kwargs)

    _update_states.ple_prep_feed = True
    runner._update_states = _update_states
