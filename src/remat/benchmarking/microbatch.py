"""Under one memory budget: each strategy's micro-batch, and its throughput at a fixed global batch.

For each strategy the micro-batch is predicted from the profile's batch scaling
(:func:`remat.core.transforms.at_batch_size`, every peak and time from the
simulator): the largest that fits, for ``remat`` with its plan solved again at each size;
``remat-best`` is remat at the micro-batch with the best predicted samples per second,
when that is another one. With several micro-batches per step the prediction is of a
later micro-step, whose gradients already exist. Measurement then confirms it: the peak
of one whole accumulation step (every micro-batch's forward and backward, then the
optimizer step) must fit, or a bisection by measurement steps down. Throughput keeps the
global batch by gradient accumulation: ``ceil(G / b)`` micro-batches (the last one
smaller when ``b`` does not divide ``G``), timed interleaved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from remat.core.plan_format import Plan
from remat.core.planner import to_problem
from remat.core.profile_format import Profile
from remat.core.sizing import plan_at
from remat.core.transforms import accumulating, at_batch_size
from remat.core.units import format_bytes
from remat.measure import measure_step
from remat.runtime import apply

from .results import MicrobatchReport, MicrobatchRow
from .runners import Factory, LossFn, enable_hf_gc, is_hf_gc
from .step_measures import interleaved, time_stats
from .strategies import baseline_plan

__all__ = ["compare_microbatches", "split"]

_MAX_PROBES = 8
#: remat at its largest micro-batch, and at the one with the best predicted throughput.
REMAT = ("remat", "remat-best")


def split(global_batch: int, microbatch: int) -> tuple[int, ...]:
    """Micro-batch sizes that add up to the global batch: full ones, then the rest."""
    k = math.ceil(global_batch / microbatch)
    return (microbatch,) * (k - 1) + (global_batch - microbatch * (k - 1),)


def _plan_at(profile: Profile, strategy: str, size: int, budget: int,
             global_batch: int) -> Plan | None:
    """The strategy's plan at micro-batch ``size``, or None when it is predicted not to fit.

    With two micro-steps or more the prediction is of a later one (see
    :func:`remat.core.transforms.accumulating`), whose events hold at least as much as the
    first one's.
    """
    transform = accumulating if len(split(global_batch, size)) > 1 else None
    if strategy in REMAT:
        return plan_at(profile, "optimal", size, budget, transform)
    problem = to_problem(at_batch_size(profile, size))
    if transform is not None:
        problem = transform(problem)
    plan = baseline_plan(problem, strategy)
    assert plan.predicted_peak_bytes is not None
    return plan if plan.predicted_peak_bytes <= budget else None


def _predicted_rate(plan: Plan, size: int) -> float:
    return size / plan.predicted_step_time_s if plan.predicted_step_time_s else 0.0


def _predict(profile: Profile, strategy: str, global_batch: int,
             budget: int) -> tuple[int, Plan] | None:
    """The micro-batch the strategy is predicted to run under ``budget``.

    The largest that fits; for ``remat-best``, the one with the best predicted samples/s.
    """
    if strategy != "remat-best":
        for size in range(global_batch, 0, -1):
            plan = _plan_at(profile, strategy, size, budget, global_batch)
            if plan is not None:
                return size, plan
        return None
    fits = [(size, plan) for size in range(global_batch, 0, -1)
            if (plan := _plan_at(profile, strategy, size, budget, global_batch)) is not None]
    return max(fits, key=lambda f: _predicted_rate(f[1], f[0])) if fits else None


def _accumulating_loss(loss_fn: LossFn, sizes: Sequence[int]) -> LossFn:
    total = sum(sizes)

    def loss(model: nn.Module, batches: Sequence[Any]) -> Any:
        # All micro-batches but the last run forward and backward here, and measure_step
        # runs the last backward and the optimizer step: its one measured step is then a
        # whole accumulation step, with the gradients piling up as in training.
        for batch, size in zip(batches[:-1], sizes[:-1], strict=True):
            (loss_fn(model, batch) * (size / total)).backward()
        return loss_fn(model, batches[-1]) * (sizes[-1] / total)

    return loss


@dataclass
class _Setup:
    """A model at one micro-batch with its plan applied, ready for whole accumulation steps."""

    model: nn.Module
    batches: tuple[Any, ...]
    loss: LossFn
    plan: Plan
    optimizer: Any = None

    def step(self) -> None:
        self.loss(self.model, self.batches).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _setup(factory: Factory, size: int, global_batch: int, plan: Plan, optimizer: str) -> _Setup:
    from remat.measure.step import make_optimizer

    model, batch, loss_fn = factory(size)
    sizes = split(global_batch, size)
    rest = sizes[-1] if sizes[-1] != size else None
    batches = [batch] * (len(sizes) - 1) + [factory(rest)[1] if rest else batch]
    if is_hf_gc(plan):
        enable_hf_gc(model)
    elif not plan.checkpoints_nothing:
        apply(model, plan)
    setup = _Setup(model.train(), tuple(batches), _accumulating_loss(loss_fn, sizes), plan)
    setup.optimizer = make_optimizer(model, optimizer)
    return setup


class _Search:
    """Measured accumulation steps of one strategy at several micro-batches."""

    def __init__(self, factory: Factory, profile: Profile, strategy: str, global_batch: int,
                 budget: int, optimizer: str) -> None:
        self.factory, self.profile, self.strategy = factory, profile, strategy
        self.global_batch, self.budget, self.optimizer = global_batch, budget, optimizer
        self.tried: list[int] = []
        self.best: tuple[MicrobatchRow, _Setup] | None = None
        self.last: MicrobatchRow | None = None

    def measure(self, size: int, plan: Plan) -> int:
        """Measure ``size`` under ``plan``; keep it if it fits and is the largest so far."""
        setup = _setup(self.factory, size, self.global_batch, plan, self.optimizer)
        peak = measure_step(setup.model, setup.batches, setup.loss, setup.optimizer).peak_bytes
        self.tried.append(size)
        row = MicrobatchRow(
            self.strategy, microbatch=size, accumulation_steps=len(split(self.global_batch, size)),
            predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=peak,
            predicted_samples_per_s=_predicted_rate(plan, size), tried=tuple(self.tried),
            regions=tuple(str(r) for r in plan.regions), options=plan.options,
        )
        self.last = row
        if peak <= self.budget and (self.best is None or size > (self.best[0].microbatch or 0)):
            self.best = row, setup
        return peak


def _confirm(factory: Factory, profile: Profile, strategy: str, first: tuple[int, Plan],
             global_batch: int, budget: int, optimizer: str
             ) -> tuple[MicrobatchRow, _Setup | None]:
    """Measure the predicted micro-batch; when it does not fit, a bisection by measurement
    finds the largest smaller one that does."""
    size, plan = first
    search = _Search(factory, profile, strategy, global_batch, budget, optimizer)
    search.measure(size, plan)
    low, high = 0, size  # the largest size known to fit (0: none yet), the smallest that failed
    while search.best is None or (search.best[0].microbatch or 0) < size:
        if high - low <= 1 or len(search.tried) >= _MAX_PROBES:
            break
        middle = (low + high) // 2
        candidate = _plan_at(profile, strategy, middle, budget, global_batch)
        if candidate is not None and search.measure(middle, candidate) <= budget:
            low = middle
        else:
            high = middle
    if search.best is not None:
        row, setup = search.best
        return replace(row, predicted_microbatch=size, tried=tuple(search.tried)), setup
    last = search.last
    assert last is not None
    return replace(last, predicted_microbatch=size, status="failed", reason=(
        f"micro-batches {', '.join(map(str, search.tried))} measured over the budget (the "
        f"last {format_bytes(last.measured_peak_bytes or 0)})"
    )), None


def _skipped(label: str, budget: int, global_batch: int, reason: str) -> MicrobatchReport:
    return MicrobatchReport(label, budget, global_batch, (0, 0), (), None, f"skipped: {reason}")


def compare_microbatches(
    factory: Factory,
    profile: Profile,
    budget: int,
    label: str,
    *,
    strategies: Sequence[str],
    optimizer: str,
    repeats: int,
    usable: bool,
    global_batch: int | None,
    progress: Callable[[str, int, int], None],
) -> MicrobatchReport:
    """The micro-batch comparison under ``budget`` at the profile's batch size as global batch."""
    if not usable or global_batch is None or profile.scaling is None:
        return _skipped(label, budget, global_batch or 0,
                        "the model factory has no batch_size option to vary")
    names = ["none", *(s for s in strategies if s != "none")]
    if "remat" in names:
        names.append("remat-best")
    rows: dict[str, MicrobatchRow] = {}
    setups: dict[str, _Setup] = {}
    for k, strategy in enumerate(names):
        progress(f"micro-batch: {strategy}", k, len(names))
        predicted = _predict(profile, strategy, global_batch, budget)
        if strategy == "remat-best" and predicted is not None and "remat" in rows \
                and rows["remat"].predicted_microbatch == predicted[0]:
            continue  # the best predicted micro-batch is the largest: one remat row says it
        if predicted is None:
            rows[strategy] = MicrobatchRow(strategy, status="infeasible", reason=(
                "no micro-batch down to 1 is predicted to fit the budget"))
            continue
        row, setup = _confirm(factory, profile, strategy, predicted, global_batch, budget,
                              optimizer)
        rows[strategy] = row
        if setup is not None:
            setups[strategy] = setup
    if setups:
        times = interleaved(
            {name: s.step for name, s in setups.items()}, repeats=repeats, warmup=1,
            progress=lambda done, total: progress("micro-batch: timing", done, total),
        )
        for name, samples in times.items():
            median = time_stats(samples).median_s
            rows[name] = replace(rows[name], step_time_s=median,
                                 samples_per_s=global_batch / median)
    timed = [r for r in rows.values() if r.samples_per_s]
    fastest = max(timed, key=lambda r: r.samples_per_s or 0.0) if timed else None
    if fastest is None:
        statement = f"no strategy was confirmed to fit {format_bytes(budget)}"
    else:
        others = sorted((r for r in timed if r is not fastest),
                        key=lambda r: -(r.samples_per_s or 0.0))
        versus = (f", {fastest.samples_per_s / others[0].samples_per_s:.2f}x the next, "  # type: ignore[operator]
                  f"{others[0].strategy}" if others else "")
        statement = (
            f"under {label} ({format_bytes(budget)}) with a global batch of {global_batch}, "
            f"{fastest.strategy} trains fastest: micro-batch {fastest.microbatch} x "
            f"{fastest.accumulation_steps} accumulation step(s), "
            f"{fastest.samples_per_s:.1f} samples/s{versus}"
        )
    assert profile.scaling is not None
    return MicrobatchReport(label, budget, global_batch, profile.scaling.batch_sizes,
                            tuple(rows.values()), None if fastest is None else fastest.strategy,
                            statement)
