"""``remat.bench``: every strategy side by side, predicted and measured, in one process.

The order of work: profile (with batch scaling when the micro-batch comparison runs),
plan every row, measure each eager row's memory (tracker, and the profiler as a
cross-check) and verify it, plan remat at each baseline's peak (the matched
comparison), compile the compile rows (checking their gradients on the first step) and
measure them with the profiler, time every row interleaved, then compare micro-batches
under one budget. Rows that fail are reported with their reason; the run goes on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, cast

from remat.core.errors import UsageError
from remat.core.planner import to_problem
from remat.core.profile_format import Profile
from remat.core.solve import Problem
from remat.core.solve.budget import Budget
from remat.measure.malloc import set_malloc
from remat.parallel.data_parallel import rank_problem
from remat.parallel.ranks import rank_zeros
from remat.profiling.profiler import profile, profile_scaling

from .environment import Environment, describe_environment
from .factory import (
    batch_size_of,
    compiling,
    describe,
    failure,
    make_factory,
    torch_threads,
    whole,
)
from .findings import findings
from .grads import GradCheck, check_compiled, check_plan
from .microbatch import compare_microbatches
from .rank_runners import Ranks, profile_rounds
from .results import BenchReport, Row
from .runners import CompiledRunner, EagerRunner, Factory, Runner
from .step_measures import MemoryMeasure, by_profiler, by_tracker, interleaved, paired, time_stats
from .stopping import first_step, hazard_reason, rebuild_rejected, step
from .strategies import (
    DEFAULT_BUDGETS,
    REMAT_COMPILE,
    STRATEGIES,
    RowSpec,
    matched_rows,
    parse_budgets,
    parse_strategies,
    plan_rows,
    with_default_rows,
)

__all__ = ["Progress", "Settings", "bench"]

#: ``progress(what, done, total)``: what the run is doing, and how far along that part is.
Progress = Callable[[str, int, int], None]


def _no_progress(_what: str, _done: int, _total: int) -> None:
    return None


def _planned_row(spec: RowSpec) -> Row:
    plan = spec.plan
    base = Row(spec.strategy, spec.budget, spec.budget_bytes, spec.budget_fraction,
               spec.matched_to)
    if plan is None:
        return base
    predicted = extra = None
    if plan.predicted_step_time_s and plan.baseline_step_time_s:
        predicted = plan.predicted_step_time_s / plan.baseline_step_time_s - 1
        extra = plan.predicted_step_time_s - plan.baseline_step_time_s
    return replace(
        base,
        solver=plan.solver,
        regions=tuple(str(r) for r in plan.regions),
        options=plan.options,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_step_time_s=plan.predicted_step_time_s,
        predicted_overhead=predicted,
        predicted_rebuild_time_s=extra,
    )


def _measured(row: Row, memory: MemoryMeasure, check: GradCheck, **more: Any) -> Row:
    """``row`` with its measured peaks and its gradient check (eager and compiled rows)."""
    return replace(
        row,
        measured_peak_bytes=memory.peak_bytes,
        instrument=memory.instrument,
        cuda_allocated_peak_bytes=memory.cuda_allocated_peak_bytes,
        cuda_reserved_peak_bytes=memory.cuda_reserved_peak_bytes,
        grads_match=check.grads_match,
        verify_ok=check.verify_ok,
        grads_max_rel_error=check.max_rel_error,
        grads_detail=check.detail,
        grads_rounding_only=check.rounding_only,
        **more,
    )


class _Bench:
    """The state of one run: runners, rows and timelines by row key."""

    def __init__(self, factory: Factory, optimizer: str, verify_steps: int,
                 progress: Progress, ranks: Ranks | None = None,
                 check_factory: Factory | None = None,
                 compiled_factory: Factory | None = None) -> None:
        self.factory = factory
        self.compiled_factory = compiled_factory  # remat+compile rows' models
        self.check_factory = check_factory or factory
        self.ranks = ranks
        self.optimizer = optimizer
        self.verify_steps = verify_steps
        self.progress = progress
        self.rows: dict[str, Row] = {}
        self.runners: dict[str, Runner] = {}
        self.timelines: dict[str, tuple[tuple[float, int], ...]] = {}

    def eager(self, specs: Sequence[RowSpec]) -> None:
        for k, spec in enumerate(specs):
            self.progress(f"measuring {spec.key}", k, len(specs))
            row = _planned_row(spec)
            if spec.error is not None or spec.plan is None:
                self.rows[spec.key] = replace(row, status="infeasible", reason=spec.error)
                continue
            try:
                runner, memory, cross, check = self._measure(spec)
            except Exception as err:  # a row that cannot run is a finding, not a crash
                reason = failure(err)
                # the hazard behind it; the command then exits 1
                if rebuild_rejected(err) and spec.strategy != REMAT_COMPILE:
                    reason = hazard_reason(err, lambda: self.check_factory(None),
                                           spec.plan.stages)
                self.rows[spec.key] = replace(row, status="failed", reason=reason)
                continue
            self.runners[spec.key] = runner
            self.timelines[spec.key] = memory.timeline
            self.rows[spec.key] = _measured(row, memory, check,
                                            profiler_peak_bytes=cross.peak_bytes,
                                            peak_by_category=memory.by_category)

    def _measure(
        self, spec: RowSpec
    ) -> tuple[Runner, MemoryMeasure, MemoryMeasure, GradCheck]:
        """A planned row's runner, its memory (tracker, profiler) and its gradient check.

        A ``remat+compile`` row runs the plan on the model with its stages compiled (the
        tracker measures compiled calls as windows, docs/compile.md); its first step's
        gradients are compared with the eager model's, as a compile row's are.
        """
        assert spec.plan is not None
        compiled = spec.strategy == REMAT_COMPILE
        factory = self.compiled_factory if compiled else self.factory
        assert factory is not None
        model, batch, loss_fn = factory(None)
        plan = None if spec.strategy == "none" else spec.plan
        runner: Runner
        if self.ranks is not None:
            runner = self.ranks.runner(model, batch, loss_fn, self.optimizer, plan)
        else:
            runner = (Runner(model, batch, loss_fn, self.optimizer) if plan is None
                      else EagerRunner(model, batch, loss_fn, self.optimizer, plan))
        try:
            if compiled:
                check = check_compiled(runner, reference=self.factory(None)[0])
                runner.step()  # compiled before anything is measured
            if self.ranks is not None:
                memory = cross = self.ranks.measure(runner)
            else:
                memory = by_tracker(runner)
                cross = by_profiler(runner, warmup=False)
            if not compiled:
                # the plan on this rank's plain model: gradients are a property of the plan
                check = check_plan(self.check_factory, spec.plan, optimizer=self.optimizer,
                                   steps=self.verify_steps)
        except BaseException:
            runner.close()
            raise
        return runner, memory, cross, check

    def compiled(self, specs: Sequence[RowSpec], limit_s: float) -> str:
        spent, statuses = 0.0, []
        for k, spec in enumerate(specs):
            self.progress(f"compiling {spec.key}", k, len(specs))
            row = _planned_row(spec)
            if spent > limit_s:
                reason = (f"compiling the earlier compile rows took {spent:.0f} s, over the "
                          f"compile limit of {limit_s:.0f} s")
                self.rows[spec.key] = replace(row, status="skipped", reason=reason)
                statuses.append("skipped")
                continue
            assert spec.budget_fraction is not None
            began = time.perf_counter()
            try:
                model, batch, loss_fn = self.factory(None)
                runner = CompiledRunner(model, batch, loss_fn, self.optimizer,
                                        spec.budget_fraction, f"row{len(self.rows)}")
                check = check_compiled(runner)
                compile_s = time.perf_counter() - began
                memory = by_profiler(runner)
            except Exception as err:
                spent += time.perf_counter() - began
                self.rows[spec.key] = replace(row, status="failed", reason=failure(err))
                statuses.append(f"failed ({failure(err)})")
                continue
            spent += compile_s
            statuses.append("ok")
            self.runners[spec.key] = runner
            self.timelines[spec.key] = memory.timeline
            self.rows[spec.key] = _measured(row, memory, check,
                                            profiler_peak_bytes=memory.peak_bytes,
                                            compile_time_s=compile_s)
        if not statuses:
            return "not requested"
        if "ok" in statuses:
            return f"ok ({statuses.count('ok')} of {len(statuses)} rows compiled)"
        return statuses[-1] if statuses[-1] != "skipped" else "skipped (over the compile limit)"

    def time_all(self, repeats: int, warmup: int) -> None:
        steps = {key: runner.step for key, runner in self.runners.items()}
        times = interleaved(
            steps, repeats=repeats, warmup=warmup,
            progress=lambda done, total: self.progress("timing (interleaved)", done, total),
        )
        base = times.get("none")
        for key, samples in times.items():
            stats = time_stats(samples)
            overhead = rebuild = None
            if base:
                ratio, diff = paired(samples, base)
                overhead, rebuild = ratio - 1, diff
            self.rows[key] = replace(
                self.rows[key],
                step_time_s=stats.median_s, step_time_min_s=stats.min_s,
                step_time_max_s=stats.max_s, step_times_s=tuple(samples),
                overhead=overhead, rebuild_time_s=rebuild,
            )

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()


def _profile(factory: Factory, scaling: tuple[int, int] | None, stages: Sequence[str] | None,
             optimizer: str, repeats: int, description: str, progress: Progress) -> Profile:
    def report(what: str, done: int, total: int) -> None:
        progress(f"profiling: {what}", done, total)

    if scaling is not None:
        return profile_scaling(factory, scaling, stages, optimizer, progress=report,
                               repeats=repeats, description=description)
    model, batch, loss_fn = factory(None)
    return profile(model, batch, loss_fn, stages, optimizer, repeats=repeats,
                   description=description, progress=report)


@dataclass(frozen=True)
class Settings:
    """A run's options, checked (see :func:`bench`)."""

    strategies: tuple[str, ...]
    budgets: tuple[Budget, ...]
    optimizer: str
    repeats: int
    warmup: int
    verify_steps: int
    profile_repeats: int
    compile_limit_s: float
    matched: bool
    microbatch_budget: Budget | None
    distributed: str | None = None
    allocator: str = "system allocator"  # what set_malloc made of the malloc option


def bench(
    model: str | Callable[..., Any] = "gpt",
    *,
    options: Mapping[str, Any] | None = None,
    stages: Sequence[str] | None = None,
    budgets: str | Sequence[Budget | str | int | float] = DEFAULT_BUDGETS,
    strategies: str | Sequence[str] = STRATEGIES,
    optimizer: str = "adamw",
    repeats: int = 10,
    warmup: int = 2,
    verify_steps: int = 2,
    profile_repeats: int | None = None,
    compile_limit_s: float = 600.0,
    matched: bool = True,
    microbatch_budget: Budget | str | int | float | None = "50%",
    threads: int | None = None,
    progress: Progress | None = None,
    command: str | None = None,
    distributed: str | None = None,
    malloc: str = "keep",
) -> BenchReport:
    """Measure every strategy on ``model`` side by side; see ``docs/bench.md``.

    ``model`` is a spec (``gpt``, ``mlp-hetero``, ``convnet-bn``, ``package.module:factory``)
    or a factory taking keyword options; ``options`` go to it. ``budgets`` are whole-step
    peaks (bytes or fractions of the measured peak without checkpointing); ``strategies``
    any of :data:`~remat.benchmarking.strategies.STRATEGIES` (``none`` always runs, as the
    reference). ``repeats`` timed rounds follow ``warmup`` rounds. ``microbatch_budget``
    (None: skip) is the budget of the micro-batch comparison. ``threads`` sets torch's
    intra-op threads for the run (restored after). ``distributed`` (``ddp`` or ``fsdp``,
    under ``torchrun``): this process is one rank; it joins the process group, runs the
    eager rows wrapped (compile rows and the micro-batch comparison are left out) on its
    shard of the batch and reports its own peaks (``docs/distributed.md``). ``malloc``:
    ``keep`` makes glibc keep freed memory for the rest of the process, which steadies CPU
    step times (:mod:`remat.measure.malloc`); ``system`` leaves the allocator alone.
    ``profile_repeats``: timed rounds of each profile; by default 5, and 8 with
    ``distributed`` (Note [Profile rounds per rank] in :mod:`.rank_runners`).
    """
    from remat.parallel.data_parallel import STRATEGIES as WRAPS

    if distributed is not None and distributed not in WRAPS:
        raise UsageError(f"distributed={distributed!r} is unknown; use one of "
                         f"{', '.join(WRAPS)}")
    if isinstance(compile_limit_s, bool) or not isinstance(compile_limit_s, (int, float)) \
            or compile_limit_s < 0:
        raise UsageError(f"compile_limit_s={compile_limit_s!r} is invalid; give seconds >= 0")
    settings = Settings(
        strategies=parse_strategies(strategies),
        budgets=tuple(Budget.parse(b) for b in parse_budgets(budgets)),  # read once, here
        optimizer=optimizer,
        repeats=whole(repeats, "repeats", 1),
        warmup=whole(warmup, "warmup", 0),
        verify_steps=whole(verify_steps, "verify_steps", 1),
        profile_repeats=profile_rounds(profile_repeats, distributed, 5),
        compile_limit_s=float(compile_limit_s),
        matched=matched,
        microbatch_budget=(
            None if microbatch_budget is None or distributed
            else Budget.parse(microbatch_budget)
        ),
        distributed=distributed,
        allocator=set_malloc(malloc),  # before the profile: it times steps too
    )
    with torch_threads(threads), _compiled_random(settings.strategies):
        return _run(model, options or {}, stages, settings, progress or _no_progress, command)


def _compiled_random(strategies: Sequence[str]) -> AbstractContextManager[Any]:
    """With ``remat+compile`` rows, the whole run compiles with inductor's
    ``fallback_random``: compiled dropout then draws from torch's generator as eager does,
    so those rows' gradients compare with eager's (as the compile rows' do: they set it
    per step). Every graph of a stage is compiled under it (the profile compiles them
    first, and Dynamo reuses a stage's graph across models)."""
    if REMAT_COMPILE not in strategies:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return cast(AbstractContextManager[Any], inductor_config.patch(fallback_random=True))


@dataclass(frozen=True)
class _Profiled:
    """The bench's model, loaded and profiled (eager, and with the stages compiled where a
    ``remat+compile`` row asks for it): what every later step of the run reads."""

    settings: Settings  # the rows the model and the ranks allow
    factory: Factory
    takes_batch: bool
    ranks: Ranks | None
    batch_size: int | None
    description: str
    environment: Environment
    prof: Profile
    problem: Problem  # per rank under ``distributed``
    compiled_factory: Factory | None
    compiled_prof: Profile | None
    compiled_problem: Problem | None
    # the first batch the factory built, alive to the end of the run as it always was
    # (the rows' absolute device peaks would count its release)
    first_batch: Any


def _run(
    model: str | Callable[..., Any],
    options: Mapping[str, Any],
    stages: Sequence[str] | None,
    s: Settings,
    progress: Progress,
    command: str | None,
) -> BenchReport:
    began = time.perf_counter()
    p = _profiled(model, options, stages, s, progress)
    s = p.settings
    specs = plan_rows(p.problem, s.strategies, s.budgets, p.compiled_problem)
    run = _Bench(p.factory, s.optimizer, s.verify_steps, progress, p.ranks,
                 compiled_factory=p.compiled_factory)
    try:
        matched, compile_status = _measure_rows(run, specs, p)
    finally:
        run.close()
        if p.ranks is not None:
            import torch.distributed as dist

            dist.barrier()  # every rank done before any tears its group down
    if p.ranks is None:  # per rank, the profile's rounds are one process's
        _paired_predictions(run.rows, [*specs, *matched], p.prof, p.compiled_prof)
    micro = None
    if s.microbatch_budget is not None:
        micro = compare_microbatches(
            p.factory, p.prof, s.microbatch_budget.bytes(p.problem),
            str(s.microbatch_budget), strategies=[n for n in s.strategies if n != "compile"],
            optimizer=s.optimizer, repeats=max(3, s.repeats // 2),
            usable=p.takes_batch and p.batch_size is not None, global_batch=p.batch_size,
            progress=progress,
        )
    rows = tuple(run.rows.values())
    return BenchReport(
        model=p.description,
        environment=p.environment,
        optimizer=s.optimizer,
        batch_size=p.batch_size,
        budgets=tuple(str(b) for b in s.budgets),
        strategies=s.strategies,
        repeats=s.repeats,
        warmup=s.warmup,
        no_checkpoint_peak_bytes=p.prof.measured_peak_bytes,
        rows=rows,
        findings=findings(rows, micro),
        microbatch=micro,
        compile_status=compile_status,
        elapsed_s=time.perf_counter() - began,
        command=command,
        timelines=dict(run.timelines),
    )


def _profiled(
    model: str | Callable[..., Any],
    options: Mapping[str, Any],
    stages: Sequence[str] | None,
    s: Settings,
    progress: Progress,
) -> _Profiled:
    """Load the model (one rank's shard under ``distributed``), take its first step and
    profile it; again with its stages compiled for ``remat+compile`` rows."""
    with step("loading the model"):  # importing a factory file runs the user's code
        factory, takes_batch = make_factory(model, options)
    ranks = None
    if s.distributed is not None:
        from remat.parallel.ranks import init_from_env

        ranks = Ranks(s.distributed, init_from_env())
        factory = ranks.shard(factory)
        s = replace(s, strategies=tuple(n for n in s.strategies
                                        if n not in ("compile", REMAT_COMPILE)))
    with step("loading the model"):
        model0, batch0, loss0 = factory(None)
    if ranks is None:  # a wrapped model's step is a collective: leave it to the profile
        first_step(model0, batch0, loss0)
    s = replace(s, strategies=with_default_rows(s.strategies, model0))
    batch_size = batch_size_of(options, batch0)
    description = describe(model, options)
    scaling = None
    if s.microbatch_budget is not None and takes_batch and batch_size:
        scaling = (batch_size, batch_size // 2) if batch_size > 1 else (1, 2)
    with step("profiling", diagnose=lambda err: hazard_reason(err, lambda: factory(None), stages)):
        prof = _profile(factory, scaling, stages, s.optimizer, s.profile_repeats, description,
                        progress)
    if ranks is not None:
        prof = rank_zeros(prof)
    problem: Problem = to_problem(prof)
    environment = describe_environment(
        model0, batch0, loss0, dtype=prof.dtype, device=prof.device,
        rank=None if ranks is None else ranks.info.rank,
        world_size=None if ranks is None else ranks.info.world_size,
        distributed=s.distributed,
        malloc=s.allocator,
    )
    if ranks is not None:
        ranks.stages = prof.stage_names
        problem = rank_problem(problem, ranks, factory, s.optimizer, s.profile_repeats)
    del model0
    compiled_factory = compiled_problem = compiled_prof = None
    if REMAT_COMPILE in s.strategies:
        compiled_factory = compiling(factory, stages)
        with step("profiling the compiled stages",
                  diagnose=lambda err: hazard_reason(err, lambda: factory(None), stages)):
            compiled_prof = _profile(compiled_factory, None, stages, s.optimizer,
                                     s.profile_repeats, f"{description} (stages compiled)",
                                     progress)
        compiled_problem = to_problem(compiled_prof)
    return _Profiled(s, factory, takes_batch, ranks, batch_size, description, environment,
                     prof, problem, compiled_factory, compiled_prof, compiled_problem,
                     first_batch=batch0)


def _measure_rows(run: _Bench, specs: Sequence[RowSpec], p: _Profiled
                  ) -> tuple[list[RowSpec], str]:
    """Measure every row: the planned eager rows, remat at each baseline's peak (the
    matched rows, returned), the compile rows (their status returned) and remat's
    compiled plan at theirs; then time them all."""
    s = p.settings
    run.eager([r for r in specs if r.strategy != "compile"])
    matched: list[RowSpec] = []
    if s.matched and "remat" in s.strategies:
        # The larger of the baseline's measured and predicted peak: its own plan then
        # fits the budget in the simulator, so remat's choice includes it.
        peaks = {
            r.strategy: max(r.measured_peak_bytes, r.predicted_peak_bytes or 0)
            for r in run.rows.values()
            if r.budget is None and r.measured_peak_bytes is not None
        }
        matched = matched_rows(p.problem, peaks)
        run.eager(matched)
    compile_status = run.compiled([r for r in specs if r.strategy == "compile"],
                                  s.compile_limit_s)
    if p.compiled_problem is not None and "compile" in s.strategies:
        # remat's compiled plan at each compile row's measured peak
        at_compile = {
            r.key: r.measured_peak_bytes for r in run.rows.values()
            if r.strategy == "compile" and r.measured_peak_bytes is not None
        }
        compile_matched = matched_rows(p.compiled_problem, at_compile, REMAT_COMPILE,
                                       reference=p.problem)
        run.eager(compile_matched)
        matched += compile_matched
    run.time_all(s.repeats, s.warmup)
    return matched, compile_status


def _paired_predictions(rows: dict[str, Row], specs: Sequence[RowSpec], prof: Profile,
                        compiled: Profile | None = None) -> None:
    """Each planned row's predicted overhead as the median of the profile's per-round ratios,
    the statistic its measured overhead is (Note [Paired overhead] in remat/core/solve/paired.py);
    rows keep the ratio of the medians where the profile kept no rounds. A ``remat+compile``
    row's overhead is measured against the eager model without checkpointing: its
    prediction is its plan's step (priced on the ``compiled`` profile) over the eager
    profile's plain step, a ratio of medians from two profiles."""
    from remat.core.solve.paired import paired_overhead

    for spec in specs:
        row = rows.get(spec.key)
        if row is None or spec.plan is None or row.predicted_overhead is None:
            continue
        if spec.strategy == REMAT_COMPILE:
            step_s = spec.plan.predicted_step_time_s
            known = bool(step_s and prof.step_s)
            rows[spec.key] = replace(
                row,
                predicted_overhead=step_s / prof.step_s - 1 if step_s and known else None,
                predicted_rebuild_time_s=step_s - prof.step_s if step_s and known else None,
            )
            continue
        paired = paired_overhead(spec.plan, prof)
        if paired is not None:
            rows[spec.key] = replace(row, predicted_overhead=paired)


