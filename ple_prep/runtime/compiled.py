"""Whether the compiled helper was built, and what to tell a user when it was not.

pip builds it at install where a C compiler and the Python headers are there (setup.py: optional,
so an install without them still succeeds). Without it every call returns the same bytes from
numpy, but several times slower, and the device path does its host work on the caller's thread
(docs/RUNTIME.md, "The compiled helper"). Nothing else would show it, so it is said once per
process where it matters: at `open_table`, in `ple-prep bench`, in the vLLM plugin's log.
"""
from __future__ import annotations

import warnings

try:  # the same pair runtime/gather.py imports: both or neither
    from ..core import _native as _core_native  # noqa: F401
    from . import _native  # noqa: F401
    _MISSING_BECAUSE = None
except ImportError as exc:
    _MISSING_BECAUSE = str(exc)

_warned = False


class CompiledHelperMissing(RuntimeWarning):
    """ple-prep runs without its compiled helper: correct, several times slower."""


def compiled_helper_missing() -> str | None:
    """None when the compiled helper is built; else what that costs and how to fix it, in one line."""
    if _MISSING_BECAUSE is None:
        return None
    return (f"ple-prep's compiled helper is not built ({_MISSING_BECAUSE}), so row lookups run in numpy, "
            f"several times slower; to build it, install a C compiler and the Python headers (Debian, Ubuntu: "
            f"apt-get install gcc python3-dev; Fedora: dnf install gcc python3-devel) and reinstall ple-prep "
            f"without pip's cached wheel (pip install --force-reinstall --no-deps --no-cache-dir ...)")


def warn_once_if_missing() -> None:
    """A CompiledHelperMissing warning, the first time a process opens a table without the helper."""
    global _warned
    message = compiled_helper_missing()
    if message is not None and not _warned:
        _warned = True
        warnings.warn(message, CompiledHelperMissing, stacklevel=3)
