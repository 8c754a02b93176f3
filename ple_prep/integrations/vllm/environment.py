"""The process environment the plugin reads and sets before vLLM's processes use CUDA.

Only the standard library: `register` runs this in every vLLM process, tables served or not.
"""
from __future__ import annotations

from collections.abc import MutableMapping

# The table's variable (settings.py reads every setting from it or vLLM's additional config).
TABLE_VARIABLE = "PLE_PREP_TABLE"
# The driver's variable that scales its launch queues, read when a process first uses CUDA.
LAUNCH_QUEUES_VARIABLE = "CUDA_SCALE_LAUNCH_QUEUES"
PLUGIN_LAUNCH_QUEUES = "4x"


def scale_launch_queues(environ: MutableMapping[str, str]) -> bool:
    """With a table in `environ`'s PLE_PREP_TABLE and no size chosen by the operator, the driver's
    launch queues four times their default size; True if it set them. Outside FULL graphs each of a
    step's kernels is a launch, and once about a thousand are queued the driver makes the next launch
    wait, the lookup's `start` and `finish` too (BENCHMARKS.md, "Serving inside vLLM's CUDA graphs").
    Child processes inherit it; in a process that already uses CUDA it changes nothing."""
    if not environ.get(TABLE_VARIABLE, "").strip() or LAUNCH_QUEUES_VARIABLE in environ:
        return False
    environ[LAUNCH_QUEUES_VARIABLE] = PLUGIN_LAUNCH_QUEUES
    return True
