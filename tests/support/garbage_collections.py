"""How often calls set off Python's garbage collector. A call that makes an object the collector counts
(a bound method, a tensor's Python object; a tuple or a list only when its free list is empty) moves
it towards its next collection; from Python 3.12 that collection runs at the next Python call's
entry, which may be inside a step's timed call."""
from __future__ import annotations

import gc
from typing import Callable


class _Held:
    """An object that counts towards a collection: lists and small tuples come from free lists, which
    Python does not count."""


def _nothing() -> None:
    """Its entry is where Python 3.12 runs a collection that the last C call set off."""


def collections_set_off(call: Callable[[], None], rounds: int = 50) -> int:
    """How many collections `rounds` calls of `call` set off: each call starts with the youngest
    generation's count at its threshold, set to 1, so the first object the call makes sets one off."""
    collections = 0

    def started(phase: str, info: dict) -> None:
        nonlocal collections
        if phase == "start":
            collections += 1

    threshold = gc.get_threshold()
    gc.set_threshold(1, *threshold[1:])
    try:
        for _ in range(rounds):
            gc.collect(0)
            held = _Held()  # the count at 1
            gc.callbacks.append(started)
            call()
            _nothing()
            gc.callbacks.remove(started)
            del held
    finally:
        gc.set_threshold(*threshold)
    return collections
