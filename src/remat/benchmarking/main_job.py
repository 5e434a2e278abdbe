"""``remat.auto``: the main job in one call: profile, plan, apply, verify, measure.

The plan is remat's optimal one under the budget; its predicted peak and step time come
from the simulator. Measurement runs the plain model and the planned one side by side
(the tracker for the peak, interleaved steps for the time). Whatever disagrees (a
measured peak over the budget, a prediction off by more than 5%, gradients that differ)
is listed in ``problems``, never hidden; ``ok`` is True only when there are none.

The job is one function per step (:func:`_load`, :func:`_profile`, :func:`_plan`,
:func:`_apply`, :func:`_verify`, :func:`_measure`), run in order by :func:`run_auto`.
What differs between one process and a rank of a ``torchrun`` job is a call on the
strategy passed in (:mod:`.auto_strategy`), never a test in the steps; the report and the
statistics it is judged by are :mod:`.auto_report`'s.

A run that cannot go on raises :class:`Stopped`, which names the step (loading the model,
the first training step, profiling, planning, applying, verifying, measuring) and says
why in one sentence: the user's own code failing (factory, forward, loss) is a
:class:`~remat.core.errors.UserCodeError` (exit 3); a rebuild torch rejects is described by
the hazard ``remat verify`` finds.

Note [auto per rank]: under ``torchrun`` with ``distributed`` set, every rank runs the same
steps on its shard of the batch (the collectives of a wrapped model's step need all of
them): it profiles its plain model, and all take rank 0's profile so that they choose the
same plan; the per-rank problem (``remat.core.transforms``, as ``remat bench
--distributed``) gives the budget's meaning (a fraction of the largest rank's peak without
checkpointing) and the plan. Each rank verifies the plan on its plain model (no
collective: gradients are a property of the plan), wraps the plain and the planned model
(DDP after ``apply``, FSDP2 one unit per stage before it), reads its per-rank peaks from
the allocator's events and times the two interleaved; a decision to time more pairs is
taken by all ranks when one needs it. The predicted overhead is the per-rank problem's
ratio of medians (the profile's rounds are one process's), and the plan is not checked
against the timing noise's draws, which re-solve the one-process problem.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from remat.core.coverage import coverage_lines
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan
from remat.core.planner import with_made_for
from remat.core.profile_format import Profile
from remat.core.solve import Problem, minimum_budget, simulate
from remat.core.solve.budget import Budget
from remat.core.solve.uncertainty import PlanUncertainty, plan_uncertainty
from remat.measure.malloc import set_malloc
from remat.profiling.noise import median_se
from remat.profiling.profiler import profile

from .auto_report import (
    MEDIANS,
    PAIRED,
    AutoReport,
    FirstAttempt,
    apart,
    interquartile,
    problems,
)
from .auto_strategy import DISTRIBUTED, AutoStrategy, strategy_for
from .environment import Environment, describe_environment
from .factory import compiling, describe, make_factory, torch_threads, whole
from .grads import GradCheck, check_plan
from .rank_runners import profile_rounds
from .runners import Factory, Runner
from .step_measures import MemoryMeasure, interleaved, paired, time_stats
from .stopping import (
    STAGES,
    Stopped,
    exit_words,
    first_step,
    hazard_reason,
    rebuild_rejected,
    step,
)

__all__ = ["MEDIANS", "PAIRED", "STAGES", "AutoReport", "FirstAttempt", "ModelSpec",
           "Rounds", "Stopped", "auto", "exit_words", "first_step", "hazard_reason",
           "rebuild_rejected", "run_auto", "step", "torch_threads_kept"]

#: ``progress(what, done, total)``: where the job is
Progress = Callable[[str, int, int], None]


@contextmanager
def torch_threads_kept() -> Iterator[None]:
    """torch's intra-op thread count as it was on entry, again on exit.

    The optimal solver's numba kernel runs on numba's OpenMP layer, which sets the
    process's OpenMP thread count, the one torch's CPU ops use: after a solve under
    ``--threads 1`` torch ran on two threads, and on a loaded two-core machine each
    plain gpt step then took 15x as long while ``auto`` measured as while it profiled.
    """
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


#: Per-pair ratios whose interquartile range is wider than this (a share of the plain
#: step) are timed again with twice as many pairs (Note [Re-timing wide pairs]).
PAIRS_SPREAD = 0.05
#: Then pairs are added, twice the first count at a time, while the standard error of the
#: median per-pair ratio is above this, up to MAX_PAIRS times the first count in all.
PAIRS_SE = 0.015
MAX_PAIRS = 8


def _spread(times: dict[str, list[float]]) -> float:
    """Note [Re-timing wide pairs]: on a shared machine one measurement's per-pair ratios
    spread up to 18 points between quartiles (noise_stability, mlp-hetero), wider than the
    5 points a prediction is judged by; the median of three times as many pairs moves
    less. The threshold is those 5 points: at 10, a gpt run whose quartiles were 9.5 points
    apart kept its first median, 5.6 points off the prediction that other runs met."""
    ratios = _pair_ratios(times)
    if len(ratios) < 4:
        return 0.0
    q1, q3 = interquartile(ratios)
    return q3 - q1


#: A measured overhead further than this from the prediction (points of the plain step)
#: makes ``remat auto`` profile and measure again (Note [Profiling again]): the accuracy
#: its overhead predictions are held to (issue 14).
AGAIN_GAP = 0.05


def _try_again(overheads: Sequence[float], predicted: float, u: PlanUncertainty) -> bool:
    """Whether the measured ``overheads`` and the prediction disagree enough to make both
    again: their medians more than :data:`AGAIN_GAP` apart, or their ranges apart.

    Note [Profiling again]: a measurement whose overheads lie apart from the prediction's
    range within the timing noise saw another machine than the profile did, in effect, and
    either side may have been the odd one: one ``remat auto`` of gpt in ten profiled while
    every rebuild took 1.3x its usual time, in all four rounds, and measured 11 s later at
    the usual cost (Note [Machine state between phases]); one of mlp-hetero measured
    +1.4% (quartiles -0.0%..+3.1%) where its other runs measured +5.6% to +9.9%, and a
    second profile predicted +7.5% as the first had (+6.0%) (noise_stability, 2026-12-03
    14:37). So ``remat auto`` makes both again, once: a second profile of a fresh plain
    model predicts the chosen plan's overhead, the pairs are timed again, and the report
    gives the second of each whether they agree or not, with the first kept beside them
    (:class:`FirstAttempt`). The plan is not chosen again: it was verified and measured.

    The trigger is also a gap of more than :data:`AGAIN_GAP` between the medians, ranges
    overlapping or not: a gpt run predicted +44.3% (+37.2%..+48.0% within the noise) and
    measured +35.7% (quartiles +33.7%..+38.4%), 8.7 points apart, where that model's runs
    measure +36% to +40% (noise_stability, 2026-12-03 14:50). What a second attempt changes
    is recorded: noise_stability marks each run that made one, with its first figures."""
    return (abs(statistics.median(overheads) - predicted) > AGAIN_GAP
            or apart(interquartile(overheads), u))


def _overheads(times: dict[str, list[float]]) -> list[float]:
    """Each interleaved pair's overhead: the planned step over the plain one, less 1."""
    return [r - 1 for r in _pair_ratios(times)]


def _covering(u: PlanUncertainty, overhead: float) -> PlanUncertainty:
    """``u`` with its range widened to cover ``overhead`` (another statistic of it)."""
    return replace(u, overhead_low=min(u.overhead_low, overhead),
                   overhead_high=max(u.overhead_high, overhead))


def _timed_pairs(steps: dict[str, Callable[[], Any]], job: _Job) -> dict[str, list[float]]:
    """Interleaved steps, and more pairs where they spread (Note [Re-timing wide pairs]):
    twice as many again when their quartiles lie over PAIRS_SPREAD apart, then more while
    their median is uncertain (bounded)."""
    repeats = job.rounds.repeats
    times = interleaved(
        steps, repeats=repeats, warmup=job.rounds.warmup,
        progress=lambda done, total: job.progress("timing (interleaved)", done, total),
    )
    added = 0
    while job.strategy.agreed(_more_pairs(times, repeats, added)):
        more = interleaved(
            steps, repeats=2 * repeats, warmup=0,
            progress=lambda done, total: job.progress("timing (more pairs)", done, total),
        )
        for name in times:
            times[name] += more[name]
        added += 1
    return times


def _pair_ratios(times: dict[str, list[float]]) -> list[float]:
    return [a / b for a, b in zip(times["planned"], times["plain"], strict=True) if b > 0]


def _more_pairs(times: dict[str, list[float]], repeats: int, added: int) -> bool:
    """Whether to time ``2 * repeats`` more pairs (Note [Re-timing wide pairs]).

    A busy machine spread one gpt measurement's per-pair ratios 20 points between
    quartiles (noise_stability, run 4 of 2026-12-01 22:38): the median of its 18 pairs
    has a standard error of about 4 points, most of the 5 a prediction is judged by. So
    after the first re-timing, pairs are added while that error
    (:func:`remat.profiling.noise.median_se`, of four pairs or more) is above
    :data:`PAIRS_SE`, up to :data:`MAX_PAIRS` times ``repeats`` pairs (about 20 s more on
    the built-in gpt).
    """
    if len(times["plain"]) + 2 * repeats > MAX_PAIRS * repeats:
        return False
    if added == 0:
        return _spread(times) > PAIRS_SPREAD
    ratios = _pair_ratios(times)
    return len(ratios) >= 4 and median_se(ratios) > PAIRS_SE


@dataclass(frozen=True)
class ModelSpec:
    """What the job runs: the model (a spec or a factory) and its options, the stages
    (None: discovered), the optimizer, and whether its stages are compiled."""

    model: str | Callable[..., Any] = "gpt"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    stages: Sequence[str] | None = None
    optimizer: str = "adamw"
    compile: bool = False


@dataclass(frozen=True)
class Rounds:
    """How many steps each phase runs: timed pairs (``repeats``, after ``warmup``), the
    verify harness's steps, and the profile's timed rounds."""

    repeats: int = 6
    warmup: int = 1
    verify_steps: int = 2
    profile_repeats: int = 2


@dataclass(frozen=True)
class _Job:
    """One run's fixed parts, and the seconds each phase took (``timed``)."""

    spec: ModelSpec
    rounds: Rounds
    strategy: AutoStrategy
    progress: Progress
    timings: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        self.timings[phase] = time.perf_counter() - began


@dataclass(frozen=True)
class _Loaded:
    """The model's factory (this process's part of the batch) and its description."""

    factory: Factory
    description: str
    stages: Sequence[str] | None

    def diagnose(self, err: BaseException) -> str:
        return hazard_reason(err, lambda: self.factory(None), self.stages)


@dataclass(frozen=True)
class _Planned:
    plan: Plan
    problem: Problem
    uncertainty: PlanUncertainty | None
    peak_event: str  # where the simulator puts the plan's peak


@dataclass(frozen=True)
class _Measured:
    """Both models' peaks and interleaved times, and the prediction they are held to."""

    plain: MemoryMeasure
    planned: MemoryMeasure
    times: dict[str, list[float]]
    pairs: tuple[float, ...]  # each pair's overhead
    profile: Profile  # the profile the prediction is of
    predicted_overhead: float | None  # Note [Paired overhead]; None: the problem's medians
    uncertainty: PlanUncertainty | None
    first_attempt: FirstAttempt | None = None


def auto(
    model: str | Callable[..., Any] = "gpt",
    *,
    options: Mapping[str, Any] | None = None,
    stages: Sequence[str] | None = None,
    budget: Budget | str | int | float = "50%",
    optimizer: str = "adamw",
    repeats: int = 6,
    warmup: int = 1,
    verify_steps: int = 2,
    profile_repeats: int | None = None,
    progress: Progress | None = None,
    malloc: str = "keep",
    threads: int | None = None,
    distributed: str | None = None,
    compile: bool = False,
) -> AutoReport:
    """Profile ``model``, plan it under ``budget``, verify the plan and measure it.

    ``model`` and ``options`` as in :func:`remat.benchmarking.bench`; ``budget`` is a whole-step
    peak (bytes, or a fraction of the measured peak without checkpointing). Raises
    :class:`Stopped` (a :class:`remat.RematError`) naming the step that could not go on:
    for a budget no plan fits, planning, exit code 1, with ``minimum_budget_bytes``.
    ``malloc`` as in :func:`remat.benchmarking.bench` (``keep`` steadies CPU step times);
    ``threads`` sets torch's intra-op threads for the run (restored after).
    ``distributed`` (``ddp`` or ``fsdp``, under ``torchrun``): every rank runs the job on
    its shard of the batch, plans with rank 0's profile under the per-rank problem (the
    same plan on every rank), and reports its own peak and time (Note [auto per rank]).
    ``compile``: every model built has its stages compiled (:func:`remat.compile_stages`);
    the profile, the plan, the check and the measurements are of the compiled program,
    and the overhead is against the compiled model without checkpointing.
    ``profile_repeats``: timed rounds of each profile; by default 2, and 8 with
    ``distributed`` (Note [Profile rounds per rank] in :mod:`.rank_runners`).
    """

    whole(repeats, "repeats", 1)
    profile_repeats = profile_rounds(profile_repeats, distributed, 2)
    rounds = Rounds(repeats, whole(warmup, "warmup", 0), whole(verify_steps, "verify_steps", 1),
                    profile_repeats)
    if threads is not None:
        whole(threads, "threads", 1)
    if distributed is not None and distributed not in DISTRIBUTED:
        raise UsageError(f"distributed={distributed!r} is unknown; use ddp or fsdp")
    if not isinstance(compile, bool):
        raise UsageError(f"compile={compile!r} is not a bool; pass True or False")
    if compile and distributed is not None:
        raise UsageError("compile=True does not run with distributed yet; drop one of them")
    spec = ModelSpec(model, options or {}, stages, optimizer, compile)
    with torch_threads(threads):
        return run_auto(spec, Budget.parse(budget), rounds, strategy_for(distributed),
                        progress=progress, malloc=malloc)


def run_auto(spec: ModelSpec, budget: Budget, rounds: Rounds, strategy: AutoStrategy, *,
             progress: Progress | None = None, malloc: str = "keep") -> AutoReport:
    """The main job's steps in order: load, profile, plan, apply, verify, measure.

    ``strategy`` (:mod:`.auto_strategy`) runs them in one process or on this rank of a
    ``torchrun`` job; the steps are the same.
    """
    began = time.perf_counter()
    allocator = set_malloc(malloc)
    job = _Job(spec, rounds, strategy, progress or (lambda _what, _done, _total: None))
    loaded = _load(job)
    prof, environment = _profile(job, loaded, allocator)
    chosen = _plan(job, loaded, prof, budget)
    plain, planned = _apply(job, loaded, chosen.plan)
    try:
        check = _verify(job, loaded, chosen.plan)
        measured = _measure(job, loaded, prof, chosen, plain, planned)
    finally:
        planned.close()
        plain.close()
        strategy.done()
    return _report(job, loaded, budget, chosen, measured, check, environment,
                   time.perf_counter() - began)


def _load(job: _Job) -> _Loaded:
    """The model's factory, compiled and sharded as the job asks (no model built yet)."""
    spec = job.spec
    with step("loading the model"):  # importing a factory file runs the user's code
        factory, _ = make_factory(spec.model, spec.options)
    description = describe(spec.model, spec.options)
    if spec.compile:
        factory = compiling(factory, spec.stages)
        description += " (stages compiled)"
    return _Loaded(job.strategy.shard(factory), description, spec.stages)


def _profile(job: _Job, loaded: _Loaded, allocator: str) -> tuple[Profile, Environment]:
    """The plain model built, one plain training step, its profile (every rank takes
    rank 0's) and the machine it ran on."""
    with job.timed("profile_s"):
        with step("loading the model"):
            net, batch, loss_fn = loaded.factory(None)
        first_step(net, batch, loss_fn)
        with step("profiling", diagnose=loaded.diagnose):
            prof = _profiled(job, loaded, net, batch, loss_fn, "profiling")
        prof = job.strategy.shared(prof)
        rank, world_size = job.strategy.rank()
        environment = describe_environment(
            net, batch, loss_fn, dtype=prof.dtype, device=prof.device, malloc=allocator,
            rank=rank, world_size=world_size, distributed=job.strategy.distributed)
    return prof, environment


def _profiled(job: _Job, loaded: _Loaded, net: Any, batch: Any,
              loss_fn: Callable[[Any, Any], Any], label: str) -> Profile:
    return profile(net, batch, loss_fn, loaded.stages, job.spec.optimizer,
                   repeats=job.rounds.profile_repeats, description=loaded.description,
                   progress=lambda what, done, total: job.progress(f"{label}: {what}", done,
                                                                   total))


def _plan(job: _Job, loaded: _Loaded, prof: Profile, budget: Budget) -> _Planned:
    """remat's optimal plan under ``budget`` for the strategy's problem; a budget no plan
    fits stops the job naming the least one that does."""
    job.progress("planning", 0, 1)
    with job.timed("plan_s"), step("planning"), torch_threads_kept():
        problem = job.strategy.problem(prof, loaded.factory, job.spec.optimizer,
                                       job.rounds.profile_repeats)
        try:
            chosen, uncertainty = job.strategy.choose(prof, problem, budget)
        except CheckFailed as err:  # no plan fits: say the least budget that does
            # and, when the stages cover little of the memory, that more stages would help
            lines = coverage_lines(prof, given=loaded.stages is not None)
            raise Stopped("planning", "; ".join([str(err), *lines]), err.exit_code,
                          minimum_budget(problem)) from err
        plan = with_made_for(chosen, prof)
        return _Planned(plan, problem, uncertainty, simulate(plan, problem).peak_event)


def _apply(job: _Job, loaded: _Loaded, plan: Plan) -> tuple[Runner, Runner]:
    """Two fresh models: the plain one, and one with ``plan`` applied."""
    job.progress("applying", 0, 1)
    optimizer = job.spec.optimizer
    with step("applying"):
        plain = job.strategy.runner(*loaded.factory(None), optimizer, None)
        planned = job.strategy.runner(*loaded.factory(None), optimizer, plan)
    return plain, planned


def _verify(job: _Job, loaded: _Loaded, plan: Plan) -> GradCheck:
    """``remat.verify`` of ``plan`` on a fresh plain model (no collective: gradients are a
    property of the plan)."""
    job.progress("verifying", 0, 1)
    with job.timed("verify_s"), step("verifying", diagnose=loaded.diagnose):
        return check_plan(loaded.factory, plan, optimizer=job.spec.optimizer,
                          steps=job.rounds.verify_steps)


def _measure(job: _Job, loaded: _Loaded, prof: Profile, chosen: _Planned, plain: Runner,
             planned: Runner) -> _Measured:
    """Both models' peaks and interleaved step times, against the prediction; made again
    once where they disagree (Note [Profiling again])."""
    job.progress("measuring", 0, 1)
    steps = {"plain": plain.step, "planned": planned.step}
    with job.timed("measure_s"):
        # Note [Paired overhead]: the median of per-round ratios where the profile kept its
        # rounds, the statistic the measured overhead is
        predicted = job.strategy.predicted_overhead(chosen.plan, prof)
        uncertainty = chosen.uncertainty
        if predicted is not None and uncertainty is not None:
            # the range within the noise covers both statistics
            uncertainty = _covering(uncertainty, predicted)
        with step("measuring", diagnose=loaded.diagnose):
            memory = job.strategy.measure(plain), job.strategy.measure(planned)
            times = _timed_pairs(steps, job)
    first = _Measured(*memory, times, tuple(_overheads(times)), prof, predicted, uncertainty)
    return _again(job, loaded, chosen, first, steps)


def _again(job: _Job, loaded: _Loaded, chosen: _Planned, first: _Measured,
           steps: dict[str, Callable[[], Any]]) -> _Measured:
    """``first``, or, where it lies off its prediction, a second profile's prediction and
    a second measurement, with ``first`` kept beside them (Note [Profiling again])."""
    predicted, u = first.predicted_overhead, first.uncertainty
    if (not job.strategy.profiles_again or predicted is None or u is None
            or not _try_again(first.pairs, predicted, u)):
        return first
    with job.timed("again_s"):
        with step("profiling again", diagnose=loaded.diagnose):
            again = _profiled(job, loaded, *loaded.factory(None), "profiling again")
        second = job.strategy.predicted_overhead(chosen.plan, again)
        second_range = plan_uncertainty(again, chosen.plan, slots=chosen.problem.slots)
        if second is None or second_range is None:
            return first
        earlier = FirstAttempt(replace(u, overhead=predicted), first.pairs, first.profile)
        with step("measuring again", diagnose=loaded.diagnose):
            times = _timed_pairs(steps, job)
        return replace(first, times=times, pairs=tuple(_overheads(times)), profile=again,
                       predicted_overhead=second, uncertainty=_covering(second_range, second),
                       first_attempt=earlier)


def _report(job: _Job, loaded: _Loaded, budget: Budget, chosen: _Planned, m: _Measured,
            check: GradCheck, environment: Environment, elapsed_s: float) -> AutoReport:
    plan, times = chosen.plan, m.times
    ratio, _ = paired(times["planned"], times["plain"])
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
    predicted, statistic = m.predicted_overhead, PAIRED
    if predicted is None:  # per rank: the per-rank problem's ratio of medians
        statistic = MEDIANS
        if plan.predicted_step_time_s and plan.baseline_step_time_s:
            predicted = plan.predicted_step_time_s / plan.baseline_step_time_s - 1
    return AutoReport(
        model=loaded.description,
        budget=str(budget),
        budget_bytes=plan.budget_bytes,
        plan=plan,
        baseline_peak_bytes=m.plain.peak_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=m.planned.peak_bytes,
        predicted_peak_event=chosen.peak_event,
        peak_phase=m.planned.peak_phase,
        peak_module=m.planned.peak_module,
        peak_by_category=dict(m.planned.by_category or {}),
        baseline_peak_by_category=dict(m.plain.by_category or {}),
        baseline_step_time_s=time_stats(times["plain"]).median_s,
        step_time_s=time_stats(times["planned"]).median_s,
        overhead=ratio - 1,
        overhead_pairs=m.pairs,
        uncertainty=m.uncertainty,
        predicted_overhead=predicted,
        predicted_overhead_statistic=statistic,
        first_attempt=m.first_attempt,
        verify_ok=bool(check.verify_ok),
        grads_match=check.grads_match,
        verify_detail=check.detail,
        problems=problems(plan.budget_bytes, plan.predicted_peak_bytes,
                          m.planned.peak_bytes, bool(check.verify_ok), check.detail),
        environment=environment,
        timings_s=job.timings,
        elapsed_s=elapsed_s,
        profile=m.profile,
    )
