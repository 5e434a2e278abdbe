"""Plans on data-parallel ranks: DDP and FSDP2 set-up, all-gather counts, per-rank peaks.

A remat plan applies to each rank's model like to a single-process one; these helpers
do the rest of the set-up the way ``docs/distributed.md`` describes it, and measure what
the per-rank cost model (:func:`remat.solve.sharding.per_rank_problem`, torch-free)
needs: how many parameter all-gathers a step makes, what one costs, and the peak of
one rank's step.

Note [FSDP units and regions]
-----------------------------
``fully_shard(module)`` installs a forward pre-hook that all-gathers the unit's
parameters and passes the unit's inputs through an autograd function (FSDP's
``RegisterPostBackwardFunction``): the unit receives *new* tensor objects. remat sees a
stage's call through hooks of its own that run before and after FSDP's (Note [Stages
with hooks of their own] in ``remat/runtime/engine.py``), so the common wrapping, each
block a unit and then the root, takes any plan, multi-stage and nested regions
included, whichever of ``fully_shard`` and ``remat.apply`` comes first. Refused: a
multi-stage region crossing a unit that holds several stages
(``remat/runtime/fsdp_units.py``). :func:`shard_stages` is a one-call set-up that,
from before that, makes a stage inside a multi-stage region a unit by its *children*
(``fully_shard(list(children))``) and every other stage a unit of its own; the
measurements of ``remat bench --distributed fsdp`` and ``plan_rank_peak`` use it.

Counted with torch 2.13 on 2 gloo ranks (``tests/test_distributed.py``), neither wrapping
makes a rebuild gather again: a unit whose pre-backward hook has gathered it rebuilds
with it gathered (FSDP's pre-forward hook does nothing in that state), and a unit gathered
by a region's rebuild stays gathered for its own backward, since FSDP does not reshard
after a forward that runs during backward: each unit is gathered once in forward and
once in backward with and without the plan, and its gradients are reduce-scattered once.
What regions cost instead is memory: every unit of a region stays gathered from the
region's rebuild until its own backward.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import UsageError
from remat.measure.allocator_events import AllocatorEvents, running_peak
from remat.measure.tracker import iter_tensors
from remat.plan import Plan

__all__ = [
    "STRATEGIES",
    "GatherCount",
    "RankInfo",
    "allocated_bytes",
    "count_all_gathers",
    "count_reduce_scatters",
    "env_rank",
    "init_from_env",
    "local_bytes",
    "plan_rank_peak",
    "rank_step_peak",
    "shard_batch",
    "shard_stages",
    "time_all_gather",
    "warm_ddp",
    "wrap_ddp",
]

#: How a model is spread over ranks: replicated (DDP) or fully sharded (FSDP2).
STRATEGIES = ("ddp", "fsdp")

#: torch.distributed's all-gather entry points; a call that delegates to another counts once.
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
#: ... and its reduce-scatter entry points (FSDP2 reduces each unit's gradients with one).
_SCATTERS = (
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter"
)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, as torchrun's environment variables say."""

    rank: int
    world_size: int
    local_rank: int


def env_rank() -> RankInfo | None:
    """The rank torchrun (or any launcher setting ``RANK`` and ``WORLD_SIZE``) gave us."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise UsageError(
            f"RANK={os.environ['RANK']!r} or WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not "
            "a whole number; launch with torchrun, which sets them"
        ) from None
    return RankInfo(rank, world, local)


def init_from_env(backend: str | None = None) -> RankInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl with CUDA), once."""
    import torch.distributed as dist

    info = env_rank()
    if info is None:
        raise UsageError(
            "RANK and WORLD_SIZE are not set, so there is no process group to join; launch "
            "with torchrun --nproc-per-node N (see docs/distributed.md)"
        )
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; install one that does")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend)
    return info


def shard_batch(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's share of a global batch: every tensor split along dim 0 into equal parts.

    Tuples, lists and dicts keep their shape; anything that is not a tensor is kept as is.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % world_size:
            raise UsageError(
                f"a batch tensor of shape {tuple(batch.shape)} does not split into "
                f"{world_size} equal parts along dim 0; use a batch size divisible by it"
            )
        return batch.chunk(world_size)[rank]
    if isinstance(batch, tuple):
        return tuple(shard_batch(b, rank, world_size) for b in batch)
    if isinstance(batch, list):
        return [shard_batch(b, rank, world_size) for b in batch]
    if isinstance(batch, dict):
        return {k: shard_batch(v, rank, world_size) for k, v in batch.items()}
    return batch


def _in_multi_stage_region(plan: Plan | None, stages: Sequence[str]) -> set[str]:
    if plan is None:
        return set()
    index = {name: i for i, name in enumerate(plan.stages)}
    inside = set()
    for name in stages:
        i = index.get(name)
        if i is not None and any(
            r.start <= i < r.stop and r.stop - r.start > 1 for r in plan.regions
        ):
            inside.add(name)
    return inside


def shard_stages(
    model: nn.Module,
    stages: Sequence[str],
    plan: Plan | None = None,
    *,
    root: bool = True,
    **fsdp_options: Any,
) -> list[str]:
    """``fully_shard`` each stage (Note [FSDP units and regions]) and then the root.

    Call it before building the optimizer (FSDP replaces the parameters). A stage inside
    one of ``plan``'s multi-stage regions gets its children sharded as one unit instead
    of itself (not needed any more; kept so that measurements stay comparable). Returns
    a line per unit, for reports.
    """
    from torch.distributed.fsdp import fully_shard

    grouped = _in_multi_stage_region(plan, stages)
    units = []
    for name in stages:
        module = model.get_submodule(name)
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        if name in grouped and children:
            fully_shard(children, **fsdp_options)
            units.append(f"{name}.* (children as one unit)")
        else:
            fully_shard(module, **fsdp_options)
            units.append(name)
    if root:
        fully_shard(model, **fsdp_options)
        units.append("<root>")
    return units


def wrap_ddp(model: nn.Module, **ddp_options: Any) -> nn.Module:
    """``DistributedDataParallel(model)`` on CPU (no device ids) or on this rank's GPU.

    Apply the plan to ``model`` first, with the stage paths it has (``blocks.0``), not
    the wrapper's (``module.blocks.0``); the optimizer may take ``model``'s parameters.
    """
    from torch.nn.parallel import DistributedDataParallel

    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        ddp_options.setdefault("device_ids", [first.device.index or 0])
    return DistributedDataParallel(model, **ddp_options)


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
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group)
        began = time.perf_counter()
        dist.all_gather_into_tensor(out, shard, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    times = sorted(times[1:])
    return times[len(times) // 2]


def allocated_bytes(fn: Callable[[], Any], *, cuda: bool = False) -> tuple[Any, int]:
    """``fn()`` and the bytes it allocated that are still alive when it returns.

    For what a wrapper keeps outside any step (the ``resident_bytes`` of
    :func:`rank_step_peak`): wrap DDP and run two steps inside ``fn`` (DDP allocates its
    gradient buckets when it wraps and again in its second step), then subtract the
    optimizer state those steps created; ``tests/test_distributed.py`` does this.
    """
    with AllocatorEvents("cuda" if cuda else "cpu") as recording:
        result = fn()
    return result, recording.allocated_bytes()


def warm_ddp(ddp: nn.Module, batch: Any, loss_fn: Callable[..., Any], optimizer: Any,
             steps: int = 3) -> None:
    """Run ``steps`` training steps so DDP's gradient buckets reach their final layout.

    DDP allocates its buckets when it wraps and again in its second step; with gloo the
    last collective of a step can still hold the old buckets when the step returns, so
    the warm-up ends with a barrier and a collection (with two steps and no barrier a
    second copy was sometimes still alive, and the measured residency doubled).
    """
    import torch.distributed as dist

    for _ in range(steps):
        loss_fn(ddp, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    gc.collect()


def plan_rank_peak(model: nn.Module, batch: Any, loss_fn: Callable[..., Any], plan: Plan, *,
                   wrap: str, stages: Sequence[str], optimizer: str = "adamw") -> tuple[int, int]:
    """This rank's peak of one training step with ``plan``, wrapped by ``wrap`` (``ddp``:
    the plan, then the wrapper; ``fsdp``: :func:`shard_stages`, then the plan), and the
    bytes the wrapper keeps outside the step (DDP's gradient buckets; 0 for FSDP2).

    Run it in a process that measures nothing else: the allocator events of earlier work
    (freed wrappers, gloo's buffers) leak into the figures otherwise.
    """
    import remat
    from remat.measure.step import make_optimizer

    if wrap not in STRATEGIES:
        raise UsageError(f"wrap={wrap!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if wrap == "fsdp":
        shard_stages(model, stages, plan)
    remat.apply(model, plan)
    opt = make_optimizer(model, optimizer)
    if wrap == "fsdp":
        return rank_step_peak(model, batch, loss_fn, opt), 0

    def wrap_and_warm() -> Any:
        ddp = wrap_ddp(model)
        warm_ddp(ddp, batch, loss_fn, opt)
        return ddp

    ddp, allocated = allocated_bytes(wrap_and_warm)
    buckets = allocated - local_bytes([*opt.state.values()])  # beyond the optimizer state
    return rank_step_peak(ddp, batch, loss_fn, opt, warmup_steps=0, resident_bytes=buckets), buckets


def local_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages this rank holds for the objects' tensors.

    A DTensor (an FSDP2 parameter, its gradient or optimizer state) counts its local shard.
    """
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for obj in objects:
        for t in iter_tensors(obj):
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rank_step_peak(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 2,
    resident_bytes: int = 0,
) -> int:
    """Peak bytes of one whole training step on this rank, from the allocator's events.

    remat's live-storage tracker is a dispatch mode and does not follow FSDP2 (its
    parameters are DTensors whose gathered storage is resized in place, outside any
    op), so a rank's step is measured like a compiled one: the bytes alive at the start
    (:func:`local_bytes` of parameters, buffers, optimizer state and batch, plus
    ``resident_bytes`` such as DDP's gradient buckets) plus the running sum of every
    allocation and free torch.profiler records during forward, backward and optimizer
    step, after ``warmup_steps`` steps (DDP rebuilds its buckets in its second step). Every
    rank must call it (the step runs collectives).
    """

    def step() -> None:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup_steps):
        step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    state = [t for s in optimizer.state.values() for t in iter_tensors(s)]
    start = resident_bytes + local_bytes(
        list(model.parameters()), list(model.buffers()), state, batch
    )
    device_type = next(model.parameters()).device.type
    with AllocatorEvents("cuda" if device_type == "cuda" else "cpu") as recording:
        step()
    return running_peak(start, recording.events)
