"""One rank's n-gram PLE rows for vLLM's Qwen4Exp model, served from a prepared table.

No vLLM import here: this is what `storage.py` binds to vLLM's storage seam, and what
`bench/vllm_backend_gpu.py` drives on a GPU without vLLM. It checks that a table belongs to the
layer it is to serve, picks the resident budget, and splits a lookup in two: `start` when vLLM
starts its prefetch (before the decoder layer ahead of the PLE layer) and `finish` at the PLE layer.
Rows outside this rank's block come back as zeros, so the ranks' outputs sum to the full input as
the rows of vLLM's own ETP-sharded table do. An id outside the whole table (which the hash never
gives) fails its step on the first or last rank, as it does without tensor parallelism, where
vLLM's own table would read zeros for it.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ...core.errors import BadInput
from ...runtime import EmbeddingSource, FailureRecord, StepLookup, Table

# The table encodings that serve each of vLLM's PLE embedding methods, by the method's name.
METHOD_ENCODINGS = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4_packed", "unquantized": "bf16"}
# The residency hint used when the operator sets no budget: the runtime's figures are measured there.
DEFAULT_HINT = "5%"


class TableMismatch(BadInput):
    """The prepared table does not belong to the model layer vLLM built."""


def check_layer(table: Table, *, method: str, total_rows: int, values_per_row: int,
                owned: tuple[int, int], rank: int, size: int) -> None:
    """Refuse a table whose encoding, geometry or rank block differs from the layer's."""
    name = table.path.name
    expected = METHOD_ENCODINGS[method]
    if table.encoding != expected:
        raise TableMismatch(f"{name} holds {table.encoding} rows, but the checkpoint's PLE table is {method} "
                            f"({expected}): convert the checkpoint vLLM serves")
    if table.manifest["total_rows"] != total_rows or table.values_per_row != values_per_row:
        raise TableMismatch(f"{name} is a table of {table.manifest['total_rows']} rows of {table.values_per_row} "
                            f"values; the model's has {total_rows} rows of {values_per_row}")
    file_rank = table.tensor_parallel or {"rank": 0, "size": 1}
    if (file_rank["rank"], file_rank["size"]) != (rank, size) or table.row_range != tuple(owned):
        held = "the whole table" if table.tensor_parallel is None else \
            f"rank {file_rank['rank']} of {file_rank['size']}'s rows"
        fix = "serve the whole table (convert without --tp-size)" if size == 1 else \
            (f"convert with --tp-size {size} and name the rank files with {{rank}} and {{size}} in the table "
             "path (ple.tp{rank}of{size}.bin)")
        raise TableMismatch(f"{name} holds {held} {list(table.row_range)}; tensor-parallel rank {rank} of {size} "
                            f"serves rows {list(owned)}: {fix}")


def check_hash(table: Table, *, multipliers: Sequence[int], head_offsets: Sequence[int],
               head_sizes: Sequence[int]) -> None:
    """Refuse a table hashed with other constants than the layer's (its rows would be other rows)."""
    ngram = table.manifest["ngram"]
    differing = [key for key, layer in (("multipliers", multipliers), ("head_offsets", head_offsets),
                                        ("head_sizes", head_sizes))
                 if [int(v) for v in ngram[key]] != [int(v) for v in layer]]
    if differing:
        raise TableMismatch(f"{table.path.name} was made for other n-gram hash constants than the model's "
                            f"({', '.join(differing)} differ): convert the checkpoint vLLM serves")


def check_scale(table: Table, loaded: float | None) -> None:
    """Refuse rows served with another checkpoint's scale (FP8 scale, NVFP4 global scale)."""
    if loaded is None or table.scale is None:
        return
    if torch.tensor(table.scale, dtype=torch.float32).item() != loaded:
        raise TableMismatch(f"{table.path.name} was converted from a checkpoint with scale {table.scale!r}, "
                            f"the model loaded {loaded!r}: convert the checkpoint vLLM serves")


def default_resident_bytes(table: Table) -> int:
    """The bytes of the table's own residency hint for DEFAULT_HINT of it; 0 without hints."""
    for hint in table.manifest["residency"]:
        if hint["budget"] == DEFAULT_HINT:
            return hint["rows"] * table.row_bytes
    return 0


class _KeptFailure:
    """A PrefetchedRows' source's error, kept for every later `start` and `check`. The calls that may
    raise it run holding `lock`: the source hands an error out once, and a thread checking a step's
    output must not pass while the worker's thread is between taking it and keeping it (traffic.py).
    They take the lock in a try block, not a `with`: entering a `with` makes bound-method objects,
    which count towards Python's next garbage collection, and these calls run at every step. With a
    shared record (failures.py) the error is written there too, for the rank that hands the step's
    output over."""

    def __init__(self, record: FailureRecord | None):
        self.error: BaseException | None = None
        self.record = record
        self.lock = threading.Lock()

    def keep(self, error: Exception) -> None:
        self.error = error
        if self.record is not None:
            self.record.publish(error)


class PrefetchedRows:
    """bf16 PLE values for (tokens, heads) row ids: `start(ids)` early, `finish()` where they are used.

    vLLM computes the ids on the device. With the compiled helper both calls only queue work on the
    current stream (`StepLookup`: the device starts the lookup, a helper thread does the host work
    while decoder layer 0 runs, the device waits for its rows at the PLE layer), so they run the
    same way eagerly, in breakable piecewise graphs and in FULL graphs, and vLLM's host thread
    never waits for the device here. An error of a step (an id outside the table, an I/O error)
    makes that step's values NaN and is raised by the next `start` or `check` (or `finish` on the
    CPU); `pending_error` tells it before. An error the lookup raised is raised again by every
    later `start` and `check`: vLLM stops its engine at the first error of a step, and no step after
    the failed one may pass for served (traffic.py checks before handing a step's output over). Without the
    helper, `EmbeddingSource`'s split call serves eagerly.

    `failure_record`: where the first failure is kept for other processes (failures.py), described
    as `holder`'s (a rank). StepLookup's service thread writes a failed step there before it
    releases the step; other errors are written when they are raised. With a record, a `finish`
    that would raise gives the step NaN values instead.
    """

    def __init__(self, table: Table, *, device: str | torch.device, resident_bytes: int, max_tokens: int,
                 heads: int, failure_record: FailureRecord | None = None, holder: str = ""):
        self.table = table
        self.heads = heads
        if table.compiled:
            self.source = StepLookup(table, device=device, resident_bytes=resident_bytes, max_ids=max_tokens * heads,
                                     failure_record=failure_record)
        else:
            self.source = EmbeddingSource(table, device=device, resident_bytes=resident_bytes,
                                          max_ids=max_tokens * heads)
        if failure_record is not None:
            failure_record.describe(name=table.path.name, holder=holder, capacity=self.source.capacity,
                                    read_timeout=getattr(self.source, "read_timeout", 0.0))
        self.device = self.source.device
        first, stop = table.row_range
        total = table.manifest["total_rows"]
        # A rank's file holds its block only; other ids read a stand-in row that is then zeroed. The
        # first and last ranks' blocks are open at the table's ends: an id outside the table reaches
        # their lookup, which fails the step naming it.
        self._whole = (first, stop) == (0, total)
        int64 = torch.iinfo(torch.int64)
        self._owned_from = first if first > 0 else int64.min
        self._owned_to = stop if stop < total else int64.max
        self._started: int | None = None
        self._failure = _KeptFailure(failure_record)
        self._owned: torch.Tensor | None = None
        # The last finish's values shaped (tokens, heads * values): a view made again only when the
        # count changes (every decode step of a batch has the same; a view costs microseconds).
        self._shaped: torch.Tensor | None = None

    @property
    def graph_safe(self) -> bool:
        """Whether the calls only queue device work (the compiled helper's StepLookup): CUDA graphs can hold them."""
        return isinstance(self.source, StepLookup)

    def stats(self) -> dict[str, int]:
        """The lookup's counters since the start (StepLookup.stats); empty without the helper."""
        return self.source.stats() if self.graph_safe else {}

    def pending_error(self) -> BaseException | None:
        """The error of a failed step: the one `check` raises (StepLookup.pending_error)."""
        if self._failure.error is not None or not self.graph_safe:
            return self._failure.error
        return self.source.pending_error()

    def check(self) -> None:
        """Raise the error of a failed step (StepLookup.check), and from then on at every call;
        without the helper `finish` raises its errors itself."""
        failure = self._failure
        if failure.error is None and self.graph_safe:
            failure.lock.acquire()
            try:
                self.source.check()
            except Exception as error:
                failure.keep(error)
            finally:
                failure.lock.release()
        if failure.error is not None:
            raise failure.error

    def close(self) -> None:
        self.source.close()

    @property
    def resident_bytes(self) -> int:
        return self.source.num_resident * self.table.row_bytes

    def start(self, ids: torch.Tensor, *, finish_in_same_graph: bool = False) -> None:
        """Begin the lookup of `ids` (int64 (tokens, heads), on the device); returns at once.
        `finish_in_same_graph`: during a capture, the finish is captured in the same CUDA graph (a
        FULL graph: StepLookup.start).

        A start that was never finished (its forward pass failed before the PLE layer) is dropped.
        """
        self.source.drop()
        if self._failure.error is not None:
            raise self._failure.error
        count = ids.numel()
        if count > self.source.capacity:
            raise ValueError(f"{count // self.heads} tokens exceed the {self.source.capacity // self.heads} "
                             "this PLE storage was sized for")
        if not self._whole:
            owned = (ids >= self._owned_from) & (ids < self._owned_to)
            self._owned = owned.view(-1, self.heads, 1)
            ids = ids.where(owned, self.table.row_range[0])
        # The source reads the ids in row-major order, any shape; its check takes a failed step's
        # error (as `check`).
        failure = self._failure
        failure.lock.acquire()
        try:
            if self.graph_safe:
                self.source.start(ids, finish_in_same_graph=finish_in_same_graph)
            else:
                self.source.start(ids)
        except Exception as error:
            failure.keep(error)
            raise
        finally:
            failure.lock.release()
        self._started = count

    def finish(self) -> torch.Tensor:
        """bf16 (tokens, heads * values_per_row) of the last start; valid until the next finish.
        Errors of the lookup (ids outside the table, I/O) are raised here."""
        if self._started is None:
            raise RuntimeError("the PLE lookup was finished without a start")
        count, self._started = self._started, None
        failure = self._failure
        failure.lock.acquire()
        try:
            values = self.source.finish()
        except Exception as error:
            failure.keep(error)
            if failure.record is None:
                raise
            values = None
        finally:
            failure.lock.release()
        if values is None:
            # A lookup that raises here (EmbeddingSource; StepLookup on the CPU) would do it before the
            # ranks' all-reduce, where the other ranks wait for this one until vLLM's timeout. With
            # other ranks to tell (failures.py) the step completes with NaN values, as StepLookup's
            # failed steps on a GPU do, and the error, kept and shared, is raised before any output
            # is handed over.
            values = self.source.output[:count].fill_(float("nan"))
        if self._shaped is None or len(self._shaped) * self.heads != count:
            self._shaped = values.view(count // self.heads, -1)
        values = self._shaped
        if not self._whole:
            values.view(count // self.heads, self.heads, -1).masked_fill_(~self._owned, 0)
        return values
