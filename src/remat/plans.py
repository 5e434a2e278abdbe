"""Plan builders for the classic recipes, so every baseline runs through the same runtime.

Each builder returns a :class:`remat.plan.Plan` over the model's stages (the
repeated-block container found by :func:`remat.stages.discover_stages`, or the module
paths given as ``stages=``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import nn

from remat.errors import UsageError
from remat.plan import Plan, Region
from remat.stages import resolve_stages

__all__ = ["every", "none", "per_stage", "segments", "selective", "uniform_groups"]


def _plan(stages: list[str], regions: Sequence[Region], solver: str, option: str = "keep") -> Plan:
    return Plan(
        stages=tuple(stages),
        regions=tuple(regions),
        options=(option,) * len(stages),
        solver=solver,
    )


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a whole number of at least 1, got {value!r}")
    return value


def none(model: nn.Module, *, stages: Sequence[str] | None = None) -> Plan:
    """No checkpointing: every stage keeps what autograd saves."""
    return _plan(resolve_stages(model, stages), [], "none")


def per_stage(model: nn.Module, *, stages: Sequence[str] | None = None) -> Plan:
    """One region per stage: what ``gradient_checkpointing_enable`` does in transformers."""
    names = resolve_stages(model, stages)
    return _plan(names, [Region(i, i + 1) for i in range(len(names))], "per-stage")


def every(model: nn.Module, k: int, *, stages: Sequence[str] | None = None) -> Plan:
    """Checkpoint every ``k``-th stage on its own (stages 0, k, 2k, ...), keep the rest.

    ``k=1`` is :func:`per_stage`; ``k=2`` checkpoints every other block, the
    memory/time midpoint many training recipes use.
    """
    names = resolve_stages(model, stages)
    k = _positive(k, "k")
    return _plan(names, [Region(i, i + 1) for i in range(0, len(names), k)], f"every-{k}")


def uniform_groups(model: nn.Module, size: int, *, stages: Sequence[str] | None = None) -> Plan:
    """Regions of ``size`` consecutive stages (the last may be shorter)."""
    names = resolve_stages(model, stages)
    size = _positive(size, "the group size")
    n = len(names)
    regions = [Region(i, min(i + size, n)) for i in range(0, n, size)]
    return _plan(names, regions, f"groups-{size}")


def segments(
    model: nn.Module, k: int | None = None, *, stages: Sequence[str] | None = None
) -> Plan:
    """``k`` regions of near-equal length covering the chain (``round(sqrt(n))`` by default).

    Like ``torch.utils.checkpoint.checkpoint_sequential(functions, segments=k)``, except
    that the last segment is checkpointed too.
    """
    names = resolve_stages(model, stages)
    n = len(names)
    k = max(1, round(math.sqrt(n))) if k is None else _positive(k, "the number of segments k")
    if k > n:
        raise UsageError(f"cannot split {n} stages into {k} segments; choose k between 1 and {n}")
    bounds = [round(i * n / k) for i in range(k + 1)]
    regions = [Region(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    return _plan(names, regions, f"segments-{k}")


def selective(
    model: nn.Module, policy: str = "save-matmuls", *, stages: Sequence[str] | None = None
) -> Plan:
    """No regions; every stage saves only the outputs its selective ``policy`` names."""
    names = resolve_stages(model, stages)
    if not isinstance(policy, str) or not policy:
        raise UsageError(f"policy must be a name such as 'save-matmuls', got {policy!r}")
    return _plan(names, [], f"selective-{policy}", option=f"selective:{policy}")
