"""Draw a prepared table's residency curve (optional: needs matplotlib, the `plot` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import BadInput


def plot_residency(manifest: dict[str, Any], out: str | Path, title: str = "") -> None:
    """Held-out hit fraction against resident bytes, one point per hint, written as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'ple-prep[plot]'") from None
    out = Path(out)
    if not out.parent.is_dir():
        raise BadInput(f"output folder {out.parent} does not exist")
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
    axes.plot([p[0] / 2**30 for p in points], [p[1] for p in points], marker="o")
    for resident, fraction, label in points:
        axes.annotate(label, (resident / 2**30, fraction), textcoords="offset points", xytext=(4, -10),
                      fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("resident bytes (GiB, leading pages of the file)")
    axes.set_ylabel("held-out row reads served from RAM")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.set_title(f"residency curve {title}".strip())
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=120)
    pyplot.close(figure)
