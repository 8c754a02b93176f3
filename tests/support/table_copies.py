"""Prepared tables as the device tests use them: rows of one text placed first, and copies of a
table (its file and manifest) to read cold or to damage."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ple_prep.format.manifest import manifest_path
from ple_prep.ngram import row_ids
from ple_prep.tools.benchmark import cached_fraction, evict


def hot_text_first(_, spec) -> np.ndarray:
    """`placed` for convert: the rows of one text, so the resident tier is not simply the first rows."""
    return np.unique(row_ids(np.random.default_rng(9).integers(0, 5000, 400), spec))[::-1]


def copy_table(path: Path, folder: Path) -> Path:
    """A copy of the table at `path` in `folder`, with its manifest."""
    copy = Path(folder) / Path(path).name
    shutil.copy(path, copy)
    shutil.copy(manifest_path(Path(path)), manifest_path(copy))
    return copy


def cold_copy(path: Path, folder: Path) -> Path:
    """`copy_table`, its pages evicted from the page cache; skips where they stay (tmpfs)."""
    copy = copy_table(path, folder)
    evict(copy)
    if (cached_fraction(copy) or 0) > 0.5:
        pytest.skip("the page cache does not let this file's pages go (tmpfs?)")
    return copy
