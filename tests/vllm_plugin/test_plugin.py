"""The plugin inside vLLM 0.33.0's real Qwen4Exp n-gram embedding, against vLLM's own device table."""
from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.models.qwen4_exp")

import torch
from support.table_copies import cold_copy, copy_table
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm_layer import (
    build_layer,
    checkpoint_weights,
    loader_weights,
    ple_input,
    schedule,
    text_config,
    vllm_config,
)
from worker import free_port

from ple_prep.core.errors import BadInput
from ple_prep.integrations.vllm import storage
from ple_prep.integrations.vllm.backend import TableMismatch
from ple_prep.integrations.vllm.failures import records_folder
from ple_prep.integrations.vllm.loader import PreparedTableLoader


@pytest.fixture(scope="module")
def checkpoints(fp8_checkpoint, nvfp4_checkpoint, bf16_checkpoint):
    return {"fp8": fp8_checkpoint, "nvfp4": nvfp4_checkpoint, "bf16": bf16_checkpoint}


@pytest.fixture(scope="module")
def tables(checkpoints, fp8_table, converted_table, tmp_path_factory):
    """Each fixture converted with ple-prep's writer (source order)."""
    folder = tmp_path_factory.mktemp("vllm-tables")
    converted = {variant: converted_table(checkpoints[variant], folder / f"{variant}.bin").path
                 for variant in ("nvfp4", "bf16")}
    return {variant: str(path) for variant, path in ({"fp8": fp8_table} | converted).items()}


@pytest.mark.parametrize("variant, resident", [("fp8", "0"), ("fp8", "1MiB"), ("nvfp4", "512KiB"),
                                               ("bf16", "2MiB")])
def test_plugin_output_equals_vllm_device_table_bit_for_bit(checkpoints, tables, variant, resident):
    text = text_config(variant)
    reference = build_layer(vllm_config(), text, checkpoint_weights(checkpoints[variant]))
    served = build_layer(vllm_config(tables[variant], resident_bytes=resident), text,
                         checkpoint_weights(checkpoints[variant]))
    assert type(reference.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    assert type(served.ngram_embedding).__name__ == "PreparedTableEmbedding"
    if resident != "0":
        assert 0 < served.ngram_embedding.rows.source.num_resident < served.ngram_embedding.table.num_rows
    for tokens, query_start_loc, ngram_context in schedule():
        expected = ple_input(reference, tokens, query_start_loc, ngram_context)
        got = ple_input(served, tokens, query_start_loc, ngram_context)
        assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == (len(tokens), 2560)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("variant", ["fp8", "nvfp4", "bf16"])
def test_vllms_default_loader_hands_the_served_shards_unread_and_the_output_is_unchanged(checkpoints, tables,
                                                                                        variant):
    """With the plugin serving the layer, vLLM's default load format reads no PLE shard (meta tensors of
    the header's shape and dtype) yet the scale and hash checks run; without it, every tensor is read."""
    text = text_config(variant)
    reference = build_layer(vllm_config(), text, loader_weights(checkpoints[variant]))
    served = build_layer(vllm_config(tables[variant]), text, loader_weights(checkpoints[variant]))
    assert type(reference.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    assert served.ngram_embedding._shard_rows_dropped == served.ngram_embedding.table.num_rows
    for step in schedule():
        expected = ple_input(reference, *step)
        assert torch.equal(ple_input(served, *step).view(torch.int16), expected.view(torch.int16))
    handed = dict(loader_weights(checkpoints[variant])(served))
    shards = {name for name in handed if ".shard_" in name and not name.endswith("weight_scale_2")}
    assert shards and all(handed[name].is_meta for name in shards)
    assert not any(tensor.is_meta for name, tensor in handed.items() if name not in shards)
    assert not any(tensor.is_meta for _, tensor in loader_weights(checkpoints[variant])(reference))


def test_the_plugins_loader_is_vllms_for_its_default_load_formats():
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    for load_format in ("auto", "safetensors"):
        assert type(get_model_loader(LoadConfig(load_format=load_format))) is PreparedTableLoader


def test_other_load_strategies_read_the_shards_as_vllm_does_and_the_log_names_the_option(checkpoints, tables,
                                                                                        caplog):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    served = build_layer(vllm_config(tables["fp8"]), text_config("fp8"), None)
    loader = get_model_loader(LoadConfig(load_format="auto", safetensors_load_strategy="eager"))
    model_config = types.SimpleNamespace(model=str(checkpoints["fp8"]), revision=None)
    with caplog.at_level("WARNING"):
        assert not any(tensor.is_meta for _, tensor in loader.get_all_weights(model_config, served))
    assert "load options (safetensors strategy eager) read whole checkpoint files" in caplog.text


def test_tensor_parallel_ranks_serve_their_own_files_and_sum_to_the_whole_input(checkpoints, fp8_rank_tables,
                                                                                tmp_path):
    """Two ranks (two processes, gloo), each with its `--tp-size 2` file: their all-reduced output is
    vLLM's single-rank device-table output, bit for bit."""
    port = free_port()
    script = Path(__file__).with_name("tp_rank.py")
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port),
                               str(fp8_rank_tables / "ple.tp{rank}of{size}.bin"), str(checkpoints["fp8"]), "fp8",
                               str(tmp_path / f"rank{rank}.npz")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    for process in ranks:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output.decode()[-3000:]
    reference = build_layer(vllm_config(), text_config("fp8"), checkpoint_weights(checkpoints["fp8"]))
    outputs = [np.load(tmp_path / f"rank{rank}.npz", allow_pickle=False) for rank in range(2)]
    for index, step in enumerate(schedule()):
        expected = ple_input(reference, *step).view(torch.int16).numpy()
        for output in outputs:
            np.testing.assert_array_equal(output[f"arr_{index}"], expected)


@pytest.mark.parametrize("ids", ["shared", "each", "hosts"])
def test_a_lookup_failed_on_another_rank_is_raised_where_the_output_is_handed_over(checkpoints, fp8_rank_tables,
                                                                                   tmp_path, ids):
    """vLLM takes a step's output from one rank and only logs another's exception: a lookup failed on
    rank 1 (its file shrank) gives that step NaN values on both ranks, the all-reduce never waiting,
    and is raised on rank 0 too, naming rank 1 and the cause; the file the ranks shared is gone once
    they exit. Where each rank's config has an instance id of its own (vLLM's Ray launcher gives each
    data-parallel replica one; under torchrun each process makes its own), the ranks still share one file.
    Where they share none (two hosts), rank 0's records show nothing, and the error vLLM raises at the
    step's NaN logits (VLLM_RAISE_ON_LOGIT_NANS) names rank 1 on another host as the likely cause."""
    for name in os.listdir(fp8_rank_tables):
        shutil.copy(fp8_rank_tables / name, tmp_path / name)
    port, instance = free_port(), f"failed-rank-test-{os.getpid()}"
    script = Path(__file__).with_name("failed_rank.py")
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port),
                               str(tmp_path / "ple.tp{rank}of{size}.bin"), str(checkpoints["fp8"]), instance,
                               ids, str(tmp_path / "records")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in ranks]
    for process, output in zip(ranks, outputs):
        assert process.returncode == 0, output[-3000:]
    for rank in range(2):
        assert f"rank {rank} step: NaN values True" in outputs[rank], outputs[rank][-3000:]
    cause = re.search(r"rank 1 check: (OSError: .*ple\.tp1of2\.bin.*)", outputs[1]).group(1)
    assert f"rank 1 logits check: {cause}" in outputs[1], outputs[1][-3000:]
    if ids == "hosts":
        assert "rank 0 check: nothing raised" in outputs[0], outputs[0][-3000:]
        assert re.search(r"rank 0 logits check: FailedOnAnotherHost: vLLM found NaN in this step's logits \(NaNs "
                         r"detected in logits: \{'request-0': \d+.*\}\)\. Worker ranks 1 of 2 run on another "
                         r"host, whose failed PLE lookups this host's records do not show", outputs[0]), outputs[0]
        assert set((tmp_path / "records").rglob("*")) == {tmp_path / "records" / f"rank{k}" for k in range(2)}
    else:
        failed = (f"FailedOnAnotherRank: the PLE lookup of worker rank 1 of 2 (ETP rank 1 of 2) failed a step: "
                  f"{cause}")
        assert f"rank 0 check: {failed}" in outputs[0] and f"rank 0 logits check: {failed}" in outputs[0], \
            outputs[0][-3000:]
    assert not list(records_folder().glob(f"ple-prep-failures-*-{instance}*"))


@pytest.mark.parametrize("value", [None, "0", "1", "2"])
def test_the_plugin_reads_vllms_raise_on_nan_logits_as_vllm_does(monkeypatch, value):
    import vllm.envs

    from ple_prep.integrations.vllm import traffic

    if value is None:
        monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)
    else:
        monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", value)
    assert traffic.raises_on_nan_logits() is vllm.envs.VLLM_RAISE_ON_LOGIT_NANS


def test_plugin_never_allocates_the_table_and_drops_the_checkpoint_rows(checkpoints, tables):
    served = build_layer(vllm_config(tables["nvfp4"]), text_config("nvfp4"), checkpoint_weights(checkpoints["nvfp4"]))
    storage = served.ngram_embedding
    assert storage.weight.shape == (0, 80) and storage.weight_scale.shape == (0, 10)
    assert storage._shard_rows_dropped == storage.table.num_rows == 16_896


def test_the_entry_point_patches_vllms_module_when_vllm_imports_it():
    """In a worker the plugin loads before any model module: the swap happens at that import."""
    code = ("import sys\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "assert 'vllm.models.qwen4_exp.nvidia.ngram_embedding' not in sys.modules\n"
            "import vllm.models.qwen4_exp.nvidia.ngram_embedding as chooser\n"
            "from vllm.models.qwen4_exp.common import ngram_embedding as classes\n"
            "assert chooser.Qwen4ExpPLEPinnedHostEmbedding.original is classes.Qwen4ExpPLEPinnedHostEmbedding\n"
            "assert chooser.Qwen4ExpPLEDeviceEmbedding.original is classes.Qwen4ExpPLEDeviceEmbedding\n")
    passes_in_a_fresh_process(code)


def test_the_entry_point_feeds_both_model_runners_and_checks_the_workers_outputs():
    """vLLM 0.33.0 runs the V2 runner by default on CUDA and the V1 runner elsewhere: the schedule
    of each reaches the plugin, and the worker hands no step's output over unchecked."""
    code = ("from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.v1.worker import gpu_model_runner, gpu_worker\n"
            "from vllm.v1.worker.gpu import model_runner\n"
            "assert gpu_model_runner.GPUModelRunner._update_states.ple_prep_feed\n"
            "assert model_runner.GPUModelRunner.execute_model.ple_prep_feed\n"
            "assert gpu_worker.Worker.execute_model.ple_prep_checked\n"
            "assert gpu_worker.Worker.sample_tokens.ple_prep_checked\n")
    passes_in_a_fresh_process(code)


def passes_in_a_fresh_process(code: str) -> None:
    """Run `code` in a new interpreter, where the plugin loads as in a vLLM worker."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_table_open_table_refuses_is_named_by_its_setting(tables, tmp_path):
    shutil.copy(tables["fp8"], tmp_path / "t.bin")  # no manifest beside it
    with pytest.raises(BadInput, match=rf"^additional_config\['ple_prep'\]\['table'\]=\"{tmp_path}/t.bin\": manifest "
                                       r".*not found"):
        build_layer(vllm_config(str(tmp_path / "t.bin")), text_config("fp8"), None)
    with pytest.raises(BadInput, match=r"pagesums is missing.*\(opened with additional_config\['ple_prep'\]"
                                       r"\['verify_reads'\]\)$"):
        build_layer(vllm_config(tables["fp8"], verify_reads=True), text_config("fp8"), None)


def test_without_a_table_vllm_builds_its_own_storage(monkeypatch):
    monkeypatch.delenv("PLE_PREP_TABLE", raising=False)
    layer = build_layer(vllm_config(), text_config("fp8"), None)
    assert type(layer.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    assert layer.ngram_embedding.weight.shape == (16_896, 160)


def test_the_environment_variables_select_the_table_budget_and_read_path(monkeypatch, tables, caplog):
    monkeypatch.setenv("PLE_PREP_TABLE", tables["fp8"])
    monkeypatch.setenv("PLE_PREP_RESIDENT_BYTES", "160K")
    monkeypatch.setenv("PLE_PREP_READ_PATH", "mapped")
    with caplog.at_level("INFO"):
        layer = build_layer(vllm_config(), text_config("fp8"), None)
    assert type(layer.ngram_embedding).__name__ == "PreparedTableEmbedding"
    assert layer.ngram_embedding.rows.source.num_resident == 1024
    assert layer.ngram_embedding.table.read_path == "mapped"
    assert "the rest from the file (read path mapped)" in caplog.text  # the log names the path taken


def test_refuses_a_table_of_another_encoding(tables):
    with pytest.raises(TableMismatch, match=r"fp8_e4m3 rows, but the checkpoint's PLE table is nvfp4"):
        build_layer(vllm_config(tables["fp8"]), text_config("nvfp4"), None)


def test_refuses_a_table_of_another_row_count(tables):
    with pytest.raises(TableMismatch, match=r"table of 16896 rows of 160 values; the model's has \d+ rows"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8", ngram_vocab_size_base=1200), None)


def test_refuses_other_hash_constants_at_construction(tables):
    with pytest.raises(TableMismatch, match=r"other n-gram hash constants than the model's \(multipliers differ\)"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8", seed=99), None)


def test_refuses_other_hash_constants_loaded_from_the_checkpoint(checkpoints, tables):
    other = {"ngram_heads_offsets": torch.arange(16, dtype=torch.int64) * 1000}
    with pytest.raises(TableMismatch, match=r"\(head_offsets differ\)"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8"), checkpoint_weights(checkpoints["fp8"], other))


def test_dummy_weights_leave_the_scale_unchecked_and_the_table_served(checkpoints, tables, caplog):
    """--load-format dummy fills every weight, the scale among them, with random values: the table's
    rows are still real, so it is served, with a warning, instead of refused for another scale."""
    config = vllm_config(tables["fp8"])
    config.load_config.load_format = "dummy"
    other = {"ngram_embedding.weight_scale": torch.tensor([3e-4], dtype=torch.bfloat16)}
    with caplog.at_level("WARNING"):
        layer = build_layer(config, text_config("fp8"), checkpoint_weights(checkpoints["fp8"], other))
    assert "--load-format dummy" in caplog.text
    reference = build_layer(vllm_config(), text_config("fp8"), checkpoint_weights(checkpoints["fp8"]))
    step = next(iter(schedule()))
    assert torch.equal(ple_input(layer, *step).view(torch.int16), ple_input(reference, *step).view(torch.int16))


def test_a_sharded_state_load_is_refused_naming_the_load_format(tables):
    config = vllm_config(tables["fp8"])
    config.load_config.load_format = "sharded_state"
    with pytest.raises(BadInput, match=r"--load-format sharded_state loads a state vLLM saved"):
        build_layer(config, text_config("fp8"), None)


def test_refuses_another_checkpoints_scale(checkpoints, tables):
    other = {"ngram_embedding.weight_scale": torch.tensor([3e-4], dtype=torch.bfloat16)}
    with pytest.raises(TableMismatch, match=r"converted from a checkpoint with scale"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8"), checkpoint_weights(checkpoints["fp8"], other))


def test_refuses_checkpoint_rows_of_another_method(checkpoints, tables):
    # An FP8 model config over a BF16 checkpoint: vLLM's own table would cast the rows silently.
    with pytest.raises(TableMismatch, match=r"PLE shard at row 0 is torch.bfloat16, its method stores "
                                            r"torch.float8_e4m3fn"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8"), checkpoint_weights(checkpoints["bf16"]))


def test_refuses_a_rank_file_that_is_not_this_ranks(fp8_rank_tables):
    with pytest.raises(TableMismatch, match=r"holds rank 1 of 2's rows \[8448, 16896\]; tensor-parallel rank 0 "
                                            r"of 1 serves rows \[0, 16896\]: serve the whole table"):
        build_layer(vllm_config(str(fp8_rank_tables / "ple.tp1of2.bin")), text_config("fp8"), None)


@pytest.mark.needs_helper  # StepLookup serves every mode; the no-helper path is tested below
@pytest.mark.parametrize("mode", [mode.name for mode in CUDAGraphMode])
def test_serves_bit_for_bit_under_every_cudagraph_mode_with_breakable_graphs(checkpoints, tables, monkeypatch, mode):
    """vLLM 0.33.0's default for Qwen4Exp is FULL_AND_PIECEWISE with breakable CUDA graphs: the lookup only
    queues device work, so every mode builds and serves through the same calls (run eagerly on the CPU)."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    text = text_config("fp8")
    reference = build_layer(vllm_config(), text, checkpoint_weights(checkpoints["fp8"]))
    served = build_layer(vllm_config(tables["fp8"], cudagraph_mode=mode, resident_bytes="1MiB"), text,
                         checkpoint_weights(checkpoints["fp8"]))
    assert type(served.ngram_embedding).__name__ == "PreparedTableEmbedding"
    assert served.ngram_embedding.rows.graph_safe
    for step in schedule():
        expected = ple_input(reference, *step)
        assert torch.equal(ple_input(served, *step).view(torch.int16), expected.view(torch.int16))
    stats = served.ngram_embedding.rows.stats()
    assert stats["starts"] == len(list(schedule())) and stats["failed"] == 0


def test_only_a_full_graph_forward_puts_the_lookups_start_beside_the_layers(tables):
    """In a FULL graph the finish is captured with the start (breakable graphs break only in piecewise
    mode), so start's copy may go on the lookup's side stream; in a piecewise forward it may not."""
    from vllm.forward_context import set_forward_context

    config = vllm_config(tables["fp8"])
    assert not storage.in_full_graph()  # no forward context
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):  # the runtime modes
        with set_current_vllm_config(config), set_forward_context(None, config, cudagraph_runtime_mode=mode):
            assert storage.in_full_graph() == (mode == CUDAGraphMode.FULL), mode.name


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL"])
def test_refuses_graph_modes_without_breakable_capture_naming_the_setting(tables, monkeypatch, mode):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    config = vllm_config(tables["fp8"], cudagraph_mode=mode)
    with pytest.raises(ValueError, match=r"VLLM_USE_BREAKABLE_CUDAGRAPH=0: unset VLLM_USE_BREAKABLE_CUDAGRAPH"):
        build_layer(config, text_config("fp8"), None)


def test_without_the_compiled_helper_full_graphs_are_refused_and_piecewise_serves(tables, monkeypatch):
    from ple_prep.runtime import Table

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    monkeypatch.setattr(Table, "compiled", property(lambda self: False))
    with pytest.raises(ValueError, match=r"compiled helper, which is not built.*PIECEWISE.*--enforce-eager"):
        build_layer(vllm_config(tables["fp8"], cudagraph_mode="FULL_AND_PIECEWISE"), text_config("fp8"), None)
    layer = build_layer(vllm_config(tables["fp8"], cudagraph_mode="PIECEWISE"), text_config("fp8"), None)
    assert not layer.ngram_embedding.rows.graph_safe


@pytest.mark.needs_helper
def test_a_failed_step_is_logged_at_once_and_raised_by_the_next_call(tables, caplog):
    """An id outside the table (a table of another model slipping past the checks): the step's error
    names the id in vLLM's log from the lookup's thread, and the call raises it."""
    layer = build_layer(vllm_config(tables["fp8"]), text_config("fp8"), None)
    rows = layer.ngram_embedding.rows
    rows.start(torch.full((2, 16), 10**9, dtype=torch.int64))
    with pytest.raises(IndexError, match="row id 1000000000 is outside"):
        rows.finish()
    assert rows.stats()["failed"] == 1


@pytest.mark.needs_helper
def test_the_stats_line_and_prometheus_count_each_tier(tables, checkpoints, tmp_path, monkeypatch, caplog):
    """The periodic line in vLLM's log, and with PROMETHEUS_MULTIPROC_DIR the counters vLLM's /metrics
    gathers from the workers: every row served counted once, by its tier."""
    from prometheus_client import CollectorRegistry, multiprocess, values

    from ple_prep.integrations.vllm import observe

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # A worker imports prometheus_client with the variable already set (vLLM sets it before it starts
    # them); here it was imported first, so its choice of value store is made again.
    monkeypatch.setattr(values, "ValueClass", values.get_value_class())
    monkeypatch.setattr(observe, "_prometheus", None)
    layer = build_layer(vllm_config(tables["fp8"], resident_bytes="1MiB", stats_seconds=0), text_config("fp8"),
                        checkpoint_weights(checkpoints["fp8"]))
    storage_ = layer.ngram_embedding
    for step in schedule():
        ple_input(layer, *step)
    with caplog.at_level("INFO"):
        window = storage_.stats_log.flush()
    tiers = ("rows_resident", "rows_page_cache", "rows_host_cache", "rows_disk")
    assert window["starts"] == 5 and sum(window[tier] for tier in tiers) == \
        window["ids"] == sum(len(tokens) for tokens, _, _ in schedule()) * 16
    assert re.search(r"PLE .*: 5 steps in [\d.]+ s, \d+ rows: [\d.]+% GPU, [\d.]+% page cache, [\d.]+% host cache, "
                     r"[\d.]+% disk \(\d+ pages, [\d.]+ MiB read\); read-ahead covered [\d.]+% of the rows off the "
                     r"GPU; \d+ steps late at the PLE layer \(GPU wait <= [\d.]+ ms\); 0 failed; host [\d.]+ us a "
                     r"step, [\d.]+ MiB to the GPU", caplog.text), caplog.text
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    assert registry.get_sample_value("ple_prep_steps_total") == 5
    by_tier = {tier: registry.get_sample_value("ple_prep_rows_total", {"tier": tier}) or 0
               for tier in ("gpu", "page_cache", "host_cache", "disk")}
    assert by_tier == {"gpu": window["rows_resident"], "page_cache": window["rows_page_cache"],
                       "host_cache": window["rows_host_cache"], "disk": window["rows_disk"]}
    assert (registry.get_sample_value("ple_prep_read_bytes_total") or 0) == window["bytes_read"]
    assert storage_.stats_log.flush()["starts"] == 0  # a window holds what came after the last
    # PLE_PREP_STATS_SECONDS=0 stops the lines, not the counters: the last window is exported at close.
    ple_input(layer, *next(iter(schedule())))
    caplog.clear()
    with caplog.at_level("INFO"):
        storage_.stats_log.close()
    assert "steps in" not in caplog.text
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    assert registry.get_sample_value("ple_prep_steps_total") == 6


@pytest.mark.needs_helper
def test_the_plugins_lookup_serves_rows_read_before_from_the_host_cache(checkpoints, fp8_table, tmp_path):
    """The step service reads through the table's host cache (on by default): a second pass over
    the same schedule, its file out of the page cache, reads nothing and equals vLLM's table."""
    copy = cold_copy(fp8_table, tmp_path)
    reference = build_layer(vllm_config(), text_config("fp8"), checkpoint_weights(checkpoints["fp8"]))
    served = build_layer(vllm_config(str(copy), resident_bytes="256KiB", read_path="direct", stats_seconds=0),
                         text_config("fp8"), checkpoint_weights(checkpoints["fp8"]))
    storage_ = served.ngram_embedding
    assert storage_.rows.graph_safe and storage_.table.host_cache is not None
    windows = []
    for _ in range(2):
        for step in schedule():
            expected = ple_input(reference, *step)
            assert torch.equal(ple_input(served, *step).view(torch.int16), expected.view(torch.int16))
        windows.append(storage_.stats_log.flush())
    assert windows[0]["rows_disk"] > 0 and windows[0]["pages_read"] > 0
    assert windows[1]["rows_disk"] == windows[1]["pages_read"] == windows[1]["bytes_read"] == 0
    assert windows[1]["rows_host_cache"] == windows[1]["ids"] - windows[1]["rows_resident"] > 0


class _Stored:
    def __init__(self, *args, **kwargs):
        self.args = args


def test_rocm_copy_builds_vllms_class_when_off_and_refuses_a_configured_table(tables):
    module = types.ModuleType("rocm_ple_layer")
    module.Qwen4ExpPLEPinnedHostEmbedding = module.Qwen4ExpPLEDeviceEmbedding = _Stored
    storage.install(module, storage.refuse_storage)
    storage.install(module, storage.refuse_storage)  # once only
    assert module.Qwen4ExpPLEDeviceEmbedding.original is _Stored
    with set_current_vllm_config(vllm_config()):
        assert isinstance(module.Qwen4ExpPLEDeviceEmbedding(1, 2), _Stored)
    with set_current_vllm_config(vllm_config(tables["fp8"])), pytest.raises(ValueError, match="NVIDIA .* only"):
        module.Qwen4ExpPLEPinnedHostEmbedding(1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_refuses_a_model_dtype_other_than_bf16_naming_the_flag(tables, dtype):
    with pytest.raises(ValueError, match=rf"serves bf16 PLE values; the model runs in {dtype}: .*--dtype bfloat16"):
        build_layer(vllm_config(tables["fp8"]), text_config("fp8"), None, params_dtype=dtype)


def test_enforce_eager_serves_under_a_full_cudagraph_mode(tables):
    """--enforce-eager captures no graph, so the engine's FULL mode setting never replays a lookup."""
    config = vllm_config(tables["fp8"], cudagraph_mode="FULL")
    config.model_config = types.SimpleNamespace(enforce_eager=True)
    layer = build_layer(config, text_config("fp8"), None)
    assert type(layer.ngram_embedding).__name__ == "PreparedTableEmbedding"


def test_a_refused_table_is_closed(fp8_table, tmp_path):
    """A table that fails the layer's checks leaves no descriptor or mapping of its file behind."""
    table = copy_table(fp8_table, tmp_path)

    def holds_table() -> bool:
        descriptors = Path("/proc/self/fd")
        linked = {os.path.realpath(descriptors / fd) for fd in os.listdir(descriptors)}
        return str(table.resolve()) in linked or str(table.resolve()) in Path("/proc/self/maps").read_text()

    with pytest.raises(TableMismatch, match="fp8_e4m3 rows, but the checkpoint's PLE table is nvfp4"):
        build_layer(vllm_config(str(table)), text_config("nvfp4"), None)
    assert not holds_table()


def test_register_patches_a_module_vllm_imported_before_it_and_adds_one_finder(monkeypatch):
    """vLLM may import the storage-choosing module before the plugin loads; `register` runs in every process,
    possibly more than once."""
    from ple_prep.integrations import vllm as plugin

    chooser = types.ModuleType(plugin.NVIDIA_MODULE)
    chooser.Qwen4ExpPLEPinnedHostEmbedding = chooser.Qwen4ExpPLEDeviceEmbedding = _Stored
    monkeypatch.setitem(sys.modules, plugin.NVIDIA_MODULE, chooser)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    plugin.register()
    plugin.register()
    assert chooser.Qwen4ExpPLEDeviceEmbedding.original is chooser.Qwen4ExpPLEPinnedHostEmbedding.original is _Stored
    with set_current_vllm_config(vllm_config()):
        assert isinstance(chooser.Qwen4ExpPLEDeviceEmbedding(1, 2), _Stored)
    assert sum(isinstance(finder, plugin._PatchAfterImport) for finder in sys.meta_path) == 1


def test_the_log_says_when_the_compiled_helper_is_missing(tables):
    """An install without a C compiler serves the same bytes, slower: the plugin's log says how to fix it."""
    code = ("import os, sys\n"
            "sys.modules['ple_prep.core._native'] = sys.modules['ple_prep.runtime._native'] = None\n"
            "os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from worker import start_worker\n"
            "start_worker()\n"
            "from vllm_layer import build_layer, text_config, vllm_config\n"
            f"build_layer(vllm_config({tables['fp8']!r}), text_config('fp8'), None)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "ple-prep: ple-prep's compiled helper is not built" in log and "install a C compiler" in log, log[-3000:]


def test_a_worker_whose_records_cannot_be_made_serves_on_and_says_why(monkeypatch, caplog):
    """/dev/shm full: the worker serves without sharing its failures, with a warning naming the cause."""
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(storage, "shared_failures", full)
    with set_current_vllm_config(vllm_config()), caplog.at_level("WARNING"):
        assert storage._worker_records() == (None, "worker rank 1 of 2")
    assert "cannot be shared with the other workers ([Errno 28] No space left on device)" in caplog.text
