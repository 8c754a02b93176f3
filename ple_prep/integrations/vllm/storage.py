"""The vLLM side: a storage class for Qwen4Exp's n-gram embedding that reads a prepared table.

vLLM 0.33.0 builds the storage of `Qwen4ExpNGramEmbedding.ngram_embedding` from one of two class
names in `vllm/models/qwen4_exp/nvidia/ngram_embedding.py` (pinned host or device table). `install`
replaces both names there with `select_storage`, which builds vLLM's own class when no table is
configured and `PreparedTableEmbedding` when one is (docs/SERVING.md, "vLLM"). Nothing else of vLLM
is changed. The table is never allocated: the weights are zero-row tensors and the checkpoint's shard
rows, which vLLM's loader still hands over, are checked for shape and dtype and dropped.
"""
from __future__ import annotations

import os
import weakref
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import (
    eager_break_during_capture,
    is_breakable_cudagraph_enabled,
)
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.distributed.parallel_state import get_world_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
    Qwen4ExpPLEUnquantizedEmbeddingMethod,
)

from ...core.errors import BadInput
from ...runtime import compiled_helper_missing, open_table
from . import traffic
from .backend import (
    PrefetchedRows,
    TableMismatch,
    check_hash,
    check_layer,
    check_scale,
    default_resident_bytes,
)
from .failures import shared_failures
from .observe import StatsLog
from .settings import Settings, read_settings

logger = init_logger(__name__)

# An instance id's bytes as the first rank broadcasts it (vLLM's: nanoseconds, or a short uuid, and a suffix).
_INSTANCE_ID_BYTES = 64
# The class names vLLM picks its storage from, in the module that picks.
STORAGE_NAMES = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")
_METHOD_NAMES = ((Qwen4ExpPLEFp8EmbeddingMethod, "fp8"), (Qwen4ExpPLENvFp4EmbeddingMethod, "nvfp4"),
                 (Qwen4ExpPLEUnquantizedEmbeddingMethod, "unquantized"))
# The layer's hash constants, as buffers of Qwen4ExpNGramEmbedding, under the manifest's names.
_HASH_BUFFERS = (("layer_multipliers", "multipliers"), ("ngram_heads_offsets", "head_offsets"),
                 ("ngram_heads_vocab_sizes", "head_sizes"))


def configured_settings() -> Settings | None:
    return read_settings(get_current_vllm_config().additional_config, os.environ)


def check_cudagraph_mode(graph_safe: bool) -> None:
    """Refuse only the graph modes the lookup cannot serve. With the compiled helper it queues device
    work only (backend.PrefetchedRows), so eager, breakable piecewise and FULL graphs all hold it."""
    config = get_current_vllm_config()
    if config.model_config is not None and config.model_config.enforce_eager:
        return
    mode = config.compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if not is_breakable_cudagraph_enabled():
        raise BadInput("ple-prep's PLE lookup is not written for torch.compile's graphs, which vLLM uses for "
                       f"cudagraph_mode={mode.name} when VLLM_USE_BREAKABLE_CUDAGRAPH=0: unset "
                       "VLLM_USE_BREAKABLE_CUDAGRAPH or set it to 1, or start vLLM with --enforce-eager")
    if not graph_safe and mode.has_full_cudagraphs():
        raise BadInput(f"ple-prep serves FULL CUDA graphs (cudagraph_mode={mode.name}) through its compiled helper, "
                       "which is not built in this environment (no C compiler when ple-prep was installed): "
                       "reinstall ple-prep where a C compiler is present, or start vLLM with "
                       "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager")


def load_format() -> str:
    config = get_current_vllm_config().load_config
    return str(getattr(config, "load_format", "auto") or "auto")


def check_load_format() -> None:
    """Refuse a load format that loads vLLM's own saved weights, the PLE table's among them, which this
    storage does not hold (its weight has no rows)."""
    if load_format() == "sharded_state":
        raise BadInput("ple-prep serves the PLE table from its prepared file, and --load-format sharded_state "
                       "loads a state vLLM saved with the PLE table in it: load the checkpoint (--load-format auto), "
                       "or unset PLE_PREP_TABLE and additional_config['ple_prep']")


def _worker_records():
    """This worker's failure records shared with the instance's other workers (failures.py) and the
    worker's name in them; (None, name) for a single process, which has no one to tell."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None, "the worker"
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    holder = f"worker rank {rank} of {size}"
    if size == 1:
        return None, holder
    try:
        return shared_failures(_world_instance_id(), rank, size), holder
    except OSError as error:  # serving goes on; only other ranks' failures are no longer raised here
        logger.warning("ple-prep: failed PLE lookups cannot be shared with the other workers (%s): a lookup "
                       "failed on another rank is raised on that rank only", error)
        return None, holder


def _world_instance_id() -> str:
    """The id every worker of this world names the instance's failure records by: the first rank's,
    broadcast over the world's CPU group (every rank builds this layer, so every rank takes part).
    Each rank's own config does not always carry the same one: vLLM's Ray launcher gives each
    data-parallel replica an id of its own, and under torchrun (`external_launcher`) each process
    makes its config, and its id, itself."""
    world = get_world_group()
    word = torch.zeros(_INSTANCE_ID_BYTES, dtype=torch.uint8)
    if world.rank_in_group == 0:
        own = get_current_vllm_config().instance_id.encode()[:_INSTANCE_ID_BYTES]
        word[:len(own)] = torch.tensor(list(own), dtype=torch.uint8)
    torch.distributed.broadcast(word, src=world.ranks[0], group=world.cpu_group)
    return bytes(word.numpy()).rstrip(b"\0").decode("utf-8", "replace")


def in_full_graph() -> bool:
    """Whether vLLM runs this forward as FULL CUDA graphs: one graph from the start of the PLE lookup
    to its finish (vLLM's breakable graphs break only in piecewise mode, docs/SERVING.md)."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


class _CheckedAfterLoading(QuantizeMethodBase):
    """The layer's own method, then the checks that need the loaded scale and hash constants."""

    def __init__(self, method: Qwen4ExpPLEEmbeddingMethod):
        super().__init__()
        self.method = method
        self.requires_device_loading = False

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the PLE weights are created once, by the layer's own method")

    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("PLE weights only support embedding lookup")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.method.process_weights_after_loading(layer)
        layer.check_loaded()


class PreparedTableEmbedding(Qwen4ExpPLEEmbedding):
    """One ETP rank's PLE rows from a prepared table: resident rows on the device, the rest from the file."""

    supports_prefetch: ClassVar[bool] = True

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype,
                 padding_size: int, prefix: str, embedding_method: Qwen4ExpPLEEmbeddingMethod,
                 num_ngram_heads: int = 1, max_total_tokens: int = 0, data_parallel_rank: int = 0,
                 reduce_results: bool = True, settings: Settings):
        if params_dtype != torch.bfloat16:
            raise BadInput(f"ple-prep serves bf16 PLE values; the model runs in {params_dtype}: "
                           "start vLLM with --dtype bfloat16")
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, padding_size=padding_size,
                         prefix=prefix, embedding_method=embedding_method, num_ngram_heads=num_ngram_heads,
                         max_total_tokens=max_total_tokens, data_parallel_rank=data_parallel_rank,
                         reduce_results=reduce_results)
        method = next((name for kind, name in _METHOD_NAMES if isinstance(embedding_method, kind)), None)
        if method is None:
            raise BadInput(f"ple-prep cannot serve a PLE table of method {type(embedding_method).__name__}")
        # The table's host cache (PLE_PREP_HOST_CACHE_BYTES, open_table's default budget) serves the
        # lookup's disk-tier rows, StepLookup's service thread included, and read-ahead fills it.
        path = settings.table_path(self.tp_rank, self.tp_size)
        try:
            table = open_table(path, **settings.open_options())
        except BadInput as error:
            raise settings.refused_table(self.tp_rank, self.tp_size, error) from None
        try:
            owned = (self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index)
            check_layer(table, method=method, total_rows=self.org_vocab_size, values_per_row=embedding_dim,
                        owned=owned, rank=self.tp_rank, size=self.tp_size)
            budget = settings.resident_bytes
            if budget is None:
                budget = default_resident_bytes(table)
            # vLLM builds the model under its target device, the device of a new tensor.
            device = torch.empty(0).device
            if not table.compiled:
                logger.warning("ple-prep's compiled helper is not built: the PLE lookup runs in Python, about 15x "
                               "slower, and FULL CUDA graphs are refused; reinstall ple-prep where a C compiler "
                               "is present")
            check_cudagraph_mode(graph_safe=table.compiled)
            check_load_format()
            shared, holder = _worker_records()
            self.rows = PrefetchedRows(table, device=device, resident_bytes=budget,
                                       max_tokens=max_total_tokens * self.etp_data_parallel_size,
                                       heads=num_ngram_heads, failure_record=shared and shared.own,
                                       holder=f"{holder} (ETP rank {self.tp_rank} of {self.tp_size})")
        except BaseException:
            table.close()
            raise
        self.table = table
        # Read-ahead and recording fed from the schedule (traffic.py); one process records a replica's traffic.
        traffic.serve(table, self.rows.source.num_resident, settings,
                      record=self.tp_rank == 0 and data_parallel_rank == 0)
        traffic.watch(self.rows, shared)
        self.quant_method = _CheckedAfterLoading(embedding_method)
        self._output_dim = num_ngram_heads * embedding_dim
        self._shard_rows_dropped = 0
        self._owner: weakref.ref[nn.Module] | None = None
        self._watch_registration()
        self.stats_log = StatsLog(prefix, self.rows, settings.stats_seconds)
        logger.info("PLE rows of %s from %s (ETP rank %d of %d): %.2f GiB resident on %s, the rest from the file "
                    "(read path %s%s)", prefix, table.path, self.tp_rank, self.tp_size,
                    self.rows.resident_bytes / 2**30, device, table.read_path,
                    f": {table.read_path_note}" if table.read_path_note else "")
        if compiled_helper_missing() is not None:
            logger.warning("ple-prep: %s", compiled_helper_missing())

    def _watch_registration(self) -> None:
        """Find the Qwen4ExpNGramEmbedding that holds this storage: its buffers are the hash to check."""
        def registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
            if submodule is self:
                handle.remove()
                self._owner = weakref.ref(module)
                self._check_hash()

        handle = torch.nn.modules.module.register_module_module_registration_hook(registered)

    def _check_hash(self) -> None:
        owner = self._owner and self._owner()
        if owner is None:
            raise RuntimeError("the PLE storage was not registered under its n-gram embedding module")
        constants = {key: getattr(owner, buffer).tolist() for buffer, key in _HASH_BUFFERS}
        check_hash(self.table, **constants)

    def check_loaded(self) -> None:
        """After loading: the checkpoint's hash constants and scale are the ones the table was made from."""
        self._check_hash()
        scale = getattr(self, "weight_scale_2", None)
        if scale is None and isinstance(self.embedding_method, Qwen4ExpPLEFp8EmbeddingMethod):
            scale = self.weight_scale
        if load_format() == "dummy":  # random weights, the scale among them: the table's values are real
            logger.warning("ple-prep: --load-format dummy gives the model random weights; the PLE values come "
                           "from %s all the same", self.table.path)
        else:
            check_scale(self.table, None if scale is None else float(scale.reshape(-1)[0]))
        logger.info("PLE storage: %d checkpoint rows dropped at load; %s serves them",
                    self._shard_rows_dropped, self.table.path)

    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int,
                                  dtype: torch.dtype) -> torch.Tensor:
        """Zero rows: the prepared table holds them. The width and dtype stay for vLLM's shape checks."""
        return torch.empty(0, embedding_dim, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      checkpoint_start: int | None = None) -> None:
        if checkpoint_start is None:
            super().weight_loader(param, loaded_weight)
            return
        # A shard of the checkpoint's table (its shape already checked by the model): dropped unread.
        if loaded_weight.dtype != param.dtype:
            raise TableMismatch(f"the checkpoint's PLE shard at row {checkpoint_start} is {loaded_weight.dtype}, "
                                f"its method stores {param.dtype}: the model config does not match the checkpoint")
        if param is self.weight:
            self._shard_rows_dropped += loaded_weight.shape[0]

    def dequantize(self, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        # The table's values are already what the layer's method would decode.
        return embeddings.to(output_dtype)

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Begin the lookup of this step's ids (all DP ranks' under ETP spanning DP)."""
        if self.rows.graph_safe:
            self._start_prefetch(ngram_ids)
        else:
            self._start_prefetch_eagerly(ngram_ids)

    def _start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        slot_size, _ = self._get_dp_gather_slot(ngram_ids.shape[0])
        self.rows.start(self._gather_dp_ids(ngram_ids, slot_size), finish_in_same_graph=in_full_graph())

    def _finalize_prefetch(self, output: torch.Tensor) -> None:
        """Finish the lookup, combine the ETP ranks' rows and keep this DP rank's, into `output`."""
        values = self.rows.finish()
        slot_size, slot_offset = self._get_dp_gather_slot(output.shape[0])
        values = values[: slot_size * self.etp_data_parallel_size]
        if self.reduce_results and self.tp_size > 1:
            # Each row has one owning rank and zeros elsewhere, so summing the bits as integers is exact
            # (a float sum would turn -0.0 into 0.0). int32: a type every backend sums; rows hold pairs.
            values = self.parallel_group.all_reduce(values.view(torch.int32)).view(torch.bfloat16)
        elif not self.reduce_results:
            # The model's outer TP reduce-scatter combines the ranks (it requires ETP = TP).
            assert self.etp_data_parallel_size == 1
        output.copy_(self._select_embeddings(values, output.shape[0], slot_offset))

    # Without the compiled helper the lookup runs host code each step: in breakable piecewise graphs
    # it runs as an eager break, every replay (FULL graphs are refused at construction).
    _start_prefetch_eagerly = eager_break_during_capture(_start_prefetch)
    _finalize_prefetch_eagerly = eager_break_during_capture(_finalize_prefetch)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """bf16 (total_tokens, heads * 160): the PLE layer's input for this DP rank's tokens."""
        output = torch.empty((total_tokens, self._output_dim), dtype=torch.bfloat16, device=self.rows.device)
        if self.rows.graph_safe:
            self._finalize_prefetch(output)
        else:
            self._finalize_prefetch_eagerly(output)
        return output

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the prepared-table PLE storage is read through start_prefetch and finalize_prefetch")


def select_storage(original: type) -> Any:
    """What the model calls in place of `original`: that class, or the prepared table when configured."""
    def build(*args: Any, **kwargs: Any) -> nn.Module:
        settings = configured_settings()
        if settings is None:
            return original(*args, **kwargs)
        return PreparedTableEmbedding(*args, settings=settings, **kwargs)

    build.original = original
    return build


def refuse_storage(original: type) -> Any:
    """For vLLM's ROCm copy of the model, which reads the table through other calls: refuse a configured table."""
    def build(*args: Any, **kwargs: Any) -> nn.Module:
        if configured_settings() is not None:
            raise BadInput("ple-prep's vLLM plugin serves the NVIDIA (CUDA) Qwen4Exp model only: "
                           "unset PLE_PREP_TABLE and additional_config['ple_prep'] on ROCm")
        return original(*args, **kwargs)

    build.original = original
    return build


def install(module: ModuleType, wrap: Any) -> None:
    """Swap the storage class names in the module of vLLM that picks the storage for `wrap` of them (once)."""
    for name in STORAGE_NAMES:
        current = getattr(module, name)
        if not hasattr(current, "original"):
            setattr(module, name, wrap(current))
