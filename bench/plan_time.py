"""The convert's plan (`plan_for_source`) with the compiled planner loops against their numpy steps.

Run: python bench/plan_time.py --model CKPT --profile PROF [--rounds 2] [--map-fraction 0.01]

The same source and profile planned again and again in one process, the sides in turn: `compiled`
(core/native/pack.c: the page packing and each group's new rows; core/native/rankindex.c: the map's
rank index), `numpy_new_rows` (the new rows taken by planner.py's numpy steps, as before they were
in C) and `numpy_rank_index` (the rank index built by format/order.py's numpy steps, as before it
was in C). Prints each plan's seconds and that every plan placed the same rows with the same
residency hints.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ple_prep.converters import open_source  # noqa: E402
from ple_prep.core.constants import DEFAULT_MAP_FRACTION, DEFAULT_PAGE_SIZE  # noqa: E402
from ple_prep.format import order  # noqa: E402
from ple_prep.offline import planner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--map-fraction", type=float, default=DEFAULT_MAP_FRACTION)
    args = parser.parse_args()
    compiled = planner._native
    if compiled is None:
        sys.exit("error: the compiled helper is not built (python setup.py build_ext --inplace)")
    # Each side: the planner's helper and the order map's.
    sides = {"compiled": (compiled, compiled),
             "numpy_new_rows": (types.SimpleNamespace(pack_groups=compiled.pack_groups,
                                                      take_new_rows=planner._take_new_rows), compiled),
             "numpy_rank_index": (compiled, None)}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    outcomes = set()
    try:
        with open_source(args.model) as source:
            for index in range(args.rounds):
                names = list(sides)
                for name in names[index % len(names):] + names[:index % len(names)]:
                    planner._native, order._native = sides[name]
                    started = time.perf_counter()
                    layout = planner.plan_for_source(source, args.profile, page_size=DEFAULT_PAGE_SIZE,
                                                     map_fraction=args.map_fraction)
                    seconds[name].append(round(time.perf_counter() - started, 2))
                    outcomes.add((layout.order.num_placed, json.dumps(layout.residency, sort_keys=True)))
                    del layout
    finally:
        planner._native = order._native = compiled
    print(json.dumps({"seconds": seconds, "placed": sorted(o[0] for o in outcomes),
                      "same_plan": len(outcomes) == 1}, indent=1))


if __name__ == "__main__":
    main()
