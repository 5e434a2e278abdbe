"""Plan builders for the classic recipes, so every baseline runs through the same runtime.

Each builder returns a :class:`remat.core.plan_format.Plan` over the model's stages (the
repeated-block container found by :func:`remat.runtime.stages.discover_stages`, or the module
paths given as ``stages=``), recording what it was made for from the model itself
(stage classes and parameter shapes; no profile, no batch), so a saved builder plan is
checked like a planned one when applied to another model.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

import remat.core.recipes as recipes
from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, Option, Plan, Region
from remat.runtime.identity import made_for_model
from remat.runtime.stages import resolve_stages

__all__ = ["every", "none", "per_stage", "segments", "selective", "uniform_groups"]


def _plan(
    model: nn.Module,
    stages: list[str],
    regions: Sequence[tuple[int, int]],
    solver: str,
    option: str = KEEP,
) -> Plan:
    return Plan(
        stages=tuple(stages),
        regions=tuple(Region(a, b) for a, b in regions),
        options=(option,) * len(stages),
        solver=solver,
        made_for=made_for_model(model, stages),
    )


def none(model: nn.Module, *, stages: Sequence[str] | None = None) -> Plan:
    """No checkpointing: every stage keeps what autograd saves."""
    return _plan(model, resolve_stages(model, stages), [], "none")


def per_stage(model: nn.Module, *, stages: Sequence[str] | None = None) -> Plan:
    """One region per stage: what ``gradient_checkpointing_enable`` does in transformers."""
    names = resolve_stages(model, stages)
    return _plan(model, names, recipes.per_stage(len(names)), "per-stage")


def every(model: nn.Module, k: int, *, stages: Sequence[str] | None = None) -> Plan:
    """Checkpoint every ``k``-th stage on its own (stages 0, k, 2k, ...), keep the rest.

    ``k=1`` is :func:`per_stage`; ``k=2`` checkpoints every other block, the
    memory/time midpoint many training recipes use.
    """
    names = resolve_stages(model, stages)
    return _plan(model, names, recipes.every(len(names), k), f"every-{k}")


def uniform_groups(model: nn.Module, size: int, *, stages: Sequence[str] | None = None) -> Plan:
    """Regions of ``size`` consecutive stages (the last may be shorter)."""
    names = resolve_stages(model, stages)
    return _plan(model, names, recipes.groups(len(names), size), f"groups-{size}")


def segments(
    model: nn.Module, k: int | None = None, *, stages: Sequence[str] | None = None
) -> Plan:
    """``k`` regions of near-equal length covering the chain (``round(sqrt(n))`` by default).

    Like ``torch.utils.checkpoint.checkpoint_sequential(functions, segments=k)``, except
    that the last segment is checkpointed too.
    """
    names = resolve_stages(model, stages)
    regions = recipes.segments(len(names), k)
    return _plan(model, names, regions, f"segments-{len(regions)}")


def selective(
    model: nn.Module, policy: str = "save-matmuls", *, stages: Sequence[str] | None = None
) -> Plan:
    """No regions; every stage saves only the outputs its selective ``policy`` names."""
    names = resolve_stages(model, stages)
    if not isinstance(policy, str) or not policy:
        raise UsageError(f"policy must be a name such as 'save-matmuls', got {policy!r}")
    return _plan(model, names, [], f"selective-{policy}", option=Option.selective(policy))
