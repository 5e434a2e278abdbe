"""Each row's set-up: a fresh model with a plan applied by remat, or a compiled model.

The ``hf-gc`` row is a transformers model with its own
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
instead of a remat plan; its plan (remat's per-stage plan, the same regions: one per
decoder layer) carries the solver name ``hf-gc`` and only supplies the prediction.

A runner owns one model, its batch, loss and optimizer, and knows how to run one training
step of its row. Every row gets its own model from the factory (same seed, same weights),
so rows can be interleaved step by step without applying and removing plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.plan_set import PlanSet
from remat.measure.step import make_optimizer
from remat.runtime import Handle, apply
from remat.runtime.compiled_stages import code_copy

__all__ = [
    "HF_GC",
    "CompiledRunner",
    "EagerRunner",
    "Factory",
    "LossFn",
    "Runner",
    "disable_hf_gc",
    "enable_hf_gc",
    "is_hf_gc",
    "supports_hf_gc",
]

LossFn = Callable[[nn.Module, Any], Any]
#: ``factory(batch_size)`` returns ``(model, batch, loss_fn)``; None means the default size.
Factory = Callable[[int | None], tuple[nn.Module, Any, LossFn]]


#: The strategy (and its plan's solver name) that runs transformers' own checkpointing.
HF_GC = "hf-gc"


def is_hf_gc(plan: Plan) -> bool:
    """Whether ``plan`` stands for transformers' own gradient checkpointing (``hf-gc``)."""
    return plan.solver == HF_GC


def supports_hf_gc(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model with its own gradient checkpointing."""
    has = callable(getattr(model, "activation_checkpointing_enable", None)) or callable(
        getattr(model, "gradient_checkpointing_enable", None)
    )
    return has and bool(getattr(model, "supports_gradient_checkpointing", False))


def enable_hf_gc(model: nn.Module) -> None:
    """Turn on transformers' gradient checkpointing, non-reentrant (the ``hf-gc`` row).

    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False})``; transformers 5 renamed it ``activation_checkpointing_enable`` (the old
    name still works, with a FutureWarning), so the new name is used where it exists.
    """
    if not supports_hf_gc(model):
        raise UsageError(
            f"strategy {HF_GC} applies only to transformers models that support "
            f"gradient_checkpointing_enable, and {type(model).__name__} does not; leave "
            f"{HF_GC} out of the strategies"
        )
    new = getattr(model, "activation_checkpointing_enable", None)
    old = getattr(model, "gradient_checkpointing_enable", None)
    kwargs = {"use_reentrant": False}
    if callable(new):
        new(activation_checkpointing_kwargs=kwargs)
    elif callable(old):
        old(gradient_checkpointing_kwargs=kwargs)


def disable_hf_gc(model: nn.Module) -> None:
    """Undo :func:`enable_hf_gc`."""
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        disable = getattr(model, name, None)
        if callable(disable):
            disable()
            return


class Runner:
    """One model, its batch, loss and optimizer; ``step()`` is one whole training step."""

    instrument = "tracker"

    def __init__(self, model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: str) -> None:
        self.model = model.train()
        self.batch = batch
        self.loss_fn = loss_fn
        self.optimizer = make_optimizer(model, optimizer)

    def context(self) -> AbstractContextManager[Any]:
        """What a step of this row runs inside (nothing for eager rows)."""
        return contextlib.nullcontext()

    def loss(self) -> torch.Tensor:
        """The forward pass; call it inside :meth:`context`."""
        loss: torch.Tensor = self.loss_fn(self.model, self.batch)
        return loss

    def step(self) -> None:
        with self.context():
            self.loss().backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class EagerRunner(Runner):
    """The model with ``plan`` applied through remat's runtime (``none``: no regions; a
    plan set: each forward runs its batch's bucket's plan), or for an ``hf-gc`` plan with
    transformers' own checkpointing turned on instead."""

    def __init__(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: str,
        plan: Plan | PlanSet,
    ) -> None:
        super().__init__(model, batch, loss_fn, optimizer)
        self.plan = plan
        self.handle: Handle | None = None
        if isinstance(plan, Plan) and is_hf_gc(plan):
            enable_hf_gc(model)
        else:
            self.handle = apply(model, plan)

    def close(self) -> None:
        super().close()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        elif isinstance(self.plan, Plan) and is_hf_gc(self.plan):
            disable_hf_gc(self.model)


def _fresh_function(model: nn.Module, loss_fn: LossFn, tag: str) -> Callable[[Any], Any]:
    def compiled_loss(batch: Any) -> Any:
        return loss_fn(model, batch)

    # rows sharing one code object would all run the first row's graph (the guards ignore
    # activation_memory_budget): a copy per row gives each its own cache
    return code_copy(compiled_loss, f"compiled_loss_{tag}")


class CompiledRunner(Runner):
    """``torch.compile`` of the forward and loss with ``activation_memory_budget`` set.

    Every step runs inside the configuration patch, so a recompile (or inductor compiling
    the backward lazily) sees the same budget. ``fallback_random`` makes the compiled
    random ops draw from torch's own generator, as eager does, so dropout masks match
    eager and the gradient check compares like with like.
    """

    instrument = "torch.profiler"

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        optimizer: str,
        fraction: float,
        tag: str,
    ) -> None:
        super().__init__(model, batch, loss_fn, optimizer)
        self.fraction = fraction
        self.compiled = torch.compile(_fresh_function(model, loss_fn, tag))

    def context(self) -> AbstractContextManager[Any]:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        stack = contextlib.ExitStack()
        stack.enter_context(functorch_config.patch(activation_memory_budget=self.fraction))
        stack.enter_context(inductor_config.patch(fallback_random=True))
        return stack

    def loss(self) -> torch.Tensor:
        loss: torch.Tensor = self.compiled(self.batch)
        return loss
