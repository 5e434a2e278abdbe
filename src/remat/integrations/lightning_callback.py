"""remat in Lightning: a callback that plans at the first training batch.

::

    trainer = L.Trainer(callbacks=[RematCallback("60%")])
    trainer.fit(module, loader)

At the first training batch (or ``batch=`` given) :class:`RematCallback` runs
:func:`remat.auto_checkpoint` on the LightningModule (or ``module="net"``, a submodule)
with a loss that is one call of the module's own ``training_step`` (its ``self.log``
calls do nothing while remat profiles, so no metric sees the profile's steps), under
the trainer's precision context, and applies the plan before that batch's forward. The
budget is the peak of a whole training step, as :func:`remat.auto_checkpoint` takes it.

Note [Lightning frees gradients late]: Lightning's automatic optimization zeroes the
gradients *after* the next ``training_step`` (closure: step, ``zero_grad``, backward),
so the previous step's gradients live through the whole next forward, which the plan's
step (gradients freed before the forward) does not count. With ``free_grads=True`` (the
default) the callback sets them to None at the end of every batch the optimizer stepped
in, which is what Lightning's ``zero_grad`` does a few lines later; under gradient
accumulation only at the batches that step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from remat.core.errors import UsageError
from remat.in_script.script_entry import AutoCheckpoint, auto_checkpoint

__all__ = ["RematCallback", "training_step_loss"]


@contextmanager
def _quiet(module: pl.LightningModule) -> Iterator[None]:
    """``module.log``/``log_dict`` doing nothing: the profile's steps log no metric."""
    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = nothing, nothing  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def training_step_loss(module: pl.LightningModule) -> Callable[[nn.Module, Any], torch.Tensor]:
    """``loss_fn(model, batch)``: one ``module.training_step(batch, 0)``, its loss (the
    tensor it returns, or its ``"loss"`` entry), with logging off."""
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with _quiet(module):
            out = module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise UsageError("training_step returned no loss tensor (a tensor or a dict with "
                             "'loss'); pass RematCallback(loss_fn=...) that returns it")
        return loss

    return loss_fn


def _optimizer_name(trainer: pl.Trainer) -> str:
    optimizers = trainer.optimizers
    if optimizers and isinstance(optimizers[0], torch.optim.SGD):
        return "sgd"
    return "adamw"  # Adam and AdamW keep the same state; the default


class RematCallback(pl.Callback):
    """Plan and apply remat at the first training batch; ``done`` holds the
    :class:`remat.AutoCheckpoint` after that.

    ``budget``: bytes, a size (``"12GiB"``) or a fraction of the step's peak without
    checkpointing (``"60%"``). ``module``: the submodule path to plan (default: the
    LightningModule). ``loss_fn(model, batch)``: the step's loss (default:
    :func:`training_step_loss`). ``batch``: plan for this batch instead of the first.
    ``optimizer``: ``adamw``/``adamw-fused``/``sgd`` (default: from the trainer's first
    optimizer). ``free_grads``: Note [Lightning frees gradients late]. The rest as
    :func:`remat.auto_checkpoint`.
    """

    def __init__(
        self,
        budget: str | int | float,
        *,
        module: str | None = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        batch: Any = None,
        optimizer: str | None = None,
        stages: list[str] | tuple[str, ...] | None = None,
        cache: str | os.PathLike[str] | bool | None = None,
        repeats: int = 2,
        free_grads: bool = True,
    ) -> None:
        self.budget = budget
        self.module = module
        self.loss_fn = loss_fn
        self.batch = batch
        self.optimizer = optimizer
        self.stages = stages
        self.cache = cache
        self.repeats = repeats
        self.free_grads = free_grads
        self.done: AutoCheckpoint | None = None

    def _target(self, pl_module: pl.LightningModule) -> nn.Module:
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError:
            raise UsageError(f"the LightningModule has no submodule {self.module!r}; pass "
                             "module= a path from named_modules(), or None for the whole "
                             "module") from None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.done is not None:
            return
        target = self._target(pl_module)
        loss_fn = self.loss_fn or training_step_loss(pl_module)
        called: dict[str, int] = {}
        hooks = [m.register_forward_pre_hook(lambda *_, name=name: called.update(
                     {name: called.get(name, 0) + 1}))
                 for name, m in (("", target), *target.named_children())]
        try:
            with trainer.precision_plugin.train_step_context():
                done = auto_checkpoint(
                    target, self.budget, batch=batch if self.batch is None else self.batch,
                    loss_fn=loss_fn, optimizer=self.optimizer or _optimizer_name(trainer),
                    stages=self.stages, cache=self.cache, repeats=self.repeats)
        finally:
            for hook in hooks:
                hook.remove()
        if "" not in called and done.plan.stages and self.loss_fn is None:
            # a plan runs from the forward of the module it is applied to (one pass per
            # call); a training_step that never calls that forward never runs it
            done.remove()
            raise UsageError(
                f"training_step does not call {type(target).__name__}'s forward, so a "
                "plan on it would never run; pass RematCallback(module=...) the submodule "
                f"it calls ({', '.join(repr(n) for n in called) or 'none was called'})")
        self.done = done

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.free_grads or not pl_module.automatic_optimization:
            return
        every = trainer.accumulate_grad_batches
        last = trainer.num_training_batches
        if (batch_idx + 1) % every == 0 or batch_idx + 1 == last:
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The plan stays applied after fit (``callback.done.remove()`` takes it off)."""
