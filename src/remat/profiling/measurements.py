"""One profiling run: every measurement a Profile is built from, in a fixed order.

It costs ``(4 + s) * (repeats + 1)`` training steps (``s`` selective options; one fewer
per round where no region can span two stages; up to
``repeats`` rounds more when the first ones were noisy, :mod:`.noise`), one step
measured by the tracker and up to four tracked forwards:

1. a forward that saves nothing (what a stage costs inside a region; which outputs stay
   referenced outside the chain; what ``selective:save-nothing`` keeps), and a forward
   with one region over the whole chain that finds the links no region may span
   (:mod:`.links`);
2. ``repeats + 1`` rounds of training steps, each round one step with one region per
   stage (timing each stage's rebuild), one with a region over each longest run of stages
   no break divides (what a link inside a region costs, Note [Links inside a region] in
   :mod:`.optimes`), one plain step (timing each stage's forward and backward), the same
   without hooks (the step without checkpointing as it runs, :func:`.timing.bare_step_s`;
   the time outside the chain is what it took beyond the stages) and one step with each
   selective option on every stage (what the option
   costs each stage, :mod:`.optimes`); the first round is a warm-up whose times are
   dropped (it creates the optimizer state, right after which the tracker counts
   parameters, buffers, gradients, optimizer state and the batch, and it grows the
   allocator to the step's size), and its plain step records which stages are identical
   (:mod:`.identical`), whose times are pooled (:mod:`.pooling`); a noisy set of rounds
   gets one more set (:func:`.noise.extra_rounds`);
3. one step measured by ``measure_step`` with a timeline (see :mod:`.timeline`);
4. for each selective option, one forward with the option applied to the stages that run
   one of its ops (an eager stage that runs none keeps what ``save-nothing`` keeps; a
   compiled stage is measured under every option, as it runs the option compiled in), and one step
   measured with a timeline with the option on every stage (each stage's backward with
   its replay), plus one such step under ``save-nothing`` (:func:`_replayed`);
5. the fixed cost of one region on a chain of tiny stages (:mod:`.overhead`), the floor
   under what the steps with a region per stage show (:func:`.optimes.region_overhead_s`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import maybe_get_fake_mode

import remat.plans as plans
from remat.core.plan_format import KEEP, Option, Plan, Region
from remat.core.stage_record import HeldRead
from remat.measure import LiveMemoryTracker, StepMemory, measure_step
from remat.measure.tracker import iter_tensors
from remat.profiling._tensors import buffers_restored
from remat.profiling.casts import cast_cache
from remat.profiling.identical import recording_signatures
from remat.profiling.links import find_breaks
from remat.profiling.noise import MAX_ADDED_ROUNDS, PAIRED_SE, extra_rounds, paired_se
from remat.profiling.optimes import policy_op_names, spanning_regions
from remat.profiling.overhead import RegionOverhead, region_overhead
from remat.profiling.passes import ForwardPass, forward_pass
from remat.profiling.pooling import identical_groups
from remat.profiling.stage_ops import StageOps, eager_stage_ops
from remat.profiling.timeline import Span, StepSpans, rebuild_starts, split_step
from remat.profiling.timing import StepTimes, bare_step_s, timed_steps
from remat.runtime import apply
from remat.runtime.compiled_stages import compiled_flags
from remat.runtime.stage_calls import call_names, stage_submodule

__all__ = ["Measurements", "measure_all", "part_names"]

Progress = Callable[[str, int, int], None]
LossFn = Callable[[nn.Module, Any], Any]


def _with_saved(reads: tuple[tuple[HeldRead, ...], ...],
                saved_inputs: Sequence[frozenset[int]]) -> tuple[tuple[HeldRead, ...], ...]:
    """``reads`` with the boundaries the code before each stage saves marked saved."""
    return tuple(
        tuple(replace(r, saved=True)
              if r.boundary and not r.by_call and r.made_after in saved else r
              for r in stage_reads)
        for stage_reads, saved in zip(reads, saved_inputs, strict=True)
    )


@dataclass(frozen=True)
class Measurements:
    names: tuple[str, ...]
    options: tuple[str, ...]  # keep and the selective options asked for
    nosave: ForwardPass
    breaks: tuple[str | None, ...]  # per stage: why no region may enter it from the previous
    reads: tuple[tuple[HeldRead, ...], ...]  # per stage: what it reads from before it
    before_chain_grads: tuple[int, ...]  # per stage: gradients of pre-chain tensors pending
    plain_steps: tuple[StepTimes, ...]  # round by round, paired with the two below
    per_stage_steps: tuple[StepTimes, ...]  # one region per stage
    option_steps: dict[str, tuple[StepTimes, ...]]  # option -> its steps, round by round
    step: StepMemory
    spans: StepSpans
    selective: dict[str, ForwardPass]  # option -> pass (only options some stage needs)
    plain_pass: ForwardPass | None  # a saving pass without checkpointing, with `selective`
    # option -> each stage's backward (its replay included) in a step with the option on
    # every stage; save-nothing's always when a selective option was asked for
    selective_backward: dict[str, tuple[Span, ...]]
    measured_in: dict[str, frozenset[int]]  # option -> stages measured in its pass
    counts: dict[str, int]  # params_bytes, buffers_bytes, grads_bytes, ... by the tracker
    overhead: RegionOverhead
    same_as: tuple[int, ...] = ()  # per stage: the first stage identical to it (pooling)
    extra_rounds: int = 0  # rounds added because the first ones were noisy
    compiled: tuple[bool, ...] = ()  # per stage: whether its forward is compiled
    # regions over the longest runs no break divides (two stages or more each), and the
    # steps with them applied, round by round (Note [Links inside a region])
    spanning: tuple[tuple[int, int], ...] = ()
    spanning_steps: tuple[StepTimes, ...] = ()
    # round by round: the plain step timed without hooks (timing.bare_step_s)
    bare_steps: tuple[float, ...] = ()
    # per stage: what its backward made before its rebuild began, in a step with one
    # region per stage (Note [What a rebuild starts with] in remat.core.solve.simulator)
    rebuild_grads: tuple[int, ...] = ()
    # per stage: what autocast's cache keeps of its parameters' casts, and what of that
    # autograd does not save (remat.profiling.casts)
    cast_cache: tuple[int, ...] = ()
    cast_unsaved: tuple[int, ...] = ()
    pre_chain_casts: int = 0

    @property
    def plain_step_s(self) -> tuple[float, ...]:
        """Round by round, the step without checkpointing: timed bare where it was (its
        hooks cost it about 1%, :func:`.timing.bare_step_s`)."""
        return self.bare_steps or tuple(s.step_s for s in self.plain_steps)

    @property
    def outside_rounds(self) -> tuple[float, ...]:
        """Round by round, what the step without checkpointing took beyond the stages'
        forward and backward (the pre-chain, post-chain and optimizer step)."""
        return tuple(t - sum(s.fwd_s) - sum(s.bwd_s)
                     for t, s in zip(self.plain_step_s, self.plain_steps, strict=True))

    @property
    def selective_options(self) -> tuple[str, ...]:
        return tuple(o for o in self.options if Option(o).is_selective)


def part_names(options: Sequence[str]) -> list[str]:
    """The parts of a run, as reported to ``progress``."""
    selective = [o for o in options if Option(o).is_selective]
    return [
        "no-save forward",
        "rebuild timing",
        "timed steps",
        "measured step",
        *(f"saved bytes, {o}" for o in selective),
        "region overhead",
    ]


def _fixed_counts(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, device: torch.device | None
) -> dict[str, int]:
    tracker = LiveMemoryTracker(device=device, track_saved=False, cuda_stats=False)
    tracker.register_existing(model)
    tracker.register_existing(optimizer)
    tracker.register_existing(list(iter_tensors(batch)))
    live = tracker.live_by_category
    return {
        "params_bytes": live.parameters_bytes,
        "buffers_bytes": live.buffers_bytes,
        "grads_bytes": live.gradients_bytes,
        "optimizer_state_bytes": live.optimizer_state_bytes,
        "inputs_bytes": live.inputs_bytes,
    }


NOTHING = Option.selective("save-nothing")


def _replayed(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    names: tuple[str, ...],
    optimizer: torch.optim.Optimizer,
    option: str | Plan,
) -> tuple[Span, ...]:
    """Each stage's backward, its replay included, in one step with ``option`` on every
    stage (or ``option`` a plan: its options, no regions).

    A selective stage replays its unsaved ops at its backward, and that replay can peak
    above what keep's backward holds (a block ending in a ReLU makes its output again):
    measured, for the problem to offer an option only where the simulator's figure covers
    it (docs/cost-model.md, assumption 7).
    """
    plan = option if isinstance(option, Plan) else Plan(
        stages=names, options=(option,) * len(names), solver="profile")
    step = _planned_step(model, batch, loss_fn, optimizer, plan)
    return split_step(step, names).stage_backward


def _planned_step(model: nn.Module, batch: Any, loss_fn: LossFn,
                  optimizer: torch.optim.Optimizer, plan: Plan) -> StepMemory:
    """One step with ``plan`` applied, its timeline kept, the buffers put back."""
    handle = apply(model, plan)
    gc.freeze()
    try:
        with buffers_restored(model):
            return measure_step(model, batch, loss_fn, optimizer, warmup_steps=0,
                                timeline=True, call_names=call_names(model, plan.stages))
    finally:
        gc.unfreeze()
        handle.remove()


def _rebuild_grads(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    names: tuple[str, ...],
    optimizer: torch.optim.Optimizer,
    plan: Plan,
) -> tuple[int, ...]:
    """Per stage, what its backward made before its region's rebuild began, in one step
    with ``plan`` (one region per stage): under autocast, the incoming gradient cast to the
    lower dtype at a mixed-dtype residual add (:func:`.timeline.rebuild_starts`)."""
    return rebuild_starts(_planned_step(model, batch, loss_fn, optimizer, plan), names)


def measure_all(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    names: Sequence[str],
    optimizer: torch.optim.Optimizer,
    *,
    options: Sequence[str],
    repeats: int,
    device: torch.device | None,
    dtype: torch.dtype,
    progress: Progress,
    agree: Callable[[int], int] | None = None,
    timed: bool = True,
) -> Measurements:
    """Run every measurement (module docstring); the model must be in training mode.

    ``agree(n)``: the count every rank uses where this rank would use ``n`` (rounds added
    to a noisy profile), so ranks whose steps communicate run the same steps.
    ``timed=False`` (a fake profile): no step that only times something (the spanning
    regions', the bare one, each option's: taken as the plain step of the round), no
    round after the warm-up (whose steps are kept) and none added for noise.
    """
    names = tuple(names)
    run = _Run(model, batch, loss_fn, optimizer, names,
               tuple(stage_submodule(model, name) for name in names), device)
    compiled = _compiled(run)
    # a partitioned option no stage is offered is not measured (nor recorded)
    options = tuple(o for o in options if any(compiled.offered(o, i) for i in range(len(names))))
    part = _Parts(part_names(options), progress)

    part()
    nosave = forward_pass(model, batch, loss_fn, names, device=device, save=False)
    links = find_breaks(model, batch, loss_fn, names)

    part()
    steps = _round_plans(run, options, compiled, links.breaks, timed)
    rounds = _timed_rounds(run, steps, part, repeats=repeats, timed=timed,
                           agree=agree or _same)

    part()
    step, spans = _measured_step(run, compiled)
    options_measured = _options_measured(run, options, steps, compiled, spans, part)
    rebuild_grads = _rebuild_grads(model, batch, loss_fn, names, optimizer, steps.per_stage)
    cached, unsaved, pre_casts = _casts(run, compiled)

    part()
    overhead = region_overhead(dtype=dtype, device=device)
    return Measurements(
        names=names,
        options=options,
        nosave=nosave,
        breaks=links.breaks,
        reads=_with_saved(links.reads, nosave.link_saved_inputs),
        before_chain_grads=links.before_chain_grad_bytes,
        plain_steps=tuple(rounds.plain),
        per_stage_steps=tuple(rounds.rebuilt),
        rebuild_grads=rebuild_grads,
        cast_cache=cached,
        cast_unsaved=unsaved,
        pre_chain_casts=pre_casts,
        spanning=steps.spanning,
        spanning_steps=tuple(rounds.spanned),
        bare_steps=tuple(rounds.bare),
        option_steps={option: tuple(s) for option, s in rounds.with_option.items()},
        step=step,
        spans=spans,
        selective=options_measured.selective,
        plain_pass=options_measured.plain_pass,
        selective_backward=options_measured.selective_backward,
        measured_in=options_measured.measured_in,
        counts=rounds.counts,
        overhead=overhead,
        same_as=rounds.same_as,
        extra_rounds=rounds.extra,
        compiled=compiled.flags,
    )


def _same(n: int) -> int:
    return n


@dataclass(frozen=True)
class _Run:
    """What every measured step takes: the model, its batch, loss and optimizer, the
    stages (by name and as modules) and the device."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    device: torch.device | None


class _Parts:
    """Tells ``progress`` each part of the run as it begins, in :func:`part_names`' order."""

    def __init__(self, parts: list[str], progress: Progress) -> None:
        self.parts = parts
        self.progress = progress
        self.done = 0

    def __call__(self) -> None:
        self.progress(self.parts[self.done], self.done, len(self.parts))
        self.done += 1


@dataclass(frozen=True)
class _Compiled:
    """Per stage, whether its forward is compiled, and with any compiled, each stage's
    ops from one eager forward.

    Compiled stages run their ops inside graphs, out of the tracker's sight: their ops
    come from one eager forward, and with them which stages draw random numbers, where a
    partitioned option is not offered (Note [Partitioned options on compiled stages]).
    """

    flags: tuple[bool, ...]
    eager: StageOps | None

    def offered(self, option: str, i: int) -> bool:
        """Whether stage ``i`` is offered ``option``."""
        if not Option(option).is_partitioned:
            return True
        return self.flags[i] and self.eager is not None and not self.eager.random[i]


def _compiled(run: _Run) -> _Compiled:
    flags = compiled_flags(run.model, run.names)
    eager = (eager_stage_ops(run.model, run.batch, run.loss_fn, run.names) if any(flags)
             else None)
    return _Compiled(flags, eager)


@dataclass(frozen=True)
class _RoundPlans:
    """The plans a round of timed steps applies (each step's own, :func:`_one_round`)."""

    per_stage: Plan  # one region per stage
    options: dict[str, Plan]  # selective option -> it on every stage offered it
    # regions over the longest runs no break divides (Note [Links inside a region])
    spanning: tuple[tuple[int, int], ...]
    spanning_plan: Plan | None  # those regions, where there are any


def _round_plans(run: _Run, options: tuple[str, ...], compiled: _Compiled,
                 breaks: tuple[str | None, ...], timed: bool) -> _RoundPlans:
    names = run.names
    spanning = spanning_regions(breaks) if timed else ()
    return _RoundPlans(
        per_stage=plans.per_stage(run.model, stages=names),
        options={
            option: Plan(stages=names, solver="profile", options=tuple(
                option if compiled.offered(option, i) else KEEP for i in range(len(names))))
            for option in options
            if Option(option).is_selective
        },
        spanning=spanning,
        spanning_plan=(Plan(names, tuple(Region(a, b) for a, b in spanning),
                            solver="profile") if spanning else None),
    )


@dataclass
class _Rounds:
    """The timed steps, round by round as they run (each round appends to every list),
    and what the warm-up round found."""

    rebuilt: list[StepTimes] = field(default_factory=list)  # one region per stage
    spanned: list[StepTimes] = field(default_factory=list)
    bare: list[float] = field(default_factory=list)
    plain: list[StepTimes] = field(default_factory=list)
    with_option: dict[str, list[StepTimes]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # by the tracker, at the warm-up
    same_as: tuple[int, ...] = ()  # per stage: the first stage identical to it
    extra: int = 0  # rounds added because the first ones were noisy

    def count_fixed(self, run: _Run) -> None:
        """The fixed bytes by the tracker, after the first step that has them all."""
        if not self.counts:
            self.counts.update(_fixed_counts(run.model, run.optimizer, run.batch, run.device))

    def without_warm_up(self) -> _Rounds:
        return replace(self, rebuilt=self.rebuilt[1:], spanned=self.spanned[1:],
                       bare=self.bare[1:], plain=self.plain[1:],
                       with_option={o: s[1:] for o, s in self.with_option.items()})


def _timed_rounds(run: _Run, steps: _RoundPlans, part: _Parts, *, repeats: int,
                  timed: bool, agree: Callable[[int], int]) -> _Rounds:
    """The warm-up round, ``repeats`` rounds, and those a noisy set adds; the warm-up's
    times dropped where later rounds ran.

    Plain, per-stage and selective steps alternate, so all see the same machine (a loaded
    one slows them alike), and the first round is a warm-up whose times are dropped: it
    creates the optimizer state and grows the allocator to the step's size, which made
    the step without checkpointing look up to 40% slower than it is.
    """
    rounds = _Rounds(with_option={option: [] for option in steps.options})
    signatures: list[str | None] = []
    _one_round(run, steps, rounds, timed, signatures)
    part()
    # untimed (a fake profile: its times are the fake run's dispatch, replaced by a
    # device's roofline or meaningless), the warm-up round is the one round: it counted
    # the fixed bytes and recorded which stages are identical, all later rounds would
    if not timed:
        return replace(rounds, same_as=tuple(identical_groups(signatures)))
    for _ in range(repeats):
        _one_round(run, steps, rounds, timed)
    rounds.same_as = tuple(identical_groups(signatures))
    # A noisy first set gets one more (bounded): more samples move the medians less.
    rounds.extra = agree(extra_rounds(
        rounds.plain[1:], rounds.same_as, repeats,
        others=[rounds.rebuilt[1:], *([rounds.spanned[1:]] if rounds.spanned else []),
                *(s[1:] for s in rounds.with_option.values())],
        per_stage=rounds.rebuilt[1:]))
    for _ in range(rounds.extra):
        _one_round(run, steps, rounds, timed)
    # Note [Rounds for the paired overhead]: then one at a time while the per-round
    # overhead's median is uncertain, up to MAX_ADDED_ROUNDS in all and at most as many
    # as there are already (a profile's timed steps at most double: a large model's
    # rounds take minutes)
    so_far, added = repeats + rounds.extra, 0
    while (rounds.extra < MAX_ADDED_ROUNDS and added < so_far
           and agree(int(paired_se(rounds.plain[1:], rounds.rebuilt[1:]) > PAIRED_SE))):
        _one_round(run, steps, rounds, timed)
        rounds.extra += 1
        added += 1
    return rounds.without_warm_up()


def _one_round(run: _Run, steps: _RoundPlans, rounds: _Rounds, timed: bool,
               signatures: list[str | None] | None = None) -> None:
    """One round of timed steps, appended to ``rounds``: one region per stage, the
    spanning regions, plain (the warm-up's filling ``signatures``: which stages are
    identical), bare, and each selective option on every stage."""
    args = (run.model, run.batch, run.loss_fn, run.optimizer, run.modules)
    rounds.rebuilt += timed_steps(*args, steps=1, plan=steps.per_stage, device=run.device,
                                  on_step=partial(rounds.count_fixed, run))
    if steps.spanning_plan is not None and timed:
        rounds.spanned += timed_steps(*args, steps=1, plan=steps.spanning_plan,
                                      device=run.device)
    if signatures is None:
        rounds.plain += timed_steps(*args, steps=1, device=run.device)
    else:
        with recording_signatures(run.modules) as found:
            rounds.plain += timed_steps(*args, steps=1, device=run.device)
        signatures[:] = found
    if not timed:
        for option in steps.options:
            rounds.with_option[option] += rounds.plain[-1:]
        return
    rounds.bare.append(bare_step_s(run.model, run.batch, run.loss_fn, run.optimizer,
                                   device=run.device))
    for option, plan in steps.options.items():
        rounds.with_option[option] += timed_steps(*args, steps=1, plan=plan,
                                                  device=run.device)


def _measured_step(run: _Run, compiled: _Compiled) -> tuple[StepMemory, StepSpans]:
    """One step measured by ``measure_step`` with a timeline, and its stages' spans."""
    # measure_step collects garbage first; freezing what exists now makes that collection
    # cheap (a full one costs about a step here) and nothing frozen is freed while it
    # measures, which is what the collection is for.
    gc.freeze()
    try:
        step = measure_step(run.model, run.batch, run.loss_fn, run.optimizer,
                            warmup_steps=0, timeline=True,
                            call_names=call_names(run.model, run.names))
    finally:
        gc.unfreeze()
    spans = split_step(step, run.names)
    eager = compiled.eager
    if eager is not None:  # their ops ran inside their graphs, out of the tracker's sight
        spans = replace(spans, stage_ops=tuple(
            eager.ops[i] if compiled.flags[i] else ops
            for i, ops in enumerate(spans.stage_ops)))
    return step, spans


@dataclass(frozen=True)
class _OptionsMeasured:
    """What the selective options' forwards and replaying steps measured (the fields of
    :class:`Measurements` of the same names)."""

    selective: dict[str, ForwardPass]
    plain_pass: ForwardPass | None
    selective_backward: dict[str, tuple[Span, ...]]
    measured_in: dict[str, frozenset[int]]


def _options_measured(run: _Run, options: tuple[str, ...], steps: _RoundPlans,
                      compiled: _Compiled, spans: StepSpans, part: _Parts
                      ) -> _OptionsMeasured:
    """For each selective option, a forward with it on the stages that run one of its ops
    and a step with it on every stage; then a plain forward and a save-nothing step."""
    names = run.names
    selective: dict[str, ForwardPass] = {}
    selective_backward: dict[str, tuple[Span, ...]] = {}
    measured_in: dict[str, frozenset[int]] = {}
    for option in (o for o in options if o in steps.options):
        part()
        # A compiled stage runs the option compiled in, whatever its ops: that program
        # saves what inductor chooses (weights in its own layout, for one), not what the
        # no-save pass kept, so it is measured even where the policy names none of its ops.
        wanted = frozenset(
            i for i, name in enumerate(names)
            if compiled.offered(option, i) and (
                compiled.flags[i] or spans.stage_ops[i] & policy_op_names(option, name))
        )
        if not wanted:
            continue
        plan = Plan(
            stages=names,
            options=tuple(option if i in wanted else KEEP for i in range(len(names))),
            solver="profile",
        )
        selective[option] = forward_pass(run.model, run.batch, run.loss_fn, names,
                                         device=run.device, plan=plan)
        measured_in[option] = wanted
        selective_backward[option] = _replayed(run.model, run.batch, run.loss_fn, names,
                                               run.optimizer, steps.options[option])
    plain_pass = None
    if selective:
        # what stays alive with nothing checkpointed, against which each option's pass
        # shows the stage outputs its cache holds (Note [Outputs a selective cache holds])
        plain_pass = forward_pass(run.model, run.batch, run.loss_fn, names, device=run.device)
    if any(Option(o).is_selective for o in options):
        # A stage that runs none of an option's ops replays like save-nothing.
        selective_backward[NOTHING] = _replayed(run.model, run.batch, run.loss_fn, names,
                                                run.optimizer, NOTHING)
    return _OptionsMeasured(selective, plain_pass, selective_backward, measured_in)


def _casts(run: _Run, compiled: _Compiled) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Per stage, what autocast's cache keeps of its parameters' casts and what of that
    autograd does not save, and the pre-chain's casts (:func:`.casts.cast_cache`).

    A compiled stage's casts happen inside its graph, out of sight: none counted there; a
    fake profile's tensors have no storage to tell casts apart by (an untimed real
    profile, a range's bytes-only shape, counts them as a timed one does).
    """
    first = next(run.model.parameters(), None)
    fake = first is not None and maybe_get_fake_mode(first) is not None
    if any(compiled.flags) or fake:
        return (), (), 0
    return cast_cache(run.model, run.batch, run.loss_fn, run.names)
