"""``remat bench --shapes``: the strategies side by side over a range of batch shapes.

Note [Bench over a range]
~~~~~~~~~~~~~~~~~~~~~~~~~
``remat bench`` at one shape compares strategies at the example batch. Over a range
(docs/shapes.md) remat runs a *plan set*, one plan per bucket of shapes, so the question
is per bucket: at the shapes a plan runs, does it stay within the budget as predicted, and
what does it cost against the recipes that ignore the shape? The run profiles the range
once, plans the set under one budget (:func:`.range_job.profile_and_plan`, as ``remat auto
--shapes`` does), and at every bucket's smallest and largest shape (:func:`.range_job.
bucket_ends`) measures each strategy on a fresh model with the batch resized to that
shape: the plan set applied as training runs it (the runtime picks the bucket's plan from
the batch), and each recipe (``none``, ``per-stage``, ``every-K``, ``sqrt``,
``selective``, ``hf-gc``) as one plan for every shape. Every prediction is the simulator's
at that shape (the profile read at the shape, :func:`.range_job.problem_at`); peaks are
the live-storage tracker's; times are interleaved per shape, each row's overhead the
median per-round ratio to ``none`` at the same shape; gradients are one seeded step
against the plain model's, bitwise. ``compile`` rows are left out: torch.compile
specializes to each shape, so its budget would be a different program per shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from remat.core.artifact import write_text
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.plan_set import PlanSet, box_text
from remat.core.shapes import Shape, parse_shapes
from remat.core.solve.budget import Budget
from remat.core.solve.simulator import simulate
from remat.core.units import format_bytes
from remat.measure.malloc import set_malloc

from .bench_report import _finding, _ms, _pct, _size, options_summary
from .environment import Environment, describe_environment
from .factory import describe, failure, make_factory, torch_threads, whole
from .range_job import batch_at, bucket_ends, grads_equal, problem_at, profile_and_plan
from .rank_runners import profile_rounds
from .results import SCHEMA_VERSION, Finding, Row
from .runners import HF_GC, EagerRunner, Runner, supports_hf_gc
from .step_measures import by_tracker, interleaved, paired, time_stats
from .stopping import first_step, step
from .strategies import REMAT_COMPILE, STRATEGIES, baseline_plan, parse_budgets, parse_strategies

__all__ = ["RANGE_STRATEGIES", "RangeBenchReport", "ShapeBenchRow", "bench_range",
           "write_range_report"]

#: The default strategies over a range: bench's, without ``compile`` (Note [Bench over a
#: range]); ``hf-gc`` is added on a transformers model, as at one shape.
RANGE_STRATEGIES = tuple(s for s in STRATEGIES if s != "compile")
_NOT_OVER_A_RANGE = ("compile", REMAT_COMPILE)
#: The accuracy remat holds its peak predictions to (as ``remat bench``'s finding).
PREDICTION_TARGET = 0.05

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ShapeBenchRow:
    """One strategy at one shape of the range: ``plan`` is the plan of the set whose
    bucket holds the shape (``bucket`` its shapes); ``ran`` (remat rows) the plan the
    runtime ran there, read off the applied set after the measured step."""

    shape: Shape
    shape_text: str
    plan: int
    bucket: str
    row: Row
    ran: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "shape_text": self.shape_text, "plan": self.plan,
                "bucket": self.bucket, "ran_plan": self.ran, **self.row.to_dict()}


@dataclass(frozen=True)
class RangeBenchReport:
    """Everything one ``remat bench --shapes`` run measured (docs/bench.md)."""

    model: str
    environment: Environment
    optimizer: str
    budget: str
    strategies: tuple[str, ...]
    repeats: int
    warmup: int
    plan_set: PlanSet
    rows: tuple[ShapeBenchRow, ...]
    findings: tuple[Finding, ...]
    profile_s: float
    elapsed_s: float
    command: str | None = None

    @property
    def shapes(self) -> str:
        return str(self.plan_set.dims)

    def bucket_text(self, k: int) -> str:
        """The shapes plan ``k`` runs, as ``seq=8..24`` boxes joined by ``; ``."""
        return "; ".join(box_text(self.plan_set.dims, b) for b in self.plan_set.buckets[k])

    def rows_at(self, shape: Sequence[int]) -> tuple[ShapeBenchRow, ...]:
        return tuple(r for r in self.rows if r.shape == tuple(shape))

    def failed(self) -> list[str]:
        """What makes the command exit 1, one line each (as ``remat bench``)."""
        bad = [f"{r.row.key} at {r.shape_text}" for r in self.rows
               if r.row.grads_match is False and r.row.strategy != HF_GC]
        over = [r.shape_text for r in self.rows
                if r.row.strategy == "remat" and r.row.within_budget is False]
        wrong = [f"{r.shape_text} ran plan {r.ran}, not {r.plan}" for r in self.rows
                 if r.ran is not None and r.ran != r.plan]
        broken = [f"{r.row.key} at {r.shape_text} could not run: {r.row.reason}"
                  for r in self.rows if r.row.status == "failed" and r.row.strategy != HF_GC]
        return ([f"gradients differ: {', '.join(bad)}"] if bad else []) + (
            [f"remat over budget at {', '.join(over)}"] if over else []) + (
            [f"the runtime ran another plan than the bucket's: {', '.join(wrong)}"]
            if wrong else []) + broken

    def to_dict(self) -> dict[str, Any]:
        chosen = self.plan_set
        buckets = [{"plan": k, "shapes": [box_text(chosen.dims, b) for b in chosen.buckets[k]],
                    "ends": [list(x) for x in dict.fromkeys(chosen.ends(k))],
                    "regions": [str(r) for r in plan.regions], "options": list(plan.options),
                    "predicted_peak_bytes": plan.predicted_peak_bytes}
                   for k, plan in enumerate(chosen.plans)]
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "command": self.command,
            "environment": self.environment.to_dict(),
            "optimizer": self.optimizer,
            "shapes": self.shapes,
            "dims": chosen.dims.to_dict(),
            "budget": self.budget,
            "budget_bytes": chosen.budget_bytes,
            "strategies": list(self.strategies),
            "repeats": self.repeats,
            "warmup": self.warmup,
            "buckets": buckets,
            "plan_set": chosen.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "findings": [f.to_dict() for f in self.findings],
            "profile_s": self.profile_s,
            "elapsed_s": self.elapsed_s,
        }


def _range_strategies(strategies: str | Sequence[str]) -> tuple[str, ...]:
    found = parse_strategies(strategies)
    refused = [s for s in found if s in _NOT_OVER_A_RANGE]
    if refused:
        raise UsageError(f"{', '.join(refused)} rows are not measured over a range of shapes "
                         "(torch.compile specializes to each shape); leave them out of the "
                         "strategies")
    if "remat" not in found:
        raise UsageError("a range benchmark measures remat's plan set against the other "
                         "strategies; keep remat in the strategies")
    return found


def _one_budget(
    budget: Budget | str | int | float | Sequence[Budget | str | int | float],
) -> Budget:
    """The one budget a range benchmark plans under, read once here."""
    single = isinstance(budget, (Budget, int, float))
    given = parse_budgets([budget] if single else budget)  # type: ignore[list-item,arg-type]
    if len(given) != 1:
        raise UsageError(f"a range benchmark plans one plan set for one budget, and "
                         f"{len(given)} were given; give one, e.g. --budgets 50%")
    return Budget.parse(given[0])


def _ran(runner: Runner, chosen: PlanSet) -> int | None:
    """The plan of ``chosen`` the runner's last training forward ran."""
    handle = getattr(runner, "handle", None)
    if handle is None:
        return None
    running = handle.running
    return next((j for j, p in enumerate(chosen.plans)
                 if (p.regions, p.options) == (running.regions, running.options)), None)


def _at_shape(factory: Any, optimizer: str, chosen: PlanSet, prof: Any, shape: Shape, k: int,
              strategies: Sequence[str], budget: str, batch: Any, repeats: int, warmup: int,
              say: Callable[[str], None]) -> list[ShapeBenchRow]:
    """Every strategy measured and timed at one shape (Note [Bench over a range])."""
    dims = chosen.dims
    problem = problem_at(prof, shape)
    text = dims.shape_text(shape)
    bucket = "; ".join(box_text(dims, b) for b in chosen.buckets[k])
    plain_sim = simulate(baseline_plan(problem, "none"), problem)
    rows: dict[str, ShapeBenchRow] = {}
    runners: dict[str, Runner] = {}
    reference = factory(None)[0].train()  # every row's gradients are compared with its
    try:
        for strategy in strategies:
            priced = chosen.plans[k] if strategy == "remat" else baseline_plan(problem, strategy)
            run: Plan | PlanSet = chosen if strategy == "remat" else priced
            sim = simulate(priced, problem)
            row = Row(strategy, budget if strategy == "remat" else None, chosen.budget_bytes,
                      solver=priced.solver, regions=tuple(str(r) for r in priced.regions),
                      options=priced.options, predicted_peak_bytes=sim.peak_bytes,
                      predicted_step_time_s=sim.step_time_s,
                      predicted_overhead=sim.step_time_s / plain_sim.step_time_s - 1
                      if plain_sim.step_time_s else None,
                      predicted_rebuild_time_s=sim.step_time_s - plain_sim.step_time_s)
            say(f"measuring {row.key} at {text}")
            runner: Runner | None = None
            try:
                model, _, loss_fn = factory(None)
                runner = (Runner(model, batch, loss_fn, optimizer) if strategy == "none"
                          else EagerRunner(model, batch, loss_fn, optimizer, run))
                equal = grads_equal(reference, runner.model, batch, loss_fn)
                memory = by_tracker(runner)
            except Exception as err:  # a row that cannot run is a finding, not a crash
                if runner is not None:
                    runner.close()
                rows[strategy] = ShapeBenchRow(shape, text, k, bucket,
                                               replace(row, status="failed",
                                                       reason=failure(err)))
                continue
            runners[row.key] = runner
            rows[strategy] = ShapeBenchRow(
                shape, text, k, bucket,
                replace(row, measured_peak_bytes=memory.peak_bytes, instrument=memory.instrument,
                        peak_by_category=memory.by_category, grads_match=equal),
                ran=_ran(runner, chosen) if strategy == "remat" else None)
        say(f"timing at {text}")
        times = interleaved({key: r.step for key, r in runners.items()}, repeats=repeats,
                            warmup=warmup)
    finally:
        for r in runners.values():
            r.close()
    base = times.get("none")
    out = []
    for found in rows.values():
        samples = times.get(found.row.key)
        if samples:
            stats = time_stats(samples)
            ratio, diff = paired(samples, base) if base else (None, None)
            found = replace(found, row=replace(
                found.row, step_time_s=stats.median_s, step_time_min_s=stats.min_s,
                step_time_max_s=stats.max_s, step_times_s=tuple(samples),
                overhead=None if ratio is None else ratio - 1, rebuild_time_s=diff))
        out.append(found)
    return out


def _findings(rows: Sequence[ShapeBenchRow], budget_bytes: int) -> tuple[Finding, ...]:
    remat = [r for r in rows if r.row.strategy == "remat"]
    measured = [r for r in remat if r.row.measured_peak_bytes is not None]
    over = [r.shape_text for r in measured if r.row.within_budget is False]
    out = [Finding(
        "budget", "remat's measured peak within the budget at every bucket's ends",
        f"{len(measured) - len(over)} of {len(remat)} shapes within "
        f"{format_bytes(budget_bytes)}" + (f"; over at {', '.join(over)}" if over else ""),
        bool(remat) and len(measured) == len(remat) and not over)]
    errors = {r.shape_text: r.row.peak_error for r in measured if r.row.peak_error is not None}
    if errors:
        worst = max(errors, key=lambda x: abs(errors[x] or 0))
        out.append(Finding(
            "prediction", f"remat's measured peak within +-{PREDICTION_TARGET:.0%} of "
            "predicted at every bucket's ends",
            f"worst {errors[worst]:+.1%} (measured / predicted - 1) at {worst}",
            all(abs(e or 0) <= PREDICTION_TARGET for e in errors.values())))
    checked = [r for r in rows if r.row.grads_match is not None]
    differ = [f"{r.row.key} at {r.shape_text}" for r in checked if not r.row.grads_match]
    out.append(Finding(
        "gradients", "every row's gradients equal the plain model's, bitwise",
        f"{len(checked) - len(differ)} of {len(checked)} rows equal"
        + (f"; differ: {', '.join(differ)}" if differ else ""), not differ if checked else None))
    wrong = [r.shape_text for r in remat if r.ran is not None and r.ran != r.plan]
    ran = [r for r in remat if r.ran is not None]
    if ran:
        out.append(Finding(
            "plan switching", "at every measured shape the runtime ran its bucket's plan",
            f"{len(ran) - len(wrong)} of {len(ran)} shapes"
            + (f"; another plan at {', '.join(wrong)}" if wrong else ""), not wrong))
    fastest = []
    for text in dict.fromkeys(r.shape_text for r in rows):
        fit = [r for r in rows if r.shape_text == text and r.row.within_budget
               and r.row.step_time_s is not None]
        if not fit:
            fastest.append(f"{text}: none fits")
            continue
        best = min(fit, key=lambda r: r.row.step_time_s or 0.0)
        others = [r for r in fit if r.row.strategy not in ("remat", best.row.strategy)]
        if best.row.strategy == "remat" and others:
            second = min(others, key=lambda r: r.row.step_time_s or 0.0)
            ratio = (best.row.step_time_s or 0.0) / (second.row.step_time_s or 1.0)
            fastest.append(f"{text}: remat ({ratio - 1:+.0%} against {second.row.strategy}, "
                           "the fastest other row within the budget)")
        else:
            fastest.append(f"{text}: {best.row.strategy}")
    out.append(Finding("fastest under budget", "stated, at each shape (medians)",
                       "; ".join(fastest), None))
    return tuple(out)


def bench_range(
    model: str | Callable[..., Any] = "gpt",
    *,
    shapes: str,
    budget: Budget | str | int | float | Sequence[Budget | str | int | float] = "50%",
    options: Mapping[str, Any] | None = None,
    stages: Sequence[str] | None = None,
    strategies: str | Sequence[str] = RANGE_STRATEGIES,
    optimizer: str = "adamw",
    repeats: int = 10,
    warmup: int = 2,
    profile_repeats: int | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    command: str | None = None,
    malloc: str = "keep",
) -> RangeBenchReport:
    """Every strategy at each bucket's ends of the plan set for ``shapes`` under ``budget``
    (Note [Bench over a range]; docs/bench.md).

    ``shapes`` is a range (``"seq=128..2048:8"``, docs/shapes.md); ``budget`` one
    whole-step budget (bytes, a size, or a fraction of the measured peak without
    checkpointing at the range's largest shape); the other arguments as for
    :func:`remat.bench` (``profile_repeats``: timed rounds of each timed profile of the
    range, default 5).
    """
    parse_shapes(shapes)  # a malformed range is refused before anything runs
    chosen_budget = _one_budget(budget)
    names = _range_strategies(strategies)
    repeats, warmup = whole(repeats, "repeats", 1), whole(warmup, "warmup", 0)
    rounds = profile_rounds(profile_repeats, None, 5)
    allocator = set_malloc(malloc)
    report: Progress = progress or (lambda _what, _done, _total: None)
    began = time.perf_counter()
    with torch_threads(threads):
        with step("loading the model"):
            factory, _ = make_factory(model, options or {})
            model0, batch0, loss0 = factory(None)
        first_step(model0, batch0, loss0)
        if names == RANGE_STRATEGIES and supports_hf_gc(model0):
            names = parse_strategies([*names, HF_GC])
        prof, chosen, profile_s = profile_and_plan(
            model0, batch0, loss0, shapes, chosen_budget, stages=stages, optimizer=optimizer,
            repeats=rounds, progress=lambda what: report(what, 0, 0), stage=step)
        environment = describe_environment(model0, batch0, loss0, dtype=prof.dtype,
                                           device=prof.device, malloc=allocator)
        at = batch_at(batch0, chosen.dims)
        del model0
        ends = bucket_ends(chosen)
        rows: list[ShapeBenchRow] = []
        for done, (shape, k) in enumerate(ends):
            def say(what: str, done: int = done) -> None:
                report(what, done, len(ends))

            rows += _at_shape(factory, optimizer, chosen, prof, shape, k, names,
                              str(chosen_budget), at(shape), repeats, warmup, say)
    return RangeBenchReport(
        model=describe(model, options or {}), environment=environment, optimizer=optimizer,
        budget=str(chosen_budget), strategies=names, repeats=repeats, warmup=warmup,
        plan_set=chosen, rows=tuple(rows), findings=_findings(rows, chosen.budget_bytes),
        profile_s=profile_s, elapsed_s=time.perf_counter() - began, command=command)


def _within(r: Row) -> str:
    return {True: "yes", False: "OVER", None: "-"}[r.within_budget]


def _grads(r: Row) -> str:
    return {True: "equal", False: "DIFFER", None: "-"}[r.grads_match]


def markdown(report: RangeBenchReport) -> str:
    """The report folder's ``README.md``: the plan set, every row at each bucket's ends."""
    env, chosen = report.environment, report.plan_set
    out = [f"# remat bench over {report.shapes}: {report.model}", ""]
    if report.command:
        out += ["Command:", "", "```console", f"$ {report.command}", "```", ""]
    out += [
        f"One process; the range {report.shapes} profiled in {report.profile_s:.1f} s and "
        f"planned under {report.budget} ({_size(chosen.budget_bytes)}); at each bucket's "
        f"smallest and largest shape every row on a fresh model, {report.repeats} timed "
        f"rounds after {report.warmup} warm-up, interleaved; optimizer {report.optimizer}; "
        f"took {report.elapsed_s:.0f} s.",
        "",
        "| torch | device | threads | C allocator | dtype | attention |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {env.torch_version} | {env.device} | {env.threads} (interop {env.interop_threads}) "
        f"| {env.malloc} | {env.dtype} | {env.attention_backend} |",
        "",
        "## The plan set",
        "",
        "| plan | shapes it runs | regions | options | predicted peak (its bucket's most) |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {k} | {report.bucket_text(k)} | {' '.join(str(r) for r in p.regions) or '-'} | "
          f"{options_summary(p.options)} | {_size(p.predicted_peak_bytes)} |"
          for k, p in enumerate(chosen.plans)),
        "",
        "## Rows",
        "",
        "Peaks of one whole training step, by the live-storage tracker; error: measured / "
        "predicted - 1; within: measured peak against the budget; step times in ms, median "
        "[min, max]; overhead: median per-round ratio to `none` at the same shape - 1 (the "
        "simulator's in brackets); gradients: one seeded step against the plain model's, "
        "bitwise. `remat` is the plan set applied: the runtime runs the bucket's plan.",
        "",
        "| plan: shapes | shape | row | predicted peak | measured peak | error | within | "
        "step ms | overhead (predicted) | gradients | regions | options |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.rows:
        row = r.row
        head = f"{r.plan}: {r.bucket}"
        if row.status != "ok":
            out.append(f"| {head} | {r.shape_text} | {row.key} | {row.status}: {row.reason} "
                       "| | | | | | | | |")
            continue
        span = f"{_ms(row.step_time_s)} [{_ms(row.step_time_min_s)}, {_ms(row.step_time_max_s)}]"
        out.append(
            f"| {head} | {r.shape_text} | {row.key} | {_size(row.predicted_peak_bytes)} | "
            f"{_size(row.measured_peak_bytes)} | {_pct(row.peak_error)} | {_within(row)} | "
            f"{span} | {_pct(row.overhead)} ({_pct(row.predicted_overhead)}) | {_grads(row)} | "
            f"{' '.join(row.regions) or '-'} | {options_summary(row.options)} |")
    out += ["", "## Findings", "", *(_finding(f) for f in report.findings), ""]
    return "\n".join(out)


def write_range_report(report: RangeBenchReport, folder: str | Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``README.md`` (no plots over a range) into ``folder``."""
    import json

    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
        json_path, md_path = target / "bench.json", target / "README.md"
        write_text(json_path, json.dumps(report.to_dict(), indent=2) + "\n")
        write_text(md_path, markdown(report))
    except OSError as err:
        raise UsageError(
            f"cannot write the report to {str(folder)!r} ({err.strerror}); give a writable --out"
        ) from err
    return json_path, md_path
