"""What vLLM's loader reads of the checkpoint's PLE table at boot: vLLM's own table against the plugin.

    bash scripts/vllm-test-env.sh /work/venv-vllm
    flock /tmp/ple-bench.lock /work/venv-vllm/bin/python bench/vllm_boot_reads.py --base 100000 --rounds 3

An FP8 fixture checkpoint (`--base` sets its size: 100000 gives 1.6M rows, 256 MB of table) and its
prepared table are written once under `--work`. Each round runs, alternating, one child per side
with the checkpoint evicted from the page cache first: the child builds vLLM 0.33.0's real
Qwen4ExpNGramEmbedding (tests/vllm_plugin/vllm_layer.py) and loads the checkpoint through the model
loader vLLM picks for its default load format (with the plugin installed: the plugin's, which
leaves the shards of a served layer unread), either into vLLM's device table (no plugin setting) or
with the plugin serving the prepared table. Per side: bytes read from storage (/proc/self/io
read_bytes), the checkpoint's bytes in the page cache afterwards, peak RSS, seconds, and a digest of
the layer's outputs over the test schedule (equal on both sides when the plugin serves exactly).
The report adds the PLE shards' bytes and the plugin side's reads as a fraction of them. Prints JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "vllm_plugin"))

from ple_prep.converters import open_source  # noqa: E402
from ple_prep.offline.writer import convert  # noqa: E402
from ple_prep.tools.benchmark import cached_fraction, evict  # noqa: E402
from ple_prep.tools.fixtures import make_checkpoint  # noqa: E402


def io_counters() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {key: int(fields[key]) for key in ("rchar", "read_bytes")}


def child(side: str, checkpoint: Path, table: Path, base: int) -> dict:
    """One boot of the layer; runs in a fresh process."""
    import torch
    from worker import start_worker

    start_worker()
    from vllm_layer import build_layer, loader_weights, ple_input, schedule, text_config, vllm_config

    files = sorted(checkpoint.glob("*.safetensors"))
    before = io_counters()
    began = time.perf_counter()
    config = vllm_config(str(table)) if side == "plugin" else vllm_config()
    layer = build_layer(config, text_config("fp8", ngram_vocab_size_base=base), loader_weights(checkpoint))
    seconds = time.perf_counter() - began
    after = io_counters()
    storage = layer.ngram_embedding
    digest = hashlib.sha256()
    for step in schedule():
        digest.update(ple_input(layer, *step).view(torch.int16).numpy().tobytes())
    return {"side": type(storage).__name__, "seconds": round(seconds, 2),
            "read_bytes": after["read_bytes"] - before["read_bytes"], "rchar": after["rchar"] - before["rchar"],
            "checkpoint_cached_bytes": int(sum(cached_fraction(f) * f.stat().st_size for f in files)),
            "table_weight_bytes": storage.weight.numel() * storage.weight.element_size(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "outputs_sha256": digest.hexdigest()}


def shard_bytes(files: list[Path]) -> int:
    """Bytes of the checkpoint's PLE shard tensors, from the safetensors headers."""
    from ple_prep.integrations.vllm.loader import PLE_SHARD

    total = 0
    for path in files:
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
                     if name != "__metadata__" and PLE_SHARD.search(name))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=100000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ple-vllm-boot"))
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "CHECKPOINT", "TABLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, checkpoint, table = args.child
        print(json.dumps(child(side, Path(checkpoint), Path(table), args.base)))
        return
    checkpoint = args.work / f"fp8-base{args.base}"
    table = args.work / f"fp8-base{args.base}.bin"
    if not table.exists():
        args.work.mkdir(parents=True, exist_ok=True)
        make_checkpoint(checkpoint, "fp8", base=args.base, num_files=8, with_tokenizer=False)
        with open_source(checkpoint) as source:
            convert(source, table)
    files = sorted(checkpoint.glob("*.safetensors"))
    results: dict[str, list[dict]] = {"device": [], "plugin": []}
    for _ in range(args.rounds):
        for side in results:
            for path in files:
                evict(path)
            output = subprocess.run([sys.executable, __file__, "--base", str(args.base), "--child", side,
                                     str(checkpoint), str(table)], check=True, capture_output=True, text=True)
            results[side].append(json.loads(output.stdout.strip().splitlines()[-1]))
    report = {"checkpoint_bytes": sum(f.stat().st_size for f in files), "ple_shard_bytes": shard_bytes(files),
              "table_file_bytes": table.stat().st_size, "rounds": args.rounds}
    for side, runs in results.items():
        report[side] = {key: float(np.median([run[key] for run in runs]))
                        for key in runs[0] if key not in ("side", "outputs_sha256")} | {"storage": runs[0]["side"]}
    digests = {run["outputs_sha256"] for runs in results.values() for run in runs}
    report["outputs_equal"] = len(digests) == 1
    report["plugin_read_fraction_of_shards"] = report["plugin"]["read_bytes"] / report["ple_shard_bytes"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
