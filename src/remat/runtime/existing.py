"""Checkpointing a model already does itself, found before remat adds its own.

A model can arrive checkpointing already, three ways:

1. **A flag on its modules**: transformers' ``gradient_checkpointing_enable()`` (in
   transformers 5 ``activation_checkpointing_enable()``) and diffusers'
   ``enable_gradient_checkpointing()`` set ``module.gradient_checkpointing = True`` on the
   layers (and on containers whose loops check it); the layer then runs its own forward
   under ``torch.utils.checkpoint``.
2. **torch's ``checkpoint_wrapper``**: a ``CheckpointWrapper`` module around a block,
   whose forward is ``torch.utils.checkpoint.checkpoint(inner, ...)``.
3. **A checkpoint call in code**: ``torch.utils.checkpoint.checkpoint(...)`` written into
   a block's forward, or around the block in its parent's loop.

What remat does with each:

- **Profiling** (``remat.profile``, so ``plan``, ``auto`` and ``bench`` too) takes 1 and 2
  off for the whole profile and puts them back exactly afterwards, with a warning saying
  so: the flags are set to False on the modules and then restored attribute by attribute
  (which also keeps ``every_n_layers`` patterns and the user's checkpoint arguments; calling
  ``gradient_checkpointing_disable()`` and ``_enable()`` again would lose them), and each
  wrapper's forward calls the module it wraps directly. The profile and every plan made
  from it describe the model without its own checkpointing; that is what remat replaces.
  3 cannot be taken off from outside, so profiling refuses it with one sentence naming the
  stage and the fix (remove the call).
- **``remat.apply``** refuses 1 and 2 when they touch a stage the plan checkpoints (the
  stage, a module inside it or a container around it) and says how to turn them off. It
  does not switch them off itself: ``remove`` then could not promise to leave the model as
  it found it while the user's own code might turn them on again in between.

How 3 is found: by watching, not by reading code. For one training step, forward
pre-hooks on every module of every stage record which ones run again *during backward*:
only a recomputation runs a module's forward then. This catches every way to checkpoint,
reentrant or not, ``torch.utils.checkpoint`` imported under any name, and other libraries'
recomputation alike, with public module hooks only. The alternatives are weaker:
replacing ``torch.utils.checkpoint.checkpoint`` for one forward misses
``from torch.utils.checkpoint import checkpoint`` done at import time; a TorchFunctionMode
does not see ``checkpoint`` (it is not a torch function) and does not follow backward onto
autograd's device threads; and the saved-tensor-hooks stack is readable only through
private ``torch._C`` calls. Its blind spot: a checkpointed function that calls no module
(pure ``torch.nn.functional`` on parameters) is not seen. The step costs one extra forward
and backward and takes no optimizer step; the parameters' ``.grad``, buffers, the RNG and
the training mode are put back, so the model is exactly as before, whether profiling goes
on or refuses.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.stage_names import module_path
from remat.core.units import first_names
from remat.measure.modes import without_compiled_insides
from remat.runtime.stage_calls import stage_submodule

__all__ = [
    "OwnCheckpointing",
    "check_apply",
    "find",
    "recomputed_stages",
    "refuse_checkpoint_calls",
    "taken_off",
    "without_own_checkpointing",
]

P = ParamSpec("P")
R = TypeVar("R")
_MISSING = object()
_BYPASSED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # wrappers taken off just now


@dataclass(frozen=True)
class OwnCheckpointing:
    """The model's own checkpointing: flagged modules and checkpoint_wrapper modules."""

    flagged: tuple[str, ...] = ()  # paths of modules with gradient_checkpointing True
    wrappers: tuple[str, ...] = ()  # paths of CheckpointWrapper modules
    disable_hint: str = field(default="", compare=False)

    def __bool__(self) -> bool:
        return bool(self.flagged or self.wrappers)

    def describe(self) -> str:
        """E.g. ``transformers' gradient checkpointing (4 modules) and checkpoint_wrapper
        (blocks.0, blocks.1)``."""
        parts = []
        if self.flagged:
            n = len(self.flagged)
            parts.append(f"its gradient_checkpointing flag ({n} module{'s' * (n != 1)})")
        if self.wrappers:
            parts.append(f"torch's checkpoint_wrapper ({_shown(self.wrappers)})")
        return " and ".join(parts)


def _shown(paths: Sequence[str]) -> str:
    return first_names([p or "the model" for p in paths])


def _wrapper_class() -> type[nn.Module] | None:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
        )
    except ImportError:  # a torch built without torch.distributed
        return None
    return CheckpointWrapper


def _disable_hint(model: nn.Module) -> str:
    # transformers 5 renamed gradient_checkpointing_disable (the old name warns)
    names = (
        "activation_checkpointing_disable",
        "gradient_checkpointing_disable",
        "disable_gradient_checkpointing",  # diffusers
    )
    for name in names:
        if callable(getattr(model, name, None)):
            return f"model.{name}()"
    return "setattr(module, 'gradient_checkpointing', False) on those modules"


def find(model: nn.Module) -> OwnCheckpointing:
    """The model's own checkpointing that remat can see without running it (cases 1, 2)."""
    wrapper = _wrapper_class()
    flagged, wrappers = [], []
    for path, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            flagged.append(path)
        if wrapper is not None and isinstance(module, wrapper) and module not in _BYPASSED:
            wrappers.append(path)
    return OwnCheckpointing(tuple(flagged), tuple(wrappers), _disable_hint(model))


def _call_inner(wrapper: nn.Module) -> Callable[..., Any]:
    inner: Callable[..., Any] = getattr(wrapper, "_checkpoint_wrapped_module")  # noqa: B009

    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    return forward


@contextlib.contextmanager
def taken_off(model: nn.Module) -> Iterator[OwnCheckpointing]:
    """Within the block the model's flags are False and its wrappers call their module
    directly; afterwards every attribute is as it was. Yields what was taken off."""
    found = find(model)
    changed: list[tuple[nn.Module, str, Any]] = []  # (module, attribute, previous value)
    try:
        for path in found.flagged:
            module = model.get_submodule(path)
            changed.append(
                (module, "gradient_checkpointing", _own(module, "gradient_checkpointing"))
            )
            setattr(module, "gradient_checkpointing", False)  # noqa: B010 (typed as Tensor | Module)
        for path in found.wrappers:
            module = model.get_submodule(path)
            changed.append((module, "forward", _own(module, "forward")))
            module.forward = _call_inner(module)
            _BYPASSED.add(module)
        yield found
    finally:
        for module, name, previous in reversed(changed):
            _BYPASSED.discard(module)
            if previous is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous


def _own(module: nn.Module, name: str) -> Any:
    """The module's instance attribute ``name``, or _MISSING (a class attribute then)."""
    return module.__dict__.get(name, _MISSING)


def without_own_checkpointing(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``remat.profile``: run it with the model's own checkpointing taken off
    (:func:`taken_off`) and warn when there was some."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        model = args[0] if args else kwargs.get("model")
        if not isinstance(model, nn.Module):
            return fn(*args, **kwargs)  # the function's own check says what is wrong
        with taken_off(model) as found:
            if found:
                fixes = []
                if found.flagged:
                    fixes.append(f"call {found.disable_hint}")
                if found.wrappers:
                    fixes.append("build the model without checkpoint_wrapper")
                warnings.warn(
                    f"the model checkpoints itself through {found.describe()}: that was "
                    "taken off while profiling and put back afterwards, so the profile and "
                    "its plans describe the model without it, and remat.apply refuses "
                    f"until it is off ({' and '.join(fixes)})",
                    stacklevel=2,
                )
            return fn(*args, **kwargs)

    return wrapper


def recomputed_stages(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    stages: Sequence[str],
) -> list[str]:
    """The stages some of whose modules run again during backward in one training step.

    Runs ``loss_fn(model, batch)`` and its backward with forward pre-hooks on every module
    of every stage, then puts back parameters' ``.grad``, buffers, the RNG state and the
    training mode. Call it on a model without a remat plan applied: remat's own rebuilds
    would count.
    """
    owner: dict[int, str] = {}
    for name in stages:
        for module in stage_submodule(model, name).modules():
            owner.setdefault(id(module), name)
    in_backward = False
    reran: dict[str, None] = {}

    def seen(module: nn.Module, _args: Any) -> None:
        if in_backward:
            reran.setdefault(owner[id(module)], None)

    modules = {id(m): m for name in stages
               for _, m in without_compiled_insides(stage_submodule(model, name))}
    handles = [m.register_forward_pre_hook(seen) for m in modules.values()]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            for p in params:
                p.grad = None
            loss = loss_fn(model, batch)
            if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
                in_backward = True
                loss.backward()
            del loss
    finally:
        in_backward = False
        for handle in handles:
            handle.remove()
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)
        model.train(was_training)
    return [name for name in stages if name in reran]


def refuse_checkpoint_calls(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    stages: Sequence[str],
) -> None:
    """UsageError if a stage is recomputed in backward: the model checkpoints it in code."""
    reran = recomputed_stages(model, batch, loss_fn, stages)
    if reran:
        one = len(reran) == 1
        which = (
            f"stage {reran[0]!r} is" if one else f"stages {_shown([repr(s) for s in reran])} are"
        )
        raise UsageError(
            f"{which} recomputed during backward, so the model checkpoints "
            f"{'it' if one else 'them'} itself (torch.utils.checkpoint called in or around "
            "a forward) and remat would checkpoint twice and mismeasure; remove that "
            "checkpoint call from the model (remat's plan replaces it) or leave those stages "
            "out with stages=/--stages"
        )


def _overlap(path: str, stage: str) -> bool:
    """Whether module ``path`` is the stage's module, inside it or a container around it."""
    stage = module_path(stage)
    return (
        path == stage or path.startswith(stage + ".") or path == "" or stage.startswith(path + ".")
    )


def check_apply(model: nn.Module, plan: Plan) -> None:
    """UsageError if the model's own checkpointing touches a stage the plan checkpoints."""
    found = find(model)
    if not found:
        return
    inside = {i for region in plan.regions for i in range(region.start, region.stop)}
    checked = [s for i, s in enumerate(plan.stages) if i in inside or not plan.option(i).is_keep]
    for stage in checked:
        flag = next((p for p in found.flagged if _overlap(p, stage)), None)
        if flag is not None:
            raise UsageError(
                f"the model has its own gradient checkpointing on (gradient_checkpointing is "
                f"True on {flag or 'the model'!r}), so remat would checkpoint stage "
                f"{stage!r} twice; turn it off with {found.disable_hint} before remat.apply "
                "(remat's plan replaces it)"
            )
        wrapped = next((p for p in found.wrappers if _overlap(p, stage)), None)
        if wrapped is not None:
            raise UsageError(
                f"module {wrapped or 'the model'!r} is wrapped in torch's checkpoint_wrapper, "
                f"so remat would checkpoint stage {stage!r} twice; build the model without "
                "checkpoint_wrapper before remat.apply (remat's plan replaces it)"
            )
