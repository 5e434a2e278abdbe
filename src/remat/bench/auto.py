"""``remat.auto``: the main job in one call: profile, plan, apply, verify, measure.

The plan is remat's optimal one under the budget; its predicted peak and step time come
from the simulator. Measurement runs the plain model and the planned one side by side
(the tracker for the peak, interleaved steps for the time). Whatever disagrees (a
measured peak over the budget, a prediction off by more than 5%, gradients that differ)
is listed in ``problems``, never hidden; ``ok`` is True only when there are none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.measure.malloc import set_malloc
from remat.plan import Plan
from remat.planner import plan as make_plan
from remat.planner import to_problem
from remat.profile_format import Profile
from remat.profiler import profile
from remat.solve import simulate
from remat.units import format_bytes

from .environment import Environment, describe_environment
from .factory import describe, make_factory, whole
from .findings import PEAK_TOLERANCE
from .grads import check_plan
from .measure import by_tracker, interleaved, paired, time_stats
from .runners import EagerRunner, Runner

__all__ = ["AutoReport", "auto"]


@dataclass(frozen=True)
class AutoReport:
    """What ``remat auto`` found; JSON keys are the field names plus ``ok``."""

    model: str
    budget: str
    budget_bytes: int
    plan: Plan
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_peak_event: str
    peak_phase: str | None
    peak_module: str | None
    peak_by_category: Mapping[str, int] = field(hash=False)
    baseline_peak_by_category: Mapping[str, int] = field(hash=False)
    baseline_step_time_s: float = 0.0
    step_time_s: float = 0.0
    overhead: float = 0.0
    predicted_overhead: float | None = None
    verify_ok: bool = False
    grads_match: bool = False
    verify_detail: str = ""
    problems: tuple[str, ...] = ()
    environment: Environment | None = None
    timings_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    elapsed_s: float = 0.0
    profile: Profile | None = field(default=None, repr=False, compare=False)

    @property
    def peak_error(self) -> float:
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "peak_error": self.peak_error,
            "within_budget": self.within_budget,
            "prediction_within_5pct": abs(self.peak_error) <= PEAK_TOLERANCE,
            "predicted_peak_event": self.predicted_peak_event,
            "peak_phase": self.peak_phase,
            "peak_module": self.peak_module,
            "peak_by_category": dict(self.peak_by_category),
            "baseline_peak_by_category": dict(self.baseline_peak_by_category),
            "baseline_step_time_s": self.baseline_step_time_s,
            "step_time_s": self.step_time_s,
            "overhead": self.overhead,
            "predicted_overhead": self.predicted_overhead,
            "verify_ok": self.verify_ok,
            "grads_match": self.grads_match,
            "verify_detail": self.verify_detail,
            "problems": list(self.problems),
            "plan": self.plan.to_dict(),
            "environment": None if self.environment is None else self.environment.to_dict(),
            "timings_s": dict(self.timings_s),
            "elapsed_s": self.elapsed_s,
        }


def _problems(budget: int, predicted: int, measured: int, verify_ok: bool,
              detail: str) -> tuple[str, ...]:
    found = []
    if measured > budget:
        found.append(
            f"the measured peak {format_bytes(measured)} is over the budget "
            f"{format_bytes(budget)} by {format_bytes(measured - budget)}"
        )
    error = measured / predicted - 1
    if abs(error) > PEAK_TOLERANCE:
        found.append(
            f"the measured peak is {error:+.1%} off the predicted {format_bytes(predicted)}, "
            "more than 5%"
        )
    if not verify_ok:
        found.append(f"verify failed: {detail}")
    return tuple(found)


def auto(
    model: str | Callable[..., Any] = "gpt",
    *,
    options: Mapping[str, Any] | None = None,
    stages: Sequence[str] | None = None,
    budget: str | int | float = "50%",
    optimizer: str = "adamw",
    repeats: int = 6,
    warmup: int = 1,
    verify_steps: int = 2,
    profile_repeats: int = 2,
    progress: Callable[[str, int, int], None] | None = None,
    malloc: str = "keep",
) -> AutoReport:
    """Profile ``model``, plan it under ``budget``, verify the plan and measure it.

    ``model`` and ``options`` as in :func:`remat.bench.bench`; ``budget`` is a whole-step
    peak (bytes, or a fraction of the measured peak without checkpointing). Raises
    :class:`remat.CheckFailed` (naming the smallest feasible budget) when no plan fits.
    ``malloc`` as in :func:`remat.bench.bench` (``keep`` steadies CPU step times).
    """
    began = time.perf_counter()
    whole(repeats, "repeats", 1)
    whole(warmup, "warmup", 0)
    whole(verify_steps, "verify_steps", 1)
    allocator = set_malloc(malloc)
    report = progress or (lambda _what, _done, _total: None)
    timings: dict[str, float] = {}
    factory, _ = make_factory(model, options)
    description = describe(model, options or {})

    t = time.perf_counter()
    net, batch, loss_fn = factory(None)
    prof = profile(net, batch, loss_fn, stages, optimizer, repeats=profile_repeats,
                   description=description,
                   progress=lambda what, done, total: report(f"profiling: {what}", done, total))
    environment = describe_environment(net, batch, loss_fn, dtype=prof.dtype, device=prof.device,
                                       malloc=allocator)
    del net
    timings["profile_s"] = time.perf_counter() - t

    t = time.perf_counter()
    report("planning", 0, 1)
    problem = to_problem(prof)
    plan = make_plan(problem, budget, "optimal")
    predicted_event = simulate(plan, problem).peak_event
    timings["plan_s"] = time.perf_counter() - t

    t = time.perf_counter()
    report("verifying", 0, 1)
    check = check_plan(factory, plan, optimizer=optimizer, steps=verify_steps)
    timings["verify_s"] = time.perf_counter() - t

    t = time.perf_counter()
    report("measuring", 0, 1)
    plain = Runner(*factory(None), optimizer)
    planned = EagerRunner(*factory(None), optimizer, plan)
    try:
        base_memory, memory = by_tracker(plain), by_tracker(planned)
        times = interleaved(
            {"plain": plain.step, "planned": planned.step}, repeats=repeats, warmup=warmup,
            progress=lambda done, total: report("timing (interleaved)", done, total),
        )
    finally:
        planned.close()
        plain.close()
    ratio, _ = paired(times["planned"], times["plain"])
    timings["measure_s"] = time.perf_counter() - t

    assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
    predicted_overhead = None
    if plan.predicted_step_time_s and plan.baseline_step_time_s:
        predicted_overhead = plan.predicted_step_time_s / plan.baseline_step_time_s - 1
    return AutoReport(
        model=description,
        budget=str(budget),
        budget_bytes=plan.budget_bytes,
        plan=plan,
        baseline_peak_bytes=base_memory.peak_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=memory.peak_bytes,
        predicted_peak_event=predicted_event,
        peak_phase=memory.peak_phase,
        peak_module=memory.peak_module,
        peak_by_category=dict(memory.by_category or {}),
        baseline_peak_by_category=dict(base_memory.by_category or {}),
        baseline_step_time_s=time_stats(times["plain"]).median_s,
        step_time_s=time_stats(times["planned"]).median_s,
        overhead=ratio - 1,
        predicted_overhead=predicted_overhead,
        verify_ok=bool(check.verify_ok),
        grads_match=check.grads_match,
        verify_detail=check.detail,
        problems=_problems(plan.budget_bytes, plan.predicted_peak_bytes, memory.peak_bytes,
                           bool(check.verify_ok), check.detail),
        environment=environment,
        timings_s=timings,
        elapsed_s=time.perf_counter() - began,
        profile=prof,
    )
