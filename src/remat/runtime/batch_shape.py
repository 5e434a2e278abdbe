"""Which plan of a plan set a forward runs: the batch's shape read off its inputs.

The plan set says, per dimension, which tensor of the forward's inputs (its position
among the tensors of the args, then the kwargs, in :func:`tensors_of`'s order) and which
axis carries it (Note [Plan sets] in remat.core.plan_set); :class:`ShapeHook`, the root's
first forward pre-hook, reads them and tells the engine which plan to run.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_set import PlanSet
from remat.runtime.engine import EngineCallable

__all__ = ["ShapeHook", "tensors_of"]


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch or of a forward's inputs in a fixed order: a tensor, or
    lists, tuples and mappings (transformers' ``BatchEncoding`` included) of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_of(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensors_of(item)


class ShapeHook(EngineCallable):
    """The root's forward pre-hook (with kwargs) that picks the plan for the batch's shape
    before the pass begins; only training forwards with grad choose (others run no plan)."""

    def __init__(self, engine: Any, plan_set: PlanSet) -> None:
        self.engine = engine
        self.plan_set = plan_set
        self.keys = tuple(plan_set.inputs[name] for name in plan_set.dims.names)
        self.chosen: dict[tuple[int, ...], int] = {}
        self.warned = False

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        tensors = list(tensors_of((args, kwargs)))
        try:
            shape = tuple(int(tensors[k].shape[axis]) - offset
                          for k, axis, offset in self.keys)
        except IndexError:
            raise UsageError(
                f"the plan set reads the batch's {', '.join(self.plan_set.dims.names)} off "
                "the model's inputs, and this forward's inputs do not have them; call the "
                "model as it was called when profiled") from None
        k = self.chosen.get(shape)
        if k is None:
            k = self._choose(shape)
            self.chosen[shape] = k
        self.engine.use(k)

    def _choose(self, shape: tuple[int, ...]) -> int:
        found = self.plan_set.choose(shape)
        if found is not None:
            return found
        dims = self.plan_set.dims
        where = dims.shape_text(shape)
        if self.plan_set.outside == "error":
            off_step = [d for d, v in zip(dims.dims, shape, strict=True)
                        if d.lo <= v <= d.hi and not d.holds(v)]
            refused = self.plan_set.between_refused
            why = ""
            if off_step and dims.spans(shape):
                why = (" (between its ends, but not on its steps: "
                       + ", ".join(f"{d.name} in steps of {d.step}" for d in off_step)
                       + "; a range inferred from batches takes the step they share"
                       + (f"; shapes between the steps are outside: {refused}" if refused
                          else "") + ")")
            raise UsageError(
                f"a batch of {where} is outside the plan set's range {dims}{why}, where no "
                "plan was predicted to fit; plan a range that holds it, or apply the plan set "
                "with outside='conservative'")
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"remat: a batch of {where} is outside the plan set's range {dims}; it runs "
                "the plan of least memory, which was not predicted for it (said once)",
                RuntimeWarning, stacklevel=3)
        return self.plan_set.conservative
