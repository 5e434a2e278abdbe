"""The classic checkpointing recipes as region lists over ``n`` stages (torch-free).

One definition serves both the torch-side builders in :mod:`remat.plans` (which take
a model) and the solvers in :mod:`remat.core.solve` (which take a problem), so a recipe
means the same regions wherever it is named.
"""

from __future__ import annotations

import itertools
import math

from remat.core.errors import UsageError

__all__ = [
    "block", "default_segments", "every", "groups", "per_stage", "segments", "split_at_breaks",
]

Spans = list[tuple[int, int]]


def _whole(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{name} must be a whole number from {low} to {high}, got {value!r}")
    return value


def split_at_breaks(regions: Spans, breaks: tuple[int, ...]) -> Spans:
    """``regions`` with each one that spans a chain break cut there (stage ``p`` in
    ``breaks``: no region may hold stages ``p - 1`` and ``p`` both); order kept."""
    if not breaks:
        return regions
    out: Spans = []
    for start, stop in regions:
        cuts = [p for p in breaks if start < p < stop]
        out += list(itertools.pairwise([start, *cuts, stop]))
    return out


def per_stage(n: int) -> Spans:
    """One region per stage (what transformers' ``gradient_checkpointing_enable`` does)."""
    return [(i, i + 1) for i in range(n)]


def every(n: int, k: int) -> Spans:
    """Stages 0, k, 2k, ... each alone in a region; the others keep."""
    k = _whole(k, "k", 1, max(1, n))
    return [(i, i + 1) for i in range(0, n, k)]


def default_segments(n: int) -> int:
    return max(1, round(math.sqrt(n)))


def segments(n: int, k: int | None = None) -> Spans:
    """``k`` near-equal regions covering the chain (``round(sqrt(n))`` by default)."""
    k = default_segments(n) if k is None else _whole(k, "the number of segments k", 1, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def groups(n: int, size: int) -> Spans:
    """Regions of ``size`` consecutive stages, the last one shorter (Megatron's uniform)."""
    size = _whole(size, "the group size (num_layers)", 1, n)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def block(n: int, count: int) -> Spans:
    """The first ``count`` stages each alone, the rest keep (Megatron's block)."""
    count = _whole(count, "num_layers", 1, n)
    return [(i, i + 1) for i in range(count)]
