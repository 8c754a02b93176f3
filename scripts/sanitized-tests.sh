#!/usr/bin/env bash
# The runtime tests against the compiled helpers built with AddressSanitizer and UBSan:
#     bash scripts/sanitized-tests.sh [pytest arguments]      (default: the runtime's tests)
# A copy of the package is built in a temporary folder (the working tree's own build is left alone)
# and Python runs with libasan preloaded (Python itself is not instrumented). Any report fails the
# run: UBSan halts on its first finding (signed overflow included), ASan on any memory error. Leak checking is off (CPython
# keeps its interned objects until exit). The helpers' SIGBUS handler (core/native/guard.c) needs
# allow_user_segv_handler. Needs gcc with libasan and libubsan; uses the Python that runs it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$root/ple_prep" "$root/tests" "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$work/"
find "$work/ple_prep" -name '*.so' -delete
cd "$work"
# -fno-wrapv: Python builds extensions with -fwrapv, under which UBSan does not check signed overflow.
flags="-O1 -g -fno-omit-frame-pointer -fno-wrapv -fsanitize=address,undefined -fno-sanitize-recover=undefined"
CFLAGS="$flags" LDSHARED="gcc -shared -fsanitize=address,undefined" "$python" setup.py -q build_ext --inplace
"$python" -c "import ple_prep.core._native, ple_prep.runtime._native" 2>/dev/null && {
    echo "the sanitized helpers load without libasan preloaded: not an ASan build" >&2; exit 1; }
if [ "$#" -eq 0 ]; then
    set -- tests/test_gather.py tests/test_direct.py tests/test_runtime_table.py tests/test_open_table.py \
        tests/test_hostile_callers.py tests/test_serving_faults.py tests/test_concurrency.py
fi
export LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
export ASAN_OPTIONS="detect_leaks=0:allow_user_segv_handler=1:halt_on_error=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
PYTHONPATH=".:tests" "$python" -c "import ple_prep.core._native, ple_prep.runtime._native; print('sanitized helpers loaded')"
# Without pytest's faulthandler, whose SIGBUS handler would print a dump before handing a guarded
# copy's fault back to the helpers' (it changes nothing else).
PYTHONPATH=".:tests" "$python" -m pytest -q -p no:cacheprovider -p no:faulthandler "$@"
