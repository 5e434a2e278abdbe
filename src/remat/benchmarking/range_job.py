"""``remat auto --shapes``: the main job over a range of batch shapes.

Profile the range, plan the plan set, then for each plan measure a training step at the
smallest and the largest shape of its bucket with the set applied: the measured peak
against the budget and the prediction, and the gradients against the plain model's from
the same state and seed (bitwise). docs/shapes.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.plan_set import PlanSet, plan_set
from remat.core.profile_format import Profile
from remat.core.shape_profiles import at_shape
from remat.core.shapes import Shape
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.simulator import simulate
from remat.measure.step import measure_step
from remat.profiling.shaped import batch_axes, profile_shapes, resize
from remat.runtime.install import apply, remove

__all__ = ["RangeReport", "ShapeRow", "auto_range"]


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


def _grads_equal(model: nn.Module, chosen: PlanSet, batch: Any,
                 loss_fn: Callable[[nn.Module, Any], Any]) -> bool:
    plain, planned = copy.deepcopy(model), copy.deepcopy(model)
    apply(planned, chosen)
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
        remove(planned)


def auto_range(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
               shapes: str, budget: str | int | float, *, stages: Sequence[str] | None = None,
               optimizer: str = "adamw", repeats: int = 2, outside: str = "error",
               progress: Callable[[str], None] | None = None) -> RangeReport:
    """Profile ``shapes``, plan the set under ``budget``, measure each bucket's ends."""
    say = progress or (lambda _what: None)
    began = time.perf_counter()
    say("profiling the range")
    prof = profile_shapes(model, batch, loss_fn, shapes, stages=stages, optimizer=optimizer,
                          repeats=repeats)
    profiled = time.perf_counter() - began
    say("planning the plan set")
    chosen = plan_set(prof, budget, outside=outside)
    fit = prof.shapes
    assert fit is not None
    axes = batch_axes(batch, fit.dims)
    rows = []
    for shape in dict.fromkeys(x for k in range(len(chosen.plans)) for x in chosen.ends(k)):
        say(f"measuring {fit.dims.shape_text(shape)}")
        k = chosen.choose(shape)
        assert k is not None
        sized = resize(batch, axes, dict(zip(fit.dims.names, shape, strict=True)))
        predicted = simulate(chosen.plans[k], problem_from_profile(at_shape(prof, shape)))
        twin = copy.deepcopy(model)
        apply(twin, chosen)
        try:
            with torch.random.fork_rng():
                step = measure_step(twin, sized, loss_fn, optimizer)
        finally:
            remove(twin)
        del twin
        rows.append(ShapeRow(shape, k, predicted.peak_bytes, step.peak_bytes,
                             _grads_equal(model, chosen, sized, loss_fn)))
    return RangeReport(prof, chosen, tuple(rows), profiled)
