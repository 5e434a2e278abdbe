"""Plans on data-parallel ranks: DDP and FSDP2 set-up, all-gather counts, per-rank peaks.

A remat plan applies to each rank's model like to a single-process one; these helpers
do the rest of the set-up the way ``docs/distributed.md`` describes it, and measure what
the per-rank cost model (:func:`remat.core.transforms.per_rank_problem`, torch-free)
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
region's rebuild until its own backward, unless the plan reshards them after the rebuild
(``Plan.reshard_after_rebuild``: ``remat/runtime/fsdp_units.py``), one more all-gather each.

Note [Steady per-rank peaks]
----------------------------
:func:`rank_step_memory` reads a rank's step from torch.profiler's allocator events,
which record every allocation and free made on a thread that carries the profiler's
state, the step's own thread and the threads a collective runs on alike. Summed in
time order they gave a different peak from run to run of the same code: what other
threads allocate lands before or after the step's own high point as the scheduler
decides, and a free of a block allocated before the recording (whose size the profiler
still knows from an earlier recording) lowers the sum although the start never counted
it. So the events are read with their addresses and threads and accounted by address:

- the step's threads (the one that ran the step, and any that ran autograd's engine) make
  the peak: the bytes alive at the start plus the highest running sum of their
  allocations and of the frees of those allocations or of storages counted at the start;
- what other threads allocate (gloo's workers) is reported apart, as the most they held
  at once (``other_thread_bytes``), and not added: the per-rank problem does not model
  a backend's internal copies, and where they fall against the step's peak is timing;
- a free of a block that was neither counted at the start nor allocated in the step is
  a leftover of earlier work, left out (``ignored_free_bytes`` says how much);
- a block allocated again at an address still held was freed where no event recorded it,
  so it leaves the sum then.

That last case is the one the accounting cannot place in time: a gloo collective's work
object holds its tensors (FSDP2's all-gather output, its reduce-scatter input), and when
the worker thread drops the work after the step's thread dropped the tensor, the block
is freed on a thread without the profiler's state and no event says so (2 gloo ranks,
FSDP2 with one region per block: in about one step of three, one block's parameters or
gradients, 199,936 bytes, stayed in the sum until its address came back, +6%). A missing
free can only raise a reading, and a clean step shows none: nothing the step's threads
allocated is found again at its address or still counted at the end of a whole training
step. So :func:`rank_step_memory` records the step again until every rank has a clean
reading (all ranks run the same steps) and reports how many it took.

What a wrapper keeps between steps is counted from the wrapper itself, not from the
events of the steps that built it: DDP's buckets are read from its reducer
(:func:`ddp_bucket_bytes`), since an old layout's buckets are freed by whichever thread
drops the last reference, with or without an event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.measure.allocator_events import AllocatorEvents
from remat.measure.tracker import iter_tensors
from remat.runtime.stage_calls import stage_submodule

__all__ = [
    "STRATEGIES",
    "Allocation",
    "GatherCount",
    "RankInfo",
    "StepMemory",
    "allocated_bytes",
    "count_all_gathers",
    "count_reduce_scatters",
    "ddp_bucket_bytes",
    "env_rank",
    "init_from_env",
    "local_bytes",
    "plan_rank_memory",
    "plan_rank_peak",
    "profile_as_run",
    "rank_step_memory",
    "rank_step_peak",
    "shard_batch",
    "shard_stages",
    "time_all_gather",
    "time_unit_gathers",
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
                     group_regions: bool = True) -> StepMemory:
    """:func:`plan_rank_peak` with every figure of the measurement (:class:`StepMemory`)."""
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


@dataclass(frozen=True)
class Allocation:
    """One allocator event: ``nbytes`` > 0 allocates the block at ``ptr``, < 0 frees it.

    ``thread`` is the profiler's number for the thread that made it (not the OS's).
    """

    time_ns: int
    nbytes: int
    ptr: int
    thread: int


@dataclass(frozen=True)
class StepMemory:
    """One rank's training step, read from the allocator's events by address and thread.

    Note [Steady per-rank peaks] says what each figure counts.
    """

    #: The bytes alive at the start plus the highest running sum of the step's threads.
    peak_bytes: int
    #: What was alive at the start: this rank's storages and ``resident_bytes``.
    start_bytes: int
    #: What the wrapper keeps between steps (DDP's buckets), included in ``start_bytes``.
    resident_bytes: int
    #: The most bytes that threads other than the step's (gloo's workers) held at once.
    other_thread_bytes: int
    #: Frees of blocks neither counted at the start nor allocated in the step.
    ignored_free_bytes: int
    #: The reading before the accounting: the start plus the running sum of every event
    #: in time order, whatever its thread or address (for comparison only).
    summed_peak_bytes: int
    #: Bytes the step's threads allocated whose free no event recorded (found again at the
    #: same address, or still counted when the step ended); 0 in a clean reading.
    unmatched_bytes: int = 0
    #: Steps recorded to get this reading (the first clean one, else the lowest).
    attempts: int = 1


#: The profiler annotation around the measured step; the thread it opens on is the step's.
_STEP_MARK = "remat::rank_step"
#: The autograd engine's per-node annotation; its threads run the step's backward (CUDA).
_ENGINE_MARK = "autograd::engine::evaluate_function"


def _allocations(prof: Any, device: torch.device) -> tuple[list[Allocation], set[int]]:
    """Every allocator event on ``device`` in time order, and the threads that ran the step.

    Read from the profiler's event tree, which has each event's address and thread.
    """
    from torch._C._profiler import _EventType

    events: list[Allocation] = []
    step_threads: set[int] = set()
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        kind, fields = event.typed
        if kind == _EventType.Allocation:
            if fields.device.type == device.type and (
                device.index is None or fields.device.index == device.index
            ):
                events.append(
                    Allocation(event.start_time_ns, fields.alloc_size, fields.ptr, event.start_tid)
                )
        elif kind == _EventType.TorchOp and (
            event.name == _STEP_MARK or event.name.startswith(_ENGINE_MARK)
        ):
            step_threads.add(event.start_tid)
    events.sort(key=lambda e: e.time_ns)
    return events, step_threads


def account_step(start_bytes: int, start_storages: dict[int, int],
                 events: Iterable[Allocation], step_threads: set[int], *,
                 resident_bytes: int = 0) -> StepMemory:
    """A step's figures from its allocator events (Note [Steady per-rank peaks]).

    ``start_storages`` maps the address of each storage counted in ``start_bytes`` to its
    bytes, so that a free of one of them lowers the sum and a free of anything else older
    than the step does not.
    """
    live: dict[int, tuple[int, bool]] = {}  # address -> (bytes, allocated by the step)
    known = dict(start_storages)
    held = {True: 0, False: 0}
    highest = {True: 0, False: 0}
    ignored = summed = highest_summed = unmatched = 0
    for event in events:
        summed += event.nbytes
        highest_summed = max(highest_summed, summed)
        if event.nbytes > 0:
            stale = live.pop(event.ptr, None)  # freed where no event recorded it
            if stale is not None:
                held[stale[1]] -= stale[0]
                unmatched += stale[0] if stale[1] else 0
            elif event.ptr in known:
                held[True] -= known.pop(event.ptr)
            mine = event.thread in step_threads
            live[event.ptr] = (event.nbytes, mine)
            held[mine] += event.nbytes
            highest[mine] = max(highest[mine], held[mine])
        elif event.ptr in live:
            nbytes, mine = live.pop(event.ptr)
            held[mine] -= nbytes
        elif event.ptr in known:
            held[True] -= known.pop(event.ptr)
        else:
            ignored -= event.nbytes
    return StepMemory(
        peak_bytes=start_bytes + highest[True],
        start_bytes=start_bytes,
        resident_bytes=resident_bytes,
        other_thread_bytes=highest[False],
        ignored_free_bytes=ignored,
        summed_peak_bytes=start_bytes + highest_summed,
        unmatched_bytes=unmatched + sum(n for n, mine in live.values() if mine),
    )


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
) -> StepMemory:
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
    lowest: StepMemory | None = None
    clean: StepMemory | None = None
    for attempt in range(1, attempts + 1):
        gc.collect()
        state = [t for s in optimizer.state.values() for t in iter_tensors(s)]
        storages = _local_storages(list(model.parameters()), list(model.buffers()), state, batch)
        start = resident_bytes + sum(storages.values())
        with AllocatorEvents(device) as recording, record_function(_STEP_MARK):
            step()
        events, step_threads = _allocations(recording.profile, device)
        memory = dataclasses.replace(
            account_step(start, storages, events, step_threads, resident_bytes=resident_bytes),
            attempts=attempt,
        )
        if lowest is None or memory.peak_bytes < lowest.peak_bytes:
            lowest = memory
        if clean is None and memory.unmatched_bytes == 0:
            clean = memory
        if _on_every_rank(clean is not None, cuda):  # every rank runs as many steps
            break
    chosen = clean or lowest
    assert chosen is not None
    return chosen


def _on_every_rank(flag: bool, cuda: bool) -> bool:
    """``flag`` and the same on every rank of the default group (just ``flag`` without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    votes = torch.tensor([int(flag)], device="cuda" if cuda else "cpu")
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return bool(votes.item())
