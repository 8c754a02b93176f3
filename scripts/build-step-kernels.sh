#!/usr/bin/env bash
# ple_prep/runtime/native/step_kernels.ptx from step_kernels.cu beside it (needs CUDA's nvcc):
#   bash scripts/build-step-kernels.sh [OUT]       (default OUT: that file)
# PTX for the oldest target nvcc 13 builds (sm_75), its ISA version then lowered to 7.0 (CUDA 11.0) so
# that drivers older than this nvcc compile it too: the kernels use nothing newer, and a driver refuses
# a PTX file using anything its declared version does not have, so loading it on the H200 checks that
# (tests/test_step_lookup.py). The step lookup falls back to its side stream where no driver loads it.
set -euo pipefail
native="$(cd "$(dirname "$0")/../ple_prep/runtime/native" && pwd)"
nvcc -ptx -arch=compute_75 -O3 "$native/step_kernels.cu" -o - | sed -e 's/^\.version .*/.version 7.0/' \
    >"${1:-$native/step_kernels.ptx}"
