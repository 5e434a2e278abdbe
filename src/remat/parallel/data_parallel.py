"""Plans on data-parallel ranks (DDP and FSDP2): wrapping and sharding, the per-rank
problem, and the peak of one rank's step.

A remat plan applies to each rank's model like to a single-process one; these helpers
do the rest of the set-up the way ``docs/distributed.md`` describes it
(:func:`shard_stages` before the plan, :func:`wrap_ddp` after it), build the problem
every rank plans from (:func:`rank_problem`, which delegates to the torch-free
:func:`remat.core.transforms.per_rank_problem`), and measure a rank's step
(:func:`rank_step_memory`, from the allocator's events: Note [Steady per-rank peaks] in
:mod:`remat.measure.allocator_events`). The collectives a step makes are counted and
timed in :mod:`remat.parallel.gathers`.

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
region's rebuild until its own backward, unless the plan reshards them after the rebuild
(``Plan.reshard_after_rebuild``: ``remat/runtime/fsdp_units.py``), one more all-gather each.


What a wrapper keeps between steps is counted from the wrapper itself, not from the
events of the steps that built it: DDP's buckets are read from its reducer
(:func:`ddp_bucket_bytes`), since an old layout's buckets are freed by whichever thread
drops the last reference, with or without an event.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve import Problem
from remat.measure.allocator_events import AllocatorEvents, EventStepMemory, account_step
from remat.measure.tracker import iter_tensors
from remat.runtime.stage_calls import stage_submodule

from .ranks import RankInfo, on_every_rank, shard_batch

__all__ = [
    "STRATEGIES",
    "DataParallelRank",
    "allocated_bytes",
    "ddp_bucket_bytes",
    "local_bytes",
    "plan_rank_memory",
    "plan_rank_peak",
    "profile_as_run",
    "rank_problem",
    "rank_step_memory",
    "rank_step_peak",
    "shard_stages",
    "warm_ddp",
    "wrap_ddp",
]

#: How a model is spread over ranks: replicated (DDP) or fully sharded (FSDP2).
STRATEGIES = ("ddp", "fsdp")

#: ``factory(batch_size)`` returns ``(model, batch, loss_fn)``; None means the default size.
Factory = Callable[[int | None], tuple[nn.Module, Any, Callable[..., Any]]]


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
        module = stage_submodule(model, name)
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


def profile_as_run(model: nn.Module, batch: Any, loss_fn: Callable[..., Any], *, wrap: str,
                   stages: Sequence[str], optimizer: str = "adamw", repeats: int = 2
                   ) -> Profile:
    """This rank's profile of ``model`` wrapped as the job runs it, for its times.

    Note [Per-rank time]: the collectives of a step (FSDP2's all-gathers in forward, in
    rebuilds and in backward, its reduce-scatters; DDP's bucketed all-reduces; the root
    unit's) run inside the stages' forwards and backwards and around the chain, on gloo
    serially with compute. Profiling the wrapped model times each stage with them, as the
    engine overlaps them or not: with ``with_times_of`` the per-rank problem keeps its
    memory and takes these times. Its memory figures are not used (the live-storage
    tracker does not follow FSDP2's parameters). ``wrap="fsdp"`` shards every stage and
    then the root (as :func:`shard_stages` without a plan); ``"ddp"`` profiles the DDP
    wrapper, whose stage paths start with ``module.``. Every rank must call it together.
    """
    from remat.profiling.profiler import profile

    if wrap not in STRATEGIES:
        raise UsageError(f"wrap={wrap!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if wrap == "fsdp":
        shard_stages(model, stages)
        target, names = model, list(stages)
    else:
        target, names = wrap_ddp(model), [f"module.{name}" for name in stages]
    return profile(target, batch, loss_fn, stages=names,
                   optimizer=optimizer, repeats=repeats, ranks_agree=True)


def allocated_bytes(fn: Callable[[], Any], *, cuda: bool = False) -> tuple[Any, int]:
    """``fn()`` and the bytes it allocated that are still alive when it returns.

    The sum of the events recorded on this thread: a block freed after ``fn`` returns, or
    by a thread without the profiler's state, still counts. So what a wrapper keeps
    between steps is not read this way (gloo could hold DDP's old buckets past ``fn``):
    :func:`ddp_bucket_bytes` reads DDP's from its reducer.
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


def ddp_bucket_bytes(ddp: nn.Module) -> int:
    """Bytes of DDP's gradient buckets as its reducer lays them out now (one buffer each).

    Call it after :func:`warm_ddp` (DDP lays its buckets out again in its second step).
    The reducer's own buffers are not reachable from Python; it hands out zeroed buffers
    of their sizes, which are read and dropped here.
    """
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_get_zeros_like_grad_buckets"):
        raise UsageError(
            f"{type(ddp).__name__} has no DDP reducer to read the buckets from; pass the "
            "DistributedDataParallel module wrap_ddp returned"
        )
    sizes = []
    for bucket in reducer._get_zeros_like_grad_buckets():
        buffer = bucket.buffer()
        sizes.append(buffer.numel() * buffer.element_size())
    return sum(sizes)


def plan_rank_peak(model: nn.Module, batch: Any, loss_fn: Callable[..., Any], plan: Plan, *,
                   wrap: str, stages: Sequence[str], optimizer: str = "adamw",
                   group_regions: bool = True) -> tuple[int, int]:
    """This rank's peak of one training step with ``plan``, wrapped by ``wrap`` (``ddp``:
    the plan, then the wrapper; ``fsdp``: :func:`shard_stages`, then the plan), and the
    bytes the wrapper keeps outside the step (DDP's gradient buckets; 0 for FSDP2).
    ``group_regions``: FSDP2 units as :func:`shard_stages` makes them for ``plan`` (a stage
    inside a multi-stage region sharded by its children); False: one unit per stage, the
    common wrapping.

    :func:`plan_rank_memory` has the other figures of the same measurement.
    """
    memory = plan_rank_memory(model, batch, loss_fn, plan, wrap=wrap, stages=stages,
                              optimizer=optimizer, group_regions=group_regions)
    return memory.peak_bytes, memory.resident_bytes


def plan_rank_memory(model: nn.Module, batch: Any, loss_fn: Callable[..., Any], plan: Plan, *,
                     wrap: str, stages: Sequence[str], optimizer: str = "adamw",
                     group_regions: bool = True) -> EventStepMemory:
    """:func:`plan_rank_peak` with every figure of the measurement (:class:`EventStepMemory`)."""
    from remat.measure.step import make_optimizer
    from remat.runtime.install import apply

    if wrap not in STRATEGIES:
        raise UsageError(f"wrap={wrap!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if wrap == "fsdp":
        shard_stages(model, stages, plan if group_regions else None)
    apply(model, plan)
    opt = make_optimizer(model, optimizer)
    if wrap == "fsdp":
        return rank_step_memory(model, batch, loss_fn, opt)
    ddp = wrap_ddp(model)
    warm_ddp(ddp, batch, loss_fn, opt)
    return rank_step_memory(ddp, batch, loss_fn, opt, warmup_steps=0,
                            resident_bytes=ddp_bucket_bytes(ddp))


def _local_storages(*objects: Any) -> dict[int, int]:
    """Address to bytes of the distinct storages this rank holds for the objects' tensors."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for obj in objects:
        for t in iter_tensors(obj):
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return seen


def local_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages this rank holds for the objects' tensors.

    A DTensor (an FSDP2 parameter, its gradient or optimizer state) counts its local shard.
    """
    return sum(_local_storages(*objects).values())


#: The profiler annotation around the measured step; the thread it opens on is the step's.
_STEP_MARK = "remat::rank_step"


def rank_step_peak(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 2,
    resident_bytes: int = 0,
) -> int:
    """Peak bytes of one whole training step on this rank (:func:`rank_step_memory`)."""
    return rank_step_memory(model, batch, loss_fn, optimizer, warmup_steps=warmup_steps,
                            resident_bytes=resident_bytes).peak_bytes


def rank_step_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 2,
    resident_bytes: int = 0,
    attempts: int = 8,
) -> EventStepMemory:
    """One whole training step on this rank, from the allocator's events.

    remat's live-storage tracker is a dispatch mode and does not follow FSDP2 (its
    parameters are DTensors whose gathered storage is resized in place, outside any
    op), so a rank's step is measured like a compiled one: the bytes alive at the start
    (:func:`local_bytes` of parameters, buffers, optimizer state and batch, plus
    ``resident_bytes`` such as DDP's gradient buckets, :func:`ddp_bucket_bytes`) plus
    the step's allocations and frees as torch.profiler records them during forward,
    backward and optimizer step, after ``warmup_steps`` steps, accounted by address and
    thread (Note [Steady per-rank peaks]). A step in which a block of the step's went
    without its free event is recorded again, up to ``attempts`` steps, until every rank
    has a clean reading; a rank keeps its first clean one (else its lowest). Every rank
    must call it (the step runs collectives).
    """
    from torch.profiler import record_function

    def step() -> None:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if attempts < 1:
        raise UsageError(f"attempts={attempts} records no step; give 1 or more")
    for _ in range(warmup_steps):
        step()
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    lowest: EventStepMemory | None = None
    clean: EventStepMemory | None = None
    for attempt in range(1, attempts + 1):
        gc.collect()
        state = [t for s in optimizer.state.values() for t in iter_tensors(s)]
        storages = _local_storages(list(model.parameters()), list(model.buffers()), state, batch)
        start = resident_bytes + sum(storages.values())
        with AllocatorEvents(device) as recording, record_function(_STEP_MARK):
            step()
        events, step_threads = recording.allocations(_STEP_MARK)
        memory = dataclasses.replace(
            account_step(start, storages, events, step_threads, resident_bytes=resident_bytes),
            attempts=attempt,
        )
        if lowest is None or memory.peak_bytes < lowest.peak_bytes:
            lowest = memory
        if clean is None and memory.unmatched_bytes == 0:
            clean = memory
        if on_every_rank(clean is not None, cuda):  # every rank runs as many steps
            break
    chosen = clean or lowest
    assert chosen is not None
    return chosen


class DataParallelRank:
    """One rank of a data-parallel ``torchrun`` job: its strategy (``ddp`` or ``fsdp``),
    its place, and the profiled stages, each an FSDP2 unit.

    Every rank builds the same model (same seed) and takes its shard of the batch
    (:meth:`shard`). A plan goes on between :meth:`shard_before_plan` (FSDP2, which
    replaces the parameters the optimizer takes, shards first) and :meth:`wrap_after_plan`
    (DDP wraps the model the plan was applied to).
    """

    def __init__(self, strategy: str, info: RankInfo) -> None:
        self.strategy = strategy
        self.info = info
        self.stages: tuple[str, ...] = ()

    def shard(self, factory: Factory) -> Factory:
        """``factory`` with this rank's share of its batch (:func:`shard_batch`)."""

        def sharded(batch_size: int | None) -> Any:
            model, batch, loss_fn = factory(batch_size)
            return model, shard_batch(batch, self.info.rank, self.info.world_size), loss_fn

        return sharded

    def shard_before_plan(self, model: nn.Module, plan: Plan | None) -> None:
        """FSDP2: every stage a unit, then the root (:func:`shard_stages`); DDP: nothing."""
        if self.strategy == "fsdp":
            shard_stages(model, self.stages, plan)

    def wrap_after_plan(self, model: nn.Module, batch: Any, loss_fn: Callable[..., Any],
                        optimizer: torch.optim.Optimizer) -> tuple[nn.Module, int]:
        """The module a step runs and the bytes its wrapper keeps between steps: DDP's
        wrapper, warmed until its buckets are laid out (:func:`warm_ddp`), and their bytes;
        FSDP2's model as it is, and 0."""
        if self.strategy != "ddp":
            return model, 0
        ddp = wrap_ddp(model)
        warm_ddp(ddp, batch, loss_fn, optimizer)
        return ddp, ddp_bucket_bytes(ddp)


def rank_problem(problem: Problem, rank: DataParallelRank, factory: Factory, optimizer: str,
                 repeats: int = 2) -> Problem:
    """The per-rank problem (:func:`remat.core.transforms.per_rank_problem`), with this
    job's largest measured peak without checkpointing, so that budgets given as fractions
    mean fractions of what a rank holds, and every rank plans the same; its times are
    rank 0's profile of the wrapped model (Note [Per-rank time] in :func:`profile_as_run`).
    Every rank must call it together."""
    import torch.distributed as dist

    from remat.core.planner import to_problem
    from remat.core.transforms import per_rank_problem, with_times_of
    from remat.measure.step import make_optimizer

    from .gathers import time_unit_gathers
    from .ranks import rank_zeros

    model, batch, loss_fn = factory(None)
    rank.shard_before_plan(model, None)
    opt = make_optimizer(model.train(), optimizer)
    target, resident = rank.wrap_after_plan(model, batch, loss_fn, opt)
    try:
        peak = rank_step_peak(target, batch, loss_fn, opt, resident_bytes=resident)
    finally:
        opt.zero_grad(set_to_none=True)

    largest = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # one budget, so one plan, on every rank
    peak = int(largest.item())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    del model, target, opt
    model, batch, loss_fn = factory(None)
    timed = to_problem(profile_as_run(model, batch, loss_fn, wrap=rank.strategy,
                                      stages=rank.stages, optimizer=optimizer,
                                      repeats=repeats))
    timed = rank_zeros(timed)  # one set of times, so one plan
    gathers: list[float] | float = 0.0
    if rank.strategy == "fsdp":  # what resharding a unit after a rebuild pays again
        shared: list[Any] = [time_unit_gathers(model, rank.stages)]
        dist.broadcast_object_list(shared, src=0)
        gathers = shared[0]
    sharded = per_rank_problem(problem, world_size=rank.info.world_size,
                               strategy=rank.strategy, replicated_bytes=buffers,
                               backend=dist.get_backend(), gather_s=gathers)
    return dataclasses.replace(with_times_of(sharded, timed),
                               measured_no_checkpoint_peak_bytes=peak)
