"""The collectives a data-parallel step makes, counted and timed: FSDP2's and DDP's
all-gathers and reduce-scatters.

What the per-rank cost model (:func:`remat.core.transforms.per_rank_problem`) needs
besides bytes: how many parameter all-gathers a step makes (:func:`count_all_gathers`;
Note [FSDP units and regions] in :mod:`remat.parallel.data_parallel` says why a rebuild
makes none unless the plan reshards), and what one costs (:func:`time_all_gather`,
:func:`time_unit_gathers`). Every rank must call the timers together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.tracker import iter_tensors
from remat.runtime.stage_calls import stage_submodule

__all__ = ["GatherCount", "count_all_gathers", "count_reduce_scatters", "time_all_gather",
           "time_unit_gathers"]

#: torch.distributed's all-gather entry points; a call that delegates to another counts once.
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
#: ... and its reduce-scatter entry points (FSDP2 reduces each unit's gradients with one).
_SCATTERS = (
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter"
)


@dataclass
class GatherCount:
    """Collectives seen so far: calls, and bytes of their outputs (an all-gather's output
    is the gathered size; a reduce-scatter's is this rank's shard)."""

    calls: int = 0
    bytes: int = 0


@contextlib.contextmanager
def count_all_gathers() -> Iterator[GatherCount]:
    """Count every torch.distributed all-gather called in the block (FSDP's included).

    The public entry points are wrapped for the block's duration (in ``torch.distributed``
    and ``torch.distributed.distributed_c10d``); a call that delegates to another (in
    torch 2.13 ``all_gather_into_tensor`` calls ``all_gather_single``) counts once.
    """
    with _counting(_GATHERS, "output_tensor", "tensor_list") as count:
        yield count


@contextlib.contextmanager
def count_reduce_scatters() -> Iterator[GatherCount]:
    """Count every torch.distributed reduce-scatter called in the block, as
    :func:`count_all_gathers` counts all-gathers (FSDP2 makes one per unit in backward)."""
    with _counting(_SCATTERS, "output", "output") as count:
        yield count


@contextlib.contextmanager
def _counting(names: Sequence[str], out_kw: str, list_kw: str) -> Iterator[GatherCount]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    count = GatherCount()
    depth = [0]

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                count.calls += 1
                out = args[0] if args else kwargs.get(out_kw, kwargs.get(list_kw))
                count.bytes += sum(t.numel() * t.element_size() for t in iter_tensors(out))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    saved: list[tuple[Any, str, Any]] = []
    for namespace in (dist, c10d):
        for name in names:
            fn = getattr(namespace, name, None)
            if fn is not None:
                saved.append((namespace, name, fn))
    originals = {id(fn): fn for _, _, fn in saved}
    wrapped = {key: counting(fn) for key, fn in originals.items()}
    try:
        for namespace, name, fn in saved:
            setattr(namespace, name, wrapped[id(fn)])
        yield count
    finally:
        for namespace, name, fn in saved:
            setattr(namespace, name, fn)


def time_all_gather(nbytes: int, *, repeats: int = 5, group: Any = None) -> float:
    """Median seconds of one all-gather whose gathered output is ``nbytes`` (float32)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    shard = torch.ones(max(1, -(-nbytes // (4 * world))), device=device)
    out = torch.empty(shard.numel() * world, device=device)

    def gather() -> None:
        dist.all_gather_into_tensor(out, shard, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _median_seconds(gather, repeats, group=group)


def _median_seconds(run: Callable[[], Any], repeats: int, *,
                    before: Callable[[], Any] | None = None, group: Any = None) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after one warm-up call, every
    rank starting each together (``before()``, untimed, ahead of the barrier)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        dist.barrier(group)
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    times = sorted(times[1:])
    return times[len(times) // 2]


def time_unit_gathers(model: nn.Module, stages: Sequence[str], *, repeats: int = 5
                      ) -> list[float]:
    """Median seconds to gather each stage's FSDP2 units again once resharded, as the
    unit's pre-backward hook does after a plan resharded it following a rebuild
    (``FSDPModule.unshard()``: the copy into the flat buffer, the all-gather and the copy
    out; 0 for a stage without units). ``model`` must be sharded and have run a step;
    every rank must call it together."""
    from remat.runtime.fsdp_units import units_in

    seconds = []
    for name in stages:
        units: list[Any] = units_in(stage_submodule(model, name))
        if not units:
            seconds.append(0.0)
            continue

        def reshard(units: list[Any] = units) -> None:
            for unit in units:
                unit.reshard()

        def unshard(units: list[Any] = units) -> None:
            for unit in units:
                unit.unshard()

        seconds.append(_median_seconds(unshard, repeats, before=reshard))
        reshard()  # as a step leaves it
    return seconds


