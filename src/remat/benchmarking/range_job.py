"""``remat auto --shapes``: the main job over a range of batch shapes.

Profile the range, plan the plan set, then for each plan measure a training step at the
smallest and the largest shape of its bucket with the set applied: the measured peak
against the budget and the prediction, and the gradients against the plain model's from
the same state and seed (bitwise). docs/shapes.md. The pieces (:func:`profile_and_plan`,
:func:`bucket_ends`, :func:`batch_at`, :func:`problem_at`, :func:`grads_equal`) serve
``remat bench --shapes`` too (:mod:`.range_bench`).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.plan_set import PlanSet, plan_set
from remat.core.profile_format import Profile
from remat.core.shape_profiles import at_shape
from remat.core.shapes import Shape, ShapeRange
from remat.core.solve import Problem
from remat.core.solve.budget import Budget
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.simulator import simulate
from remat.measure.step import measure_step
from remat.profiling.shaped import batch_axes, profile_shapes, resize
from remat.runtime.install import apply, remove

__all__ = ["RangeReport", "ShapeRow", "auto_range", "batch_at", "bucket_ends", "grads_equal",
           "problem_at", "profile_and_plan"]


@dataclass(frozen=True)
class ShapeRow:
    """One measured shape: which plan ran, predicted and measured peaks, gradients."""

    shape: Shape
    plan: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    grads_equal: bool

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "plan": self.plan,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "measured_peak_bytes": self.measured_peak_bytes,
                "grads_equal": self.grads_equal}


@dataclass(frozen=True)
class RangeReport:
    profile: Profile
    plan_set: PlanSet
    rows: tuple[ShapeRow, ...]
    profile_s: float

    @property
    def within_budget(self) -> bool:
        return all(r.measured_peak_bytes <= self.plan_set.budget_bytes for r in self.rows)

    @property
    def ok(self) -> bool:
        return self.within_budget and all(r.grads_equal for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"plan_set": self.plan_set.to_dict(), "rows": [r.to_dict() for r in self.rows],
                "within_budget": self.within_budget, "ok": self.ok,
                "profile_s": self.profile_s}


def grads_equal(plain: nn.Module, planned: nn.Module, batch: Any,
                loss_fn: Callable[[nn.Module, Any], Any]) -> bool:
    """Whether one seeded backward of ``planned`` (a plan or plan set applied, or
    transformers' own checkpointing) gives ``plain``'s gradients, bitwise; both models
    hold the same weights, and their gradients are dropped after."""
    try:
        for m in (plain, planned):
            m.zero_grad(set_to_none=True)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                loss_fn(m, batch).backward()
        return all((p.grad is None and q.grad is None) or (
            p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
            for p, q in zip(plain.parameters(), planned.parameters(), strict=True))
    finally:
        plain.zero_grad(set_to_none=True)
        planned.zero_grad(set_to_none=True)


def bucket_ends(chosen: PlanSet) -> tuple[tuple[Shape, int], ...]:
    """Every bucket's smallest and largest shape, in plan order, each once, with the plan
    that runs it (the shapes ``remat auto --shapes`` and ``remat bench --shapes``
    measure)."""
    ends: dict[Shape, int] = {}
    for k in range(len(chosen.plans)):
        for shape in chosen.ends(k):
            ends.setdefault(shape, k)
    return tuple(ends.items())


def batch_at(batch: Any, dims: ShapeRange) -> Callable[[Shape], Any]:
    """``at(shape)``: the example batch resized to ``shape`` of ``dims``."""
    axes = batch_axes(batch, dims)
    return lambda shape: resize(batch, axes, dict(zip(dims.names, shape, strict=True)))


def problem_at(profile: Profile, shape: Shape) -> Problem:
    """The simulator's problem at one shape of ``profile``'s range."""
    return problem_from_profile(at_shape(profile, shape))


def profile_and_plan(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                     shapes: str, budget: Budget | str | int | float, *,
                     stages: Sequence[str] | None = None, optimizer: str = "adamw",
                     repeats: int = 2, outside: str = "error",
                     progress: Callable[[str], None] | None = None,
                     stage: Callable[[str], AbstractContextManager[Any]] | None = None,
                     ) -> tuple[Profile, PlanSet, float]:
    """The profile over ``shapes``, its plan set under ``budget``, and the seconds the
    profile took. ``stage(name)`` wraps each of the two steps (``profiling``,
    ``planning``; :func:`remat.benchmarking.stopping.step` names what stopped a run)."""
    say = progress or (lambda _what: None)
    within = stage or (lambda _name: contextlib.nullcontext())
    began = time.perf_counter()
    say("profiling the range")
    with within("profiling"):
        prof = profile_shapes(model, batch, loss_fn, shapes, stages=stages,
                              optimizer=optimizer, repeats=repeats)
    profiled = time.perf_counter() - began
    say("planning the plan set")
    with within("planning"):
        chosen = plan_set(prof, budget, outside=outside)
    return prof, chosen, profiled


def auto_range(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
               shapes: str, budget: Budget | str | int | float, *,
               stages: Sequence[str] | None = None, optimizer: str = "adamw",
               repeats: int = 2, outside: str = "error",
               progress: Callable[[str], None] | None = None) -> RangeReport:
    """Profile ``shapes``, plan the set under ``budget``, measure each bucket's ends."""
    say = progress or (lambda _what: None)
    prof, chosen, profiled = profile_and_plan(
        model, batch, loss_fn, shapes, budget, stages=stages, optimizer=optimizer,
        repeats=repeats, outside=outside, progress=say)
    dims = chosen.dims
    at = batch_at(batch, dims)
    rows = []
    for shape, k in bucket_ends(chosen):
        say(f"measuring {dims.shape_text(shape)}")
        sized = at(shape)
        predicted = simulate(chosen.plans[k], problem_at(prof, shape))
        twin = copy.deepcopy(model)
        apply(twin, chosen)
        try:
            with torch.random.fork_rng():
                step = measure_step(twin, sized, loss_fn, optimizer)
        finally:
            remove(twin)
        del twin
        plain, planned = copy.deepcopy(model), copy.deepcopy(model)
        apply(planned, chosen)
        try:
            equal = grads_equal(plain, planned, sized, loss_fn)
        finally:
            remove(planned)
        rows.append(ShapeRow(shape, k, predicted.peak_bytes, step.peak_bytes, equal))
    return RangeReport(prof, chosen, tuple(rows), profiled)
