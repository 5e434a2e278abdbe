"""FSDP2 units and multi-stage regions: which wrappings a plan's regions can work with.

A stage that is itself an FSDP2 unit (``fully_shard(block)``), a unit inside a stage, or
the root unit all work with any plan (Note [Stages with hooks of their own] in
``engine.py``). What cannot work is a multi-stage region that crosses the boundary of a
unit holding several stages (``fully_shard(model.encoder)`` over blocks 2 to 5 and a
region ``[0, 4)``): the unit's hooks (gather its parameters, hand its stages new inputs)
run between two stages of the region in forward, but the region's rebuild replays stage
calls and the code between them, never the unit's own call, so its hooks would not run
again there. That is refused with one sentence, before anything is changed.

A plan made with ``reshard_after_rebuild`` (Note [Resharding after a rebuild] in
``remat/core/solve/simulator.py``) has the engine call :func:`reshard_units` on a stage
right after its call in a region's rebuild: FSDP2 does not reshard after a forward that
runs during backward, and its ``FSDPModule.reshard()`` frees the unsharded parameters,
which the unit's pre-backward hook gathers again into the same tensors (those the
rebuild's saved tensors refer to) before the stage's backward.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Region

__all__ = ["check_fsdp_units", "reshard_units", "units_in"]


def _unit_type() -> type[nn.Module] | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is a unit
    unit_type: type[nn.Module] | None = getattr(fsdp, "FSDPModule", None)
    return unit_type


def units_in(stage: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in ``stage``: the stage itself, or its children."""
    unit_type = _unit_type()
    if unit_type is None:
        return []
    return [m for m in stage.modules() if isinstance(m, unit_type)]


def reshard_units(stage: nn.Module) -> int:
    """Reshard the FSDP2 units in ``stage`` (:func:`units_in`); how many."""
    units = units_in(stage)
    for unit in units:
        unit.reshard()  # type: ignore[operator]  # FSDPModule's public method
    return len(units)


def check_fsdp_units(
    model: nn.Module,
    names: Sequence[str],
    stages: Sequence[nn.Module],
    regions: Sequence[Region],
) -> None:
    """UsageError if a multi-stage region crosses an FSDP2 unit that holds several stages."""
    unit_type = _unit_type()
    multi = [r for r in regions if r.stop - r.start > 1]
    if unit_type is None or not multi:
        return
    index = {id(m): i for i, m in enumerate(stages)}
    for path, module in model.named_modules():
        if module is model or id(module) in index or not isinstance(module, unit_type):
            continue
        inside = {index[id(m)] for m in module.modules() if id(m) in index}
        for r in multi:
            span = set(range(r.start, r.stop))
            if span & inside and not span <= inside:
                held = ", ".join(repr(names[i]) for i in sorted(inside))
                raise UsageError(
                    f"region {r} crosses the FSDP unit {path!r} (it holds stages {held}), "
                    "whose hooks a rebuild of the region cannot run again; fully_shard each "
                    "stage instead of the module around them, or keep the region within "
                    "that unit's stages"
                )
