"""Collectives under tensor and sequence parallelism: what a training step issues per
stage, and what a rebuild issues again.

Under tensor parallelism (DTensor's ``parallelize_module``) a block's forward
communicates: with sequence parallelism each attention and MLP all-gathers its
sequence-sharded input and reduce-scatters its output; without it, all-reduces the
output. A region's rebuild runs the forward again, and with it the collectives it needs
before torch's early stop ends the rebuild (the input all-gathers, and an output
reduce-scatter that a later op of the block needs; not the block's last one). Every
collective DTensor issues goes through torch's functional collectives
(``torch.ops._c10d_functional``), so one dispatch mode sees them all: :func:`count_collectives`
runs one training step of the model as it is (with a remat plan applied or not) and
files each collective under the stage whose forward issued it, in the forward or in a
rebuild during backward, or outside the stages (the embedding's and the head's) or in
the backward's own work (the gradients' collectives).

``selective:save-collectives`` (:data:`remat.runtime.policies.COLLECTIVE_OPS`) saves their
outputs: the stage is rebuilt in backward without communicating again (measured: per
stage none, against two all-gathers and a reduce-scatter per block for a region;
``docs/tensor-parallel.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.core.collectives import StageComms
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.measure.tracker import iter_tensors

__all__ = ["Collective", "CollectiveCount", "StageCollectives", "agreed_plan",
           "count_collectives", "init_fake_ranks", "stage_comms"]

#: Functional ops that are not collectives of their own (a wait, the autograd wrapper).
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


@dataclass(frozen=True)
class Collective:
    """One collective call: its op (``all_gather_into_tensor``) and the bytes of its
    output on this rank (an all-gather's gathered tensor, a reduce-scatter's shard)."""

    op: str
    bytes: int


def _total(calls: Sequence[Collective]) -> int:
    return sum(c.bytes for c in calls)


@dataclass(frozen=True)
class StageCollectives:
    """What one stage's forward issued, and what its rebuilds issued again in backward."""

    forward: tuple[Collective, ...] = ()
    rebuild: tuple[Collective, ...] = ()

    @property
    def forward_bytes(self) -> int:
        return _total(self.forward)

    @property
    def rebuild_bytes(self) -> int:
        return _total(self.rebuild)


@dataclass(frozen=True)
class CollectiveCount:
    """One training step's collectives on this rank (module docstring)."""

    stages: Mapping[str, StageCollectives]
    outside_forward: tuple[Collective, ...] = ()  # forward, outside every stage
    backward: tuple[Collective, ...] = ()  # backward, outside every rebuild
    early_stop: bool = True  # torch's checkpoint early stop, as the step ran
    by_op: Mapping[str, int] = field(default_factory=dict)  # calls per op, in all

    @property
    def rebuilt(self) -> int:
        """Collectives issued again by rebuilds, over every stage."""
        return sum(len(s.rebuild) for s in self.stages.values())

    @property
    def rebuilt_bytes(self) -> int:
        return sum(s.rebuild_bytes for s in self.stages.values())


class _Recorder(TorchDispatchMode):
    """Files every functional collective under the innermost stage running and the phase."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.backward = False
        self.calls: list[tuple[str | None, bool, Collective]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            name = func._opname
            if name not in _NOT_COLLECTIVES:
                nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(out))
                stage = self.stack[-1] if self.stack else None
                self.calls.append((stage, self.backward, Collective(name, nbytes)))
        return out


class _Observer:
    """The runtime's stage observer (a model with a plan applied): it hears region
    rebuilds and selective replays, which call the stage's code without its hooks."""

    def __init__(self, recorder: _Recorder, names: Sequence[str]) -> None:
        self.recorder, self.names = recorder, names

    def stage_started(self, stage: int, rebuild: bool, args: Any, kwargs: Any) -> None:
        self.recorder.stack.append(self.names[stage])

    def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None:
        if self.recorder.stack:
            self.recorder.stack.pop()


@contextlib.contextmanager
def _stage_hooks(model: nn.Module, stages: Sequence[str], recorder: _Recorder
                 ) -> Iterator[None]:
    from remat.runtime.install import applied, applied_stages, observe

    modules = dict(model.named_modules())
    for name in stages:
        if name not in modules:
            raise UsageError(f"stage {name!r} is not a submodule of the model; give module "
                             "paths from model.named_modules()")
    if applied(model):
        names = applied_stages(model)
        if set(names) != set(stages):
            raise UsageError(f"the plan applied to the model has stages {list(names)}, not "
                             f"{list(stages)}; count with the plan's stages")
        with observe(model, _Observer(recorder, names)):
            yield
        return
    handles = []
    for name in stages:
        def enter(_m: nn.Module, _args: Any, name: str = name) -> None:
            recorder.stack.append(name)

        def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
            if recorder.stack:
                recorder.stack.pop()

        handles.append(modules[name].register_forward_pre_hook(enter))
        handles.append(modules[name].register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def count_collectives(model: nn.Module, batch: Any,
                      loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                      stages: Sequence[str]) -> CollectiveCount:
    """Run one forward and backward of ``model`` (as it is: plain, or with a remat plan
    applied) on ``batch`` and file each functional collective it issues (module
    docstring). The parameters' gradients are left as the step made them; every rank of
    the model's mesh must call this together."""
    recorder = _Recorder()
    with _stage_hooks(model, stages, recorder), recorder:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError("loss_fn must return a scalar tensor")
        recorder.backward = True
        recorder.stack.clear()
        loss.backward()
    forward: dict[str, list[Collective]] = {name: [] for name in stages}
    rebuild: dict[str, list[Collective]] = {name: [] for name in stages}
    outside: list[Collective] = []
    backward: list[Collective] = []
    by_op: dict[str, int] = {}
    for stage, in_backward, call in recorder.calls:
        by_op[call.op] = by_op.get(call.op, 0) + 1
        if stage is None:
            (backward if in_backward else outside).append(call)
        else:
            (rebuild if in_backward else forward)[stage].append(call)
    return CollectiveCount(
        stages=MappingProxyType({name: StageCollectives(tuple(forward[name]),
                                                        tuple(rebuild[name]))
                                 for name in stages}),
        outside_forward=tuple(outside),
        backward=tuple(backward),
        by_op=MappingProxyType(by_op),
    )


def stage_comms(model: nn.Module, batch: Any,
                loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                stages: Sequence[str]) -> list[StageComms]:
    """Per stage, what its forward issues and what its rebuild as a one-stage region
    issues again (:class:`remat.core.collectives.StageComms`), from two training steps:
    one as the model is, one with every stage in a region of its own. Then
    :func:`remat.core.collectives.rebuilt_collectives` predicts any plan's. ``model``
    must have no plan applied; its gradients are left as the second step made them."""
    from remat.core.plan_format import Region
    from remat.runtime.install import applied, apply, remove

    if applied(model):
        raise UsageError("stage_comms measures the model without a plan; remat.remove it "
                         "first")
    plain = count_collectives(model, batch, loss_fn, stages)
    model.zero_grad(set_to_none=True)
    apply(model, Plan(tuple(stages), tuple(Region(i, i + 1) for i in range(len(stages)))))
    try:
        regions = count_collectives(model, batch, loss_fn, stages)
    finally:
        remove(model)
    return [StageComms(tuple((c.op, c.bytes) for c in plain.stages[name].forward),
                       tuple((c.op, c.bytes) for c in regions.stages[name].rebuild))
            for name in stages]


def agreed_plan(plan: Plan, group: Any = None) -> Plan:
    """The plan of the group's first rank, on every rank of ``group`` (default: the
    default group). Ranks that share a tensor-parallel mesh must rebuild the same stages,
    or one rank's rebuild waits for collectives the others never issue; their profiles
    differ by timing noise, so plans made from them can differ. Every rank of the group
    must call this together."""
    import torch.distributed as dist

    shared: list[Any] = [plan.to_dict() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return Plan.from_dict(shared[0])


def init_fake_ranks(world_size: int, rank: int = 0) -> None:
    """Make this process rank ``rank`` of ``world_size`` on torch's fake process group:
    collectives return at once without moving data, so one process builds and profiles
    one rank of a tensor-parallel model (under :func:`remat.fake_mode`, without its
    weights) for a mesh of any size: ``init_device_mesh("cpu", (world_size,))`` then
    parallelize and ``remat.profile(..., fake=True)``. The values it computes are
    wrong; the shapes, and so every byte a profile records, are the real rank's."""
    import torch.distributed as dist

    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"{name}={value!r} must be a whole number >= {low}")
    if rank >= world_size:
        raise UsageError(f"rank {rank} is outside 0..{world_size - 1}")
    if dist.is_initialized():
        raise UsageError("a process group is already initialized in this process; fake "
                         "ranks need a process of their own")
    # torch registers its fake backend only in its testing package (no public constructor
    # exists in torch 2.13): importing it is the registration
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank,
                            world_size=world_size)
