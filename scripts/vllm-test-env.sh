#!/usr/bin/env bash
# Builds a CPU-only Python environment holding vLLM 0.33.0 for tests/vllm_plugin/ (no CUDA, ~2.2 GB).
#   bash scripts/vllm-test-env.sh [VENV]          (default VENV: .venv-vllm in the repository)
# vLLM's wheel goes in with --no-deps and its pure-Python imports are listed here: letting pip resolve
# vLLM's own requirements pulls a CUDA torch build and ~9 GB.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip() { python -m pip install -q "$@"; }
# torch's CPU build. On the package index torch==2.13.0 for Linux is a CUDA build (several GB of CUDA
# libraries); the CPU wheel is on PyTorch's own index (TORCH_INDEX_URL names another, a mirror say).
# Where pip's own configuration already offers the CPU wheel (a local index or --find-links), it is taken.
torch_index=()
if ! python -m pip install -q --dry-run --no-deps --report - torch==2.13.0 2>/dev/null | grep -q '"version": "2.13.0+cpu"'; then
    torch_index=(--index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
fi
pip torch==2.13.0 ${torch_index[@]+"${torch_index[@]}"}
pip --no-deps vllm==0.33.0
# vLLM's imports on the path tests take, at the versions its wheel pins where it pins one.
pip 'transformers>=5.16.1,<5.21' pydantic msgspec cachetools regex cbor2 psutil pyzmq aiohttp requests openai \
    pillow pybase64 cloudpickle uvloop py-cpuinfo prometheus_client 'fastapi>=0.133,<0.137' partial-json-parser \
    'llguidance>=1.7,<1.8' einops oss-harmony loguru
pip --no-deps compressed-tensors==0.17.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
# The package itself, editable, so that its vllm.general_plugins entry point exists in this environment.
pip -e "$repo[test]"
python -c 'import vllm, torch, ple_prep; print("vllm", vllm.__version__, "torch", torch.__version__)'
