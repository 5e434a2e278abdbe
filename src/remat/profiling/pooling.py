"""Pooling the timed rounds of identical stages, and how noisy the rounds were.

Stages that are the same computation (same class and structure, same parameter shapes
and dtypes, same input shapes: :mod:`.identical`) take the same time; whatever their
rounds show beyond that is the machine's noise. On a loaded two-core machine identical
gpt blocks were timed at 21 ms to 143 ms forward in one profile, and each stage's
median of two rounds followed its own noise. So every stage gets the median of all
rounds of all stages identical to it, and the spread (the interquartile range of those
samples) is recorded next to it. This module is plain Python: the numbers in, the
medians and spreads out.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Pooled", "identical_groups", "pool", "relative_spread", "spread_among"]


@dataclass(frozen=True)
class Pooled:
    """The median of a stage's pooled samples and their interquartile range."""

    median: float
    low: float
    high: float
    samples: int

    @property
    def relative(self) -> float:
        """``(high - low) / median``; 0 for a median of 0."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0


def identical_groups(signatures: Sequence[Hashable | None]) -> list[int]:
    """For each stage, the index of the first stage with its signature (its own index
    when it is the first, or its signature is None: not known, so pooled with nothing)."""
    first: dict[Hashable, int] = {}
    found = []
    for i, sig in enumerate(signatures):
        found.append(i if sig is None else first.setdefault(sig, i))
    return found


def relative_spread(values: Sequence[float]) -> float:
    """``(q3 - q1) / median`` of ``values`` (min and max below four values); 0 for fewer
    than two values or a median of 0."""
    if len(values) < 2:
        return 0.0
    low, high = _quartiles(values)
    mid = statistics.median(values)
    return (high - low) / mid if mid > 0 else 0.0


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def pool(samples: Sequence[Sequence[float]], group_of: Sequence[int]) -> list[Pooled]:
    """Per stage: the median and interquartile range of the samples of every stage in its
    group (``samples[i]``: stage i's rounds; ``group_of``: :func:`identical_groups`)."""
    if len(samples) != len(group_of):
        raise ValueError(f"{len(samples)} stages of samples, {len(group_of)} group entries")
    members: dict[int, list[float]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).extend(samples[i])
    found = []
    for g in group_of:
        values = members[g]
        if not values:
            found.append(Pooled(0.0, 0.0, 0.0, 0))
            continue
        low, high = _quartiles(values)
        found.append(Pooled(float(statistics.median(values)), low, high, len(values)))
    return found


def spread_among(samples: Sequence[Sequence[float]], group_of: Sequence[int]) -> float:
    """How differently identical stages measured before pooling: over every group of two
    or more stages, the largest ``max / min - 1`` of the members' own medians (0 when no
    stages are identical)."""
    medians: dict[int, list[float]] = {}
    for i, g in enumerate(group_of):
        if samples[i]:
            medians.setdefault(g, []).append(float(statistics.median(samples[i])))
    worst = 0.0
    for values in medians.values():
        if len(values) > 1 and min(values) > 0:
            worst = max(worst, max(values) / min(values) - 1)
    return worst
