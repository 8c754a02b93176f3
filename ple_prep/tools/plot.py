"""Draw a prepared table's residency curve (optional: needs matplotlib, the `plot` extra)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.errors import BadInput
from ..core.fileio import atomic_output, check_output


def plot_residency(manifest: dict[str, Any], out: str | Path, title: str = "", *, force: bool = False,
                   inputs: Iterable[Path] = ()) -> None:
    """Held-out hit fraction against resident bytes, one point per hint, written as a PNG.

    `out` never replaces one of `inputs` (the table and its manifest), and an existing file only with `force`.
    """
    out = Path(out)
    check_output(out, force=force, inputs=inputs, option="--plot")
    pyplot = _pyplot()
    figure = residency_figure(manifest, title)
    with atomic_output(out) as handle:
        figure.savefig(handle, format="png", dpi=120)
    pyplot.close(figure)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'ple-prep[plot]'") from None
    return pyplot


def residency_figure(manifest: dict[str, Any], title: str = "") -> Any:
    """The residency curve as a matplotlib figure, every label inside the axes."""
    pyplot = _pyplot()
    # Budgets larger than the table all keep the whole table: one point, labelled with all of them.
    labels: dict[tuple[int, float], list[str]] = {}
    for hint in manifest["residency"]:
        if hint.get("hit_fraction") is not None:
            key = (hint["pages"] * manifest["page_size"], hint["hit_fraction"])
            labels.setdefault(key, []).append(hint["budget"])
    points = sorted((resident, fraction, ", ".join(names)) for (resident, fraction), names in labels.items())
    if not points:
        raise BadInput("this table has no measured residency hints (convert with --profile)")
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    gib = [max(p[0], 1) / 2**30 for p in points]
    axes.plot(gib, [p[1] for p in points], marker="o")
    axes.set_xscale("log")
    axes.margins(x=0.08)
    low, high = math.log(min(gib)), math.log(max(gib))
    for x, (_, fraction, label) in zip(gib, points):
        # Labels lean towards the middle of the plot: left of points on the right half, below
        # points near the top, so none runs past the axes.
        right_half = high > low and (math.log(x) - low) / (high - low) > 0.5
        near_top = fraction > 0.8
        axes.annotate(label, (x, fraction), textcoords="offset points", fontsize=7,
                      xytext=(-5 if right_half else 5, -6 if near_top else 6),
                      ha="right" if right_half else "left", va="top" if near_top else "bottom")
    axes.set_xlabel("resident bytes (GiB, leading pages of the file)")
    axes.set_ylabel("held-out row reads served from RAM")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.set_title(f"residency curve {title}".strip())
    figure.tight_layout()
    return figure
