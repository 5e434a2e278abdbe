"""A plan's regions written into the model as checkpoint calls Dynamo can trace.

``remat.apply`` runs regions through remat's engine, which ``torch.compile`` sees as one
opaque call per stage (docs/compile.md), so a whole-model compile compiles little around
an applied plan. ``trace_regions`` instead gives each region's first stage a forward that
runs the region's stages inside one ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` call, and the region's other stages a forward that passes their
input through; ``torch.compile`` of the whole model then traces each region as a
checkpoint in its one graph. Measured on the built-in gpt and mlp-hetero
(``benchmarks/compile_traced.md``): lower peaks and shorter steps than compile's own
``activation_memory_budget`` below 1.0, with eager's gradients.

What it takes, each checked before the model is touched (one UsageError otherwise):

- regions over consecutive entries of one ``nn.ModuleList`` or ``nn.Sequential``, not
  nested, with ``keep`` on every stage (selective options and offload run on the engine);
- nothing between two stages of a region: one forward of ``loss_fn(model, batch)`` (no
  grad) checks that each stage's only input is the previous stage's output. A loop like
  ``for b in blocks: x = x + b(x)`` has code between its stages, and running the region's
  stages back to back would compute something else;
- no module in a region that updates running statistics in training (BatchNorm): a
  rebuild would update them a second time, which the engine prevents and a traced
  checkpoint does not;
- stages without a forward of their own already (``remat.compile_stages``, another plan).

``remat.remove(model)`` (or the handle's ``remove()``) puts every stage's forward back.
The plan is not priced for the traced program: a profile prices stages, not the one graph
(inside it a region changes what the partitioner keeps around it; docs/compile.md).
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.core.errors import UsageError, UserCodeError
from remat.core.plan_format import Plan
from remat.runtime.identity import check_made_for
from remat.runtime.install import (
    _APPLIED,
    _MISSING,
    _WRAPPED,
    AppliedPlan,
    _resolve_stages,
    _TracedInstallation,
    check_free,
    check_target,
)

__all__ = ["TracedHandle", "trace_regions"]

_INDEX = re.compile(r"^(.*?)\.?([0-9]+)$")


class TracedHandle(AppliedPlan):
    """Regions written into a model by :func:`trace_regions`; ``remove()`` undoes them."""


def _container_index(model: nn.Module, path: str) -> tuple[str, int]:
    """``(parent path, index)`` of a stage that is an entry of a ModuleList or Sequential."""
    found = _INDEX.match(path)
    if found is not None:
        parent = model.get_submodule(found.group(1)) if found.group(1) else model
        if isinstance(parent, nn.ModuleList | nn.Sequential):
            return found.group(1), int(found.group(2))
    raise UsageError(
        f"stage {path!r} is not an entry of an nn.ModuleList or nn.Sequential; traced regions "
        "need each region's stages to be consecutive entries of one; use remat.apply"
    )


def _check_regions(model: nn.Module, plan: Plan, stages: Sequence[nn.Module]) -> None:
    for i, name in enumerate(plan.stages):
        option = plan.option(i)
        if not option.is_keep:
            raise UsageError(
                f"stage {name!r} has option {option!r}; traced regions run keep only, so use "
                "remat.apply for selective options and offload"
            )
    covered: set[int] = set()
    for region in plan.regions:
        inside = set(range(region.start, region.stop))
        if inside & covered:
            raise UsageError(
                f"region [{region.start}, {region.stop}) overlaps another; traced regions "
                "must not nest (use remat.apply for nested plans)"
            )
        covered |= inside
        places = [_container_index(model, plan.stages[i]) for i in sorted(inside)]
        for (parent, k), (other, j) in itertools.pairwise(places):
            if other != parent or j != k + 1:
                raise UsageError(
                    f"region [{region.start}, {region.stop}) is not consecutive entries of one "
                    f"container ({parent or 'the model'}.{k} then {other or 'the model'}.{j})"
                )
        for i in sorted(inside):
            for sub in stages[i].modules():
                if getattr(sub, "running_mean", None) is not None:  # BatchNorm, InstanceNorm
                    raise UsageError(
                        f"stage {plan.stages[i]!r} holds {type(sub).__name__}, whose running "
                        "statistics a traced rebuild would update twice; use remat.apply, "
                        "which applies them once"
                    )
            if "forward" in stages[i].__dict__:
                raise UsageError(
                    f"stage {plan.stages[i]!r} already has a forward of its own (compiled "
                    "stages, or another tool's wrapper); traced regions compile with the "
                    "whole model, so leave its stages uncompiled"
                )


def _check_nothing_between(model: nn.Module, plan: Plan, stages: Sequence[nn.Module],
                           batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> None:
    """One no-grad forward: in every region, each stage's only input is the output of the
    stage before it (so running them back to back is what the model's code does)."""
    calls: dict[int, list[tuple[tuple[Any, ...], dict[str, Any], Any]]] = {}

    def record(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            calls.setdefault(i, []).append((args, kwargs, out))
        return hook

    inside = sorted({i for r in plan.regions for i in range(r.start, r.stop)})
    hooks = [stages[i].register_forward_hook(record(i), with_kwargs=True) for i in inside]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:  # the caller's random streams stay where they were (dropout draws here)
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            loss_fn(model, batch)
    except Exception as err:
        raise UserCodeError(
            f"loss_fn(model, batch) raised {type(err).__name__}: {err} (the one forward "
            "remat.trace_regions runs to check the regions)"
        ) from err
    finally:
        for hook in hooks:
            hook.remove()
    for region in plan.regions:
        for i in range(region.start, region.stop):
            seen = calls.get(i, [])
            if len(seen) != 1:
                raise UsageError(
                    f"stage {plan.stages[i]!r} ran {len(seen)} times in one forward; traced "
                    "regions need each stage called once; use remat.apply"
                )
            args, kwargs, out = seen[0]
            if kwargs or len(args) != 1 or not isinstance(out, torch.Tensor):
                raise UsageError(
                    f"stage {plan.stages[i]!r} takes or returns more than one tensor; traced "
                    "regions need one tensor in and one out; use remat.apply"
                )
            if i > region.start and args[0] is not calls[i - 1][0][2]:
                raise UsageError(
                    f"stage {plan.stages[i]!r}'s input is not stage {plan.stages[i - 1]!r}'s "
                    "output: the model runs code between them (a residual add, a "
                    "concatenation), which a traced region would skip; use remat.apply"
                )


def trace_regions(model: nn.Module, plan: Plan, batch: Any,
                  loss_fn: Callable[[nn.Module, Any], Any], *,
                  force: bool = False) -> TracedHandle:
    """Write ``plan``'s regions into ``model`` as checkpoint calls (module docstring);
    compile the model (or ``loss_fn``) afterwards to trace them into one graph.

    A plan made for another model is refused as by ``remat.apply`` (``force=True`` writes
    it anyway, with a warning)."""
    check_target(model, plan)
    check_free(model)
    plan.validate()
    stages = _resolve_stages(model, plan)
    notes = check_made_for(model, plan, stages, force=force)
    _check_regions(model, plan, stages)
    _check_nothing_between(model, plan, stages, batch, loss_fn)
    for note in notes:  # before any change: a warning turned into an error leaves no trace
        warnings.warn(note, stacklevel=2)

    # Everything is checked: from here on nothing can fail half-way.
    touched = tuple(stages[i] for r in plan.regions for i in range(r.start, r.stop))
    previous = tuple(m.__dict__.get("forward", _MISSING) for m in touched)
    for region in plan.regions:
        members = [stages[i] for i in range(region.start, region.stop)]
        own = [type(m).forward.__get__(m) for m in members]

        def run(x: torch.Tensor, own: list[Callable[..., Any]] = own) -> torch.Tensor:
            for forward in own:
                x = forward(x)
            return x

        def first(x: torch.Tensor, run: Callable[..., Any] = run,
                  forward: Callable[..., Any] = own[0], lead: nn.Module = members[0]) -> Any:
            if not (torch.is_grad_enabled() and lead.training):
                return forward(x)  # eval and no-grad passes run the stage as written
            return checkpoint(run, x, use_reentrant=False)

        members[0].forward = first
        for m, forward in zip(members[1:], own[1:], strict=True):
            m.forward = _pass_or_run(forward, members[0])
    for m in touched:
        _WRAPPED.add(m)
    installation = _TracedInstallation(touched, previous)
    _APPLIED[model] = installation
    return TracedHandle(model, plan, installation)


def _pass_or_run(forward: Callable[..., Any], lead: nn.Module) -> Callable[..., Any]:
    """A region's later stage: its input passes through in a training pass with grad (the
    region's first stage ran it already), and it runs as written otherwise."""
    def call(x: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and lead.training:
            return x
        return forward(x)
    return call
