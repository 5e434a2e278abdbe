"""Interleaved rounds: several steps timed side by side in one process.

Each round runs every step once, in an order rotated by one per round, so a slow spell of
the shared machine (its speed moves by 2x within minutes) falls on every step alike and a
step's predecessor changes from round to round. Used by ``remat bench`` and ``remat auto``
for their rows and by range profiles to level their timed shapes (Note [Timed shapes
levelled] in remat/core/shapes.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

__all__ = ["interleaved"]

K = TypeVar("K", bound=Hashable)


def interleaved(
    steps: Mapping[K, Callable[[], object]],
    *,
    repeats: int,
    warmup: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict[K, list[float]]:
    """Seconds of each step, ``repeats`` rounds after ``warmup`` rounds, order rotating."""
    names = list(steps)
    times: dict[K, list[float]] = {name: [] for name in names}
    total = warmup + repeats
    for r in range(total):
        k = r % max(1, len(names))
        for name in names[k:] + names[:k]:
            began = time.perf_counter()
            steps[name]()
            elapsed = time.perf_counter() - began
            if r >= warmup:
                times[name].append(elapsed)
        if progress is not None:
            progress(r + 1, total)
    return times
