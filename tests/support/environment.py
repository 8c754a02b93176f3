"""The environment of a child Python process: this checkout first on its path, then whatever the
caller's PYTHONPATH holds (a machine may carry the dependencies there, not in site-packages)."""
from __future__ import annotations

import os
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def child_environment() -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(REPOSITORY), *([inherited] if inherited else [])])}
