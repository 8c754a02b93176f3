#!/usr/bin/env bash
# One H200 call for the FULL-graph lookup: the compiled helper built and checked, the GPU tests of the
# device path and the vLLM plugin's core, the tables, then bench/vllm_full_graph.py.
#   bash bench/vllm_full_graph_run.sh [OUT]        (on the GPU machine, in the repository's root)
set -euo pipefail
out="${1:-${OUT:-/tmp/ple-full-graph-out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c 'from ple_prep.runtime import _native; assert hasattr(_native, "step_service"); print("compiled helper: ok")'
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
# The GPU machine's image has no jsonschema, which writing a table's manifest needs: carry it as wheels
# (jsonschema, jsonschema-specifications, referencing, rpds-py, attrs) on PYTHONPATH.
python3 -c 'import jsonschema' 2>/dev/null || { echo "jsonschema is missing: carry its wheels (a comment above says which)"; exit 1; }
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/test_step_lookup.py tests/test_vllm_backend.py \
    > "$out/tests.log" 2>&1 || true
[ ! -f "$out/tests.log" ] || tail -12 "$out/tests.log"
[ -f /tmp/ple.bin ] || python3 bench/synthetic.py /tmp/ple.bin --base 2500000 --profile-tokens 1000000 > "$out/table.log"
[ -f /tmp/small.bin ] || python3 bench/synthetic.py /tmp/small.bin --base 100000 > "$out/small.log"
timeout "${BENCH_SECONDS:-300}" python3 bench/vllm_full_graph.py /tmp/ple.bin --faults-table /tmp/small.bin \
    --out "$out/full_graph.json" "${@:2}" > "$out/full_graph.log" 2>&1 || { tail -c 6000 "$out/full_graph.log"; exit 1; }
[ -z "${WITH_BACKEND_BENCH:-}" ] || timeout 120 python3 bench/vllm_backend_gpu.py /tmp/ple.bin --resident-fraction 0.05 --other-ms 1.5 > "$out/backend_gpu.json" \
    2> "$out/backend_gpu.log" || tail -30 "$out/backend_gpu.log"
python3 - "$out/full_graph.json" "$out/backend_gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
w, c = r.get("warm"), r.get("cold")
for name in ("decode", "chunk"):
    if w:
        print(f"warm {name}: p50 {w[name]['full_graph_lookup']['p50_ms']} vs {w[name]['resident_table']['p50_ms']} ms,"
              f" ratio p50 {w[name]['p50_ratio']} p90 {w[name]['p90_ratio']} (blocks {w[name].get('block_ratios')}, pairs {w[name].get('pair_ratios')}), exact {w[name]['bit_exact']},"
              f" late {w[name]['late_steps']} (by what ran before their block: {w[name].get('late_steps_after')};"
              f" the thread's time on them {w[name].get('late_host_us')} us)")
    for label, cold in (("cold", c), ("cold, host cache", r.get("cold_host_cache"))):
        if cold:
            print(f"{label} {name}: p50 {cold[name]['full_graph']['p50_ms']} vs eager {cold[name]['eager']['p50_ms']} ms,"
                  f" ratio {cold[name]['p50_ratio']} (pairs {cold[name]['pair_ratio_median']}, total {cold[name]['total_ratio']}, first/second {cold[name]['p50_ms_first_second']}), exact {cold[name]['bit_exact']}")
for tokens, batch in r.get("batched", {}).items():
    if isinstance(batch, dict):
        print(f"batched {tokens}: p50 {batch['full_graph_lookup']['p50_ms']} vs {batch['resident_table']['p50_ms']} ms,"
              f" ratio p50 {batch['p50_ratio']} p90 {batch['p90_ratio']}, exact {batch['bit_exact']}, late {batch['late_steps']}")
if c:
    print("exact poisoned, cold:", c["exact_poisoned"])
    print("cold queued, GIL held:", json.dumps(c["decode_queued_busy_gil"]))
    print("disk fraction, cold decode:", c["decode"]["disk_positions_fraction"])
if w:
    print("exact poisoned, warm / warm chunk / mixed:", w["exact_poisoned_warm"], w["exact_poisoned_warm_chunk"],
          w["exact_poisoned_mixed"])
    print("page-cache fraction, warm decode:", w["decode"]["disk_positions_fraction"])
    print("warm decode, GIL held:", json.dumps(w["decode_busy_gil"]))
    print("host:", json.dumps(w["host"]))
print("launch queues:", r.get("launch_queues"))
if r.get("host"):  # --sections host
    print("host:", json.dumps(r["host"]))
print("faults:", json.dumps(r.get("faults")))
try:
    b = json.load(open(sys.argv[2]))
    print("plugin pair/prefetch:", {k: b[k] for k in ("chunk", "decode", "chunk_prefetch", "decode_prefetch")})
except Exception as error:
    print("backend bench:", error)
PY
