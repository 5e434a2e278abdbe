"""Collectives a plan's rebuilds issue again, from two measurements per stage. Torch-free.

Under tensor (and sequence) parallelism a stage's forward communicates, and a rebuild
runs the forward again with its collectives, up to where torch's early stop ends it.
Per stage, :class:`StageComms` holds what its forward issues and what it issues again
when rebuilt as the last stage of a region (a one-stage region's rebuild: early stop
ends it once the stage's saved tensors are back, so a collective after the last of
them, a block's final reduce-scatter say, is not repeated). :func:`rebuilt_collectives`
then predicts a plan's: a stage in a region and not its last is rebuilt whole (the next
stage needs its output); the last stage of a region, and a selective stage outside
regions, as a one-stage region; a stage under ``selective:save-collectives`` outside
regions repeats none (its collectives' outputs are saved); ``keep`` and ``offload``
stages are not rebuilt. A stage inside a region is rebuilt by the region, whatever its
option. Nested regions are not predicted (raises): measured rebuilds there depend on
which inner boundaries the outer rebuild keeps.

Priced at ``bytes / bandwidth`` (:func:`collective_seconds`): what a rebuild adds to a
step on a link of that bandwidth, with nothing overlapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.core.errors import UsageError
from remat.core.plan_format import Plan

__all__ = ["Call", "StageComms", "collective_seconds", "rebuilt_collectives"]

Call = tuple[str, int]  # a collective's op name and its output bytes on this rank


@dataclass(frozen=True)
class StageComms:
    """One stage's collectives: its forward's, and its rebuild's as the last stage of a
    region (module docstring), each in call order."""

    forward: tuple[Call, ...] = ()
    rebuild_last: tuple[Call, ...] = ()

    def __post_init__(self) -> None:
        if list(self.rebuild_last) != list(self.forward[:len(self.rebuild_last)]):
            raise UsageError("a stage's rebuild repeats a first part of its forward's "
                             "collectives; rebuild_last is not one")


def rebuilt_collectives(plan: Plan, comms: Sequence[StageComms]) -> list[tuple[Call, ...]]:
    """Per stage of ``plan``, the collectives its rebuilds issue in one step."""
    n = len(plan.stages)
    if len(comms) != n:
        raise UsageError(f"give one StageComms per stage of the plan ({n}), not {len(comms)}")
    covering: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for region in plan.regions:
        for i in range(region.start, region.stop):
            covering[i].append((region.start, region.stop))
    out: list[tuple[Call, ...]] = []
    for i, option in enumerate(plan.parsed_options):
        regions = covering[i]
        if len(regions) > 1:
            raise UsageError(f"stage {plan.stages[i]!r} lies in {len(regions)} nested regions; "
                             "the collectives of nested rebuilds are not predicted")
        if regions:
            out.append(comms[i].rebuild_last if regions[0][1] == i + 1 else comms[i].forward)
        elif option.kind == "selective" and option.policy != "save-collectives":
            out.append(comms[i].rebuild_last)
        else:
            out.append(())
    return out


def collective_seconds(calls: Sequence[Call], bandwidth_bytes_per_s: float) -> float:
    """Seconds the calls take on a link of that bandwidth (each its output's bytes)."""
    if not bandwidth_bytes_per_s > 0:
        raise UsageError(f"bandwidth {bandwidth_bytes_per_s!r} must be above zero")
    return sum(nbytes for _, nbytes in calls) / bandwidth_bytes_per_s
