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

Priced as a ring moves them (:func:`collective_seconds`, the bus-bandwidth convention
of NCCL's tests): over ``p`` ranks an all-gather of a whole tensor of ``S`` bytes sends
``S (p - 1) / p`` through each rank's link, a reduce-scatter to shards of ``S / p`` the
same, an all-reduce twice that, an all-to-all ``S (p - 1) / p``, a broadcast ``S``; time is
that over the link's bandwidth (``Device.link_bytes_per_s``), with nothing overlapped:
what a rebuild's collectives add to a step at most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.core.errors import UsageError
from remat.core.plan_format import Plan

__all__ = ["Call", "StageComms", "collective_seconds", "link_bytes", "rebuilt_collectives"]

Call = tuple[str, int]  # a collective's op name and its output bytes on this rank


@dataclass(frozen=True)
class StageComms:
    """One stage's collectives: its forward's, and its rebuild's as the last stage of a
    region (module docstring), each in call order."""

    forward: tuple[Call, ...] = ()
    rebuild_last: tuple[Call, ...] = ()

    def to_dict(self) -> dict[str, list[list[Any]]]:
        return {"forward": [list(c) for c in self.forward],
                "rebuild_last": [list(c) for c in self.rebuild_last]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "collectives") -> StageComms:
        if not isinstance(data, Mapping) or set(data) != {"forward", "rebuild_last"}:
            raise UsageError(f"{where} must be an object with forward and rebuild_last")
        calls = []
        for key in ("forward", "rebuild_last"):
            items = data[key]
            if not isinstance(items, list) or not all(
                    isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)
                    and isinstance(c[1], int) and not isinstance(c[1], bool) and c[1] >= 0
                    for c in items):
                raise UsageError(f"{where} {key} must be a list of [op, bytes] pairs")
            calls.append(tuple((str(op), int(n)) for op, n in items))
        return cls(calls[0], calls[1])

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", tuple((str(op), int(n)) for op, n in self.forward))
        object.__setattr__(self, "rebuild_last",
                           tuple((str(op), int(n)) for op, n in self.rebuild_last))
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


#: Per op: bytes through one rank's link, as a multiple of the output's bytes times
#: ``(p - 1) / p`` (a reduce-scatter's output is one shard: times ``p``).
_RING = {
    "all_gather_into_tensor": 1.0,
    "all_gather_into_tensor_coalesced": 1.0,
    "reduce_scatter_tensor": None,  # output is S / p: S (p - 1) / p = output (p - 1)
    "reduce_scatter_tensor_coalesced": None,
    "all_reduce": 2.0,
    "all_reduce_coalesced": 2.0,
    "all_to_all_single": 1.0,
}


def link_bytes(op: str, output_bytes: int, ranks: int) -> float:
    """Bytes one collective moves through each rank's link over ``ranks`` ranks."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise UsageError(f"ranks={ranks!r} must be a whole number >= 1")
    if op == "broadcast":
        return float(output_bytes) if ranks > 1 else 0.0
    if op not in _RING:
        raise UsageError(f"collective {op!r} is not priced; known: "
                         f"{', '.join(sorted([*_RING, 'broadcast']))}")
    factor = _RING[op]
    if factor is None:
        return float(output_bytes * (ranks - 1))
    return factor * output_bytes * (ranks - 1) / ranks


def collective_seconds(calls: Sequence[Call], bandwidth_bytes_per_s: float,
                       ranks: int = 2) -> float:
    """Seconds the calls take over ``ranks`` ranks on links of that bandwidth (module
    docstring)."""
    if not bandwidth_bytes_per_s > 0:
        raise UsageError(f"bandwidth {bandwidth_bytes_per_s!r} must be above zero")
    return sum(link_bytes(op, nbytes, ranks) for op, nbytes in calls) / bandwidth_bytes_per_s
