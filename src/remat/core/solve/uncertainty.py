"""Whether a plan's choice holds within the profile's timing noise (torch-free).

A profile records, next to each stage's times, the interquartile range of the samples
they are medians of (``time_spread``), and the range of the region's fixed cost
(``timing_noise.region_overhead_range_s``). A plan is chosen on the medians; where two
plans are closer in predicted time than the noise, a profile of the same model a minute
later chooses the other. So the chosen plan is checked against profiles whose times are
drawn from their ranges: two corners (everything a rebuild costs at the top of its range
and the plain forward and backward at the bottom, and the reverse) and random draws
(each group of identical stages draws once: they are one computation). For each, the
chosen plan's predicted overhead is computed, and the optimal solver is run again at
the same budget. A plan that another beats by more than :data:`TIE` (a share of the
step without checkpointing) under some draw is reported as uncertain, with the range of
its predicted overhead; plans closer than that are ties (on gpt, regions [2, 5) and
save-nothing on three blocks came 0.7 points apart on the medians).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from remat.core.errors import CheckFailed
from remat.core.plan_format import Option, Plan, Region, parse_option
from remat.core.profile_format import Profile, StageProfile
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import baseline_time, simulate
from remat.core.solve.solvers import optimal

__all__ = ["NOISY", "PlanUncertainty", "noise_lines", "plan_uncertainty", "steadiest",
           "steadiest_and_uncertainty", "with_times"]

#: A spread (interquartile range over median) above which timings are called noisy.
NOISY = 0.2
#: Random draws besides the two corners.
DRAWS = 8
#: Another plan faster by at most this share of the plain step is a tie, not a change.
TIE = 0.01

#: Further apart than this on the medians (a share of the plain step), plans are never
#: tied, whatever the draws say.
WIDE_TIE = 0.03

NOTHING = Option.selective("save-nothing")

# what a checkpoint adds to a step, against what a plain step costs
_RECOMPUTE = ("rebuild_s", "extra_bwd_s.")
_PLAIN = ("fwd_s", "bwd_s")

Draw = Callable[[str, float, float, float], float]  # (what, low, median, high) -> seconds


@dataclass(frozen=True)
class PlanUncertainty:
    """The chosen plan against the timing noise (module docstring).

    ``overhead``: its predicted overhead on the profile's medians; ``overhead_low`` and
    ``overhead_high``: the least and most over every draw; in ``changed`` of ``trials``
    re-solves another plan beat it by more than :data:`TIE`, by up to ``regret`` (a share
    of the plain step; ``trials`` is 0 when the plan's solver is not ``optimal``: only the
    overhead range is checked then); ``spread``: the profile's largest timing spread.
    """

    overhead: float
    overhead_low: float
    overhead_high: float
    trials: int
    changed: int
    spread: float
    regret: float = 0.0

    @property
    def uncertain(self) -> bool:
        return self.changed > 0

    def sentence(self) -> str:
        span = (f"predicted overhead between {self.overhead_low:+.1%} and "
                f"{self.overhead_high:+.1%} (on the medians {self.overhead:+.1%})")
        if self.uncertain:
            return (f"plan uncertain: with the times drawn from their measured ranges "
                    f"(spread up to {self.spread:.0%}), another plan is faster by up to "
                    f"{self.regret * 100:.1f} points in {self.changed} of {self.trials} "
                    f"re-solves; {span}")
        if self.trials and self.changed == 0:
            return f"plan stable within the timing noise ({self.trials} re-solves); {span}"
        return f"within the timing noise, {span}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "uncertain": self.uncertain,
            "overhead": self.overhead,
            "overhead_low": self.overhead_low,
            "overhead_high": self.overhead_high,
            "trials": self.trials,
            "changed": self.changed,
            "spread": self.spread,
            "regret": self.regret,
        }


def with_times(profile: Profile, draw: Draw) -> Profile:
    """``profile`` with every time that has a measured range replaced by ``draw(what, low,
    median, high)``; identical stages (``same_as``) take their group's first stage's
    draw, the region's fixed cost is drawn as ``region_overhead_s``. A stage's twin
    options (remat.profiling.option_twins: one computation under two names, given the same
    median and range) take one draw: drawn apart, one of them won a draw that the other,
    identical on every figure, lost, and the steadiest-plan rule then named save-attention
    x3 over save-nothing x3 on mlp-hetero in 2 of 5 runs (noise_stability, 14:50 UTC)."""
    drawn: dict[tuple[object, ...], float] = {}

    def value(group: int, what: str, mid: float, spread: dict[str, tuple[float, float]]
              ) -> float:
        if what not in spread:
            return mid
        low, high = spread[what]
        # twins: the same figures, bit for bit (pooled from the same samples)
        key: tuple[object, ...] = ((group, "extra_bwd_s", mid, low, high)
                                   if what.startswith("extra_bwd_s.") else (group, what))
        if key not in drawn:
            drawn[key] = max(0.0, draw(what, low, mid, high))
        return drawn[key]

    stages = []
    for i, s in enumerate(profile.stages):
        group = i if s.same_as is None else s.same_as
        spread = dict(s.time_spread)
        stages.append(replace(
            s,
            fwd_s=value(group, "fwd_s", s.fwd_s, spread),
            bwd_s=value(group, "bwd_s", s.bwd_s, spread),
            rebuild_s=value(group, "rebuild_s", s.rebuild_s, spread),
            extra_bwd_s={o: value(group, f"extra_bwd_s.{o}", t, spread)
                         for o, t in s.extra_bwd_s.items()},
        ))
    overhead = profile.region_overhead_s
    noise = profile.timing_noise
    if noise is not None and noise.region_overhead_range_s[1] > 0:
        low, high = noise.region_overhead_range_s
        overhead = max(0.0, draw("region_overhead_s", low, overhead, high))
    return replace(profile, stages=tuple(stages), region_overhead_s=overhead)


def _corner(recompute_high: bool) -> Draw:
    def draw(what: str, low: float, _mid: float, high: float) -> float:
        recompute = what == "region_overhead_s" or what.startswith(_RECOMPUTE)
        return high if recompute == recompute_high else low

    return draw


def _random(rng: random.Random) -> Draw:
    def draw(_what: str, low: float, _mid: float, high: float) -> float:
        return rng.uniform(low, high)

    return draw


def _has_ranges(profile: Profile) -> bool:
    return any(s.time_spread for s in profile.stages)


def _overhead(plan: Plan, profile: Profile, slots: int) -> float:
    problem = problem_from_profile(profile, slots=slots)
    base = baseline_time(problem).total_s
    return simulate(plan, problem).step_time_s / base - 1 if base > 0 else 0.0


def _same(a: Plan, b: Plan) -> bool:
    return a.regions == b.regions and a.options == b.options


def _simplest(plan: Plan, problem: Problem) -> tuple[Any, ...]:
    """The order among tied plans: fewer regions, fewer stages off keep, then options
    earlier in each stage's list (a stage's twin options: remat.profiling.option_twins), then
    by name."""
    first = tuple(problem.options(i).index(o) for i, o in enumerate(plan.options))
    return (len(plan.regions), sum(not o.is_keep for o in plan.parsed_options), first,
            plan.options, tuple((r.start, r.stop) for r in plan.regions))


def _swaps(options: tuple[str, ...], problem: Problem) -> list[tuple[str, ...]]:
    """The options with one stage's changed, or every stage of one option moved to
    another: the near neighbours a re-solve may not reach (three blocks under
    save-matmuls against the same three under save-attention)."""
    out = []
    for i, o in enumerate(options):
        for other in problem.options(i):
            if other != o:
                out.append((*options[:i], other, *options[i + 1:]))
    for o in set(options):
        for other in {x for i in range(problem.n) for x in problem.options(i)} - {o}:
            if all(other in problem.options(i) for i, x in enumerate(options) if x == o):
                out.append(tuple(other if x == o else x for x in options))
    return out


def _single_stage_regions(plan: Plan) -> set[int]:
    """The stages ``plan`` rebuilds by a region over that stage alone: kept inside, no
    other region over it."""
    return {r.start for r in plan.regions
            if r.stop == r.start + 1 and plan.parsed_options[r.start].is_keep
            and sum(q.start <= r.start < q.stop for q in plan.regions) == 1}


def _region_or_option(plan: Plan, problem: Problem) -> list[Plan]:
    """The plan with one stage rebuilt the other way: a region over that stage alone (the
    stage kept inside) against a selective option on it outside any region. Both run the
    stage's forward again in its backward and differ only in their fixed costs, which the
    noise hides (mlp-hetero at 75%: regions [0,1) [3,4) [4,5) against save-nothing on
    those three blocks, chosen 3 and 2 times in five runs)."""
    inside = {i for r in plan.regions for i in range(r.start, r.stop)}
    alone = _single_stage_regions(plan)
    out = []
    for i in range(problem.n):
        selective = [o for o in problem.options(i) if parse_option(o).is_selective]
        if i in alone:
            regions = tuple(r for r in plan.regions if (r.start, r.stop) != (i, i + 1))
            for o in selective:
                out.append(replace(plan, regions=regions,
                                   options=(*plan.options[:i], o, *plan.options[i + 1:])))
        elif i not in inside and plan.options[i] in selective:
            keep = next((o for o in problem.options(i) if parse_option(o).is_keep), None)
            if keep is None:
                continue
            regions = tuple(sorted((*plan.regions, Region(i, i + 1)),
                                   key=lambda r: (r.start, -r.stop)))
            out.append(replace(plan, regions=regions,
                               options=(*plan.options[:i], keep, *plan.options[i + 1:])))
    return out


def _alone(plan: Plan, problem: Problem) -> set[int]:
    """:func:`_single_stage_regions` of ``plan`` where save-nothing is offered."""
    return {i for i in _single_stage_regions(plan) if NOTHING in problem.options(i)}


def _computation_tie(a: Plan, b: Plan, problem: Problem) -> float:
    """How far apart (a share of the plain step) plans ``a`` and ``b`` tie as one
    computation (:func:`_one_computation`): :data:`TIE` per stage rebuilt by a region in
    one and by save-nothing in the other, at most :data:`WIDE_TIE`; 0 when they are not
    one computation. Per stage, because each such stage is priced by two instruments, each
    with its own error (on mlp-hetero about half a point a stage); no more, because
    save-nothing is not free where a region is: it runs the stage's forward under the
    selective-checkpoint dispatch mode, 2 points a stage on the README's six-block
    residual MLP, where a wider tie chose a plan the noise check then called beaten."""
    if _one_computation(a, problem) != _one_computation(b, problem):
        return 0.0
    return min(WIDE_TIE, TIE * len(_alone(a, problem) ^ _alone(b, problem)))


def _regions_as_options(plan: Plan, problem: Problem) -> Plan:
    """``plan`` with every region over one stage alone (the stage kept inside, no other
    region over it) traded for save-nothing on that stage, which rebuilds the same ops in
    the same backward: one computation, named two ways."""
    alone = _alone(plan, problem)
    if not alone:
        return plan
    return replace(plan,
                   regions=tuple(r for r in plan.regions
                                 if not (r.stop == r.start + 1 and r.start in alone)),
                   options=tuple(NOTHING if i in alone else o
                                 for i, o in enumerate(plan.options)))


def _one_computation(plan: Plan, problem: Problem) -> tuple[object, ...]:
    """What ``plan`` computes, whatever it is named: :func:`_regions_as_options`, then
    every option as the first of its twins on the stage (the same figures:
    remat.profiling.option_twins)."""
    traded = _regions_as_options(plan, problem)
    options = []
    for i, option in enumerate(traded.options):
        stage = problem.stages[i]
        figures = {o: (stage.saved_bytes.get(o), stage.extra_bwd_s.get(o),
                       stage.bwd_transient(o), stage.keeps_input(o))
                   for o in problem.options(i)}
        options.append(next((o for o in problem.options(i)
                             if figures[o] == figures.get(Option(option))), option))
    return tuple((r.start, r.stop) for r in traded.regions), tuple(options)


def _drawn(profile: Profile, draws: int, seed: int) -> list[Profile]:
    """``profile`` under the two corners and ``draws`` seeded random draws."""
    rng = random.Random(seed)
    trials = [_corner(True), _corner(False), *(_random(rng) for _ in range(draws))]
    return [with_times(profile, draw) for draw in trials]


def _resolvable(profile: Profile, plan: Plan) -> bool:
    return plan.solver == "optimal" and plan.budget_bytes is not None and _has_ranges(profile)


Resolved = list[tuple[Profile, "Plan | None"]]  # each drawn profile, the optimal plan on it


def _resolved(profile: Profile, budget: int, slots: int, draws: int, seed: int) -> Resolved:
    out: Resolved = []
    for drawn in _drawn(profile, draws, seed):
        try:
            out.append((drawn, optimal(problem_from_profile(drawn, slots=slots), budget)))
        except CheckFailed:  # times do not move memory; kept for safety
            out.append((drawn, None))
    return out


def steadiest_and_uncertainty(profile: Profile, plan: Plan, *, slots: int = 500
                              ) -> tuple[Plan, PlanUncertainty | None]:
    """:func:`steadiest`, then :func:`plan_uncertainty` of its choice, on one set of
    re-solves (the choice keeps the budget, so the re-solves are the same)."""
    resolved = None
    if _resolvable(profile, plan):
        assert plan.budget_bytes is not None
        resolved = _resolved(profile, plan.budget_bytes, slots, DRAWS, 0)
    chosen = steadiest(profile, plan, slots=slots, resolved=resolved)
    return chosen, plan_uncertainty(profile, chosen, slots=slots, resolved=resolved)


def steadiest(profile: Profile, plan: Plan, *, slots: int = 500, draws: int = DRAWS,
              seed: int = 0, resolved: Resolved | None = None) -> Plan:
    """Among the plans the optimal solver picks on ``profile``'s medians and on the draws
    of :func:`plan_uncertainty`, the simplest (fewest regions, then fewest stages off keep,
    then earlier options, then by name) of those within :data:`TIE` of the fastest on the
    medians.

    Each of those plans' near neighbours (one stage's option changed, or all of one
    option's stages moved to another, or a region over one stage traded for a selective
    option on it and back, or every such region traded for save-nothing at once) competes
    too, where it fits the budget; a plan further than :data:`TIE` from the fastest still
    ties, up to :data:`WIDE_TIE`, where it is no slower than it under one of the draws or
    is the same computation within :func:`_computation_tie` (single-stage regions against
    save-nothing, priced by two instruments whose gap moved between -1.1 and +1.3 points
    over 20 profiles of mlp-hetero, two stages traded, which the draws rarely reversed).
    Plans that
    close are one plan as far as the timings can tell; which of them the
    medians favour changes from one profile to the next (three blocks of mlp-hetero under
    save-nothing, save-attention or save-matmuls, 0.3 points apart), so the choice among
    them is made by a fixed rule instead, and five runs choose alike. ``plan`` itself
    when it was not chosen by the optimal solver or the profile has no measured ranges.
    """
    if not _resolvable(profile, plan):
        return plan
    assert plan.budget_bytes is not None
    if resolved is None:
        resolved = _resolved(profile, plan.budget_bytes, slots, draws, seed)
    found = {(plan.regions, plan.options): plan}
    for _, other in resolved:
        if other is not None:
            found.setdefault((other.regions, other.options), other)
    problem = problem_from_profile(profile, slots=slots)
    for p in list(found.values()):
        for other in (*_region_or_option(p, problem), _regions_as_options(p, problem)):
            found.setdefault((other.regions, other.options), other)
    for p in list(found.values()):
        for options in _swaps(p.options, problem):
            found.setdefault((p.regions, options), replace(p, options=options))
    if len(found) == 1:
        return plan
    base = baseline_time(problem).total_s
    timed = [(simulate(p, problem), p) for p in found.values()]
    timed = [(sim, p) for sim, p in timed if sim.peak_bytes <= plan.budget_bytes]
    fastest_sim, fastest = min(timed, key=lambda sp: sp[0].step_time_s)
    drawn: list[tuple[Problem, float]] = []  # each drawn problem, fastest's time on it

    def tied(other: Plan, step_s: float) -> bool:
        """Within TIE of the fastest on the medians, or, within WIDE_TIE, the same
        computation as it (within _computation_tie) or at least as fast as it under one
        of the draws (made once, when a plan first needs them)."""
        slower_s = step_s - fastest_sim.step_time_s
        if slower_s <= TIE * base:
            return True
        if slower_s > WIDE_TIE * base:
            return False
        if slower_s <= _computation_tie(other, fastest, problem) * base:
            return True
        if not drawn:
            for d, _ in resolved:
                q = problem_from_profile(d, slots=slots)
                drawn.append((q, simulate(fastest, q).step_time_s))
        return any(simulate(other, q).step_time_s <= t for q, t in drawn)

    near = [(sim, p) for sim, p in timed if base <= 0 or tied(p, sim.step_time_s)]
    sim, choice = min(near, key=lambda sp: _simplest(sp[1], problem))
    if choice is plan:
        return plan
    return replace(plan, regions=choice.regions, options=choice.options,
                   predicted_peak_bytes=sim.peak_bytes,
                   predicted_step_time_s=sim.step_time_s)


def plan_uncertainty(profile: Profile, plan: Plan, *, slots: int = 500, draws: int = DRAWS,
                     seed: int = 0, resolved: Resolved | None = None
                     ) -> PlanUncertainty | None:
    """The chosen ``plan`` of ``profile`` checked against its timing noise (module
    docstring); None for a profile without measured ranges (written before remat recorded
    them). Re-solves only a plan the ``optimal`` solver chose, at its budget (or takes
    ``resolved``, the re-solves :func:`steadiest` made at the same budget)."""
    if not _has_ranges(profile):
        return None
    resolve = _resolvable(profile, plan)
    if resolved is None:
        resolved = (_resolved(profile, plan.budget_bytes, slots, draws, seed)
                    if resolve and plan.budget_bytes is not None
                    else [(drawn, None) for drawn in _drawn(profile, draws, seed)])
    overheads, changed, regret = [], 0, 0.0
    problem = problem_from_profile(profile, slots=slots)
    for drawn, other in resolved:
        ours = _overhead(plan, drawn, slots)
        overheads.append(ours)
        if other is None or _same(other, plan):
            continue
        lost = ours - _overhead(other, drawn, slots)
        # the steadiest-plan rule's own tie: the same computation, named the other way
        if lost > max(TIE, _computation_tie(plan, other, problem)):
            changed += 1
            regret = max(regret, lost)
    nominal = _overhead(plan, profile, slots)
    noise = profile.timing_noise
    spread = noise.largest if noise else max(_relative(s) for s in profile.stages)
    return PlanUncertainty(
        overhead=nominal,
        overhead_low=min(nominal, *overheads),
        overhead_high=max(nominal, *overheads),
        trials=len(resolved) if resolve else 0,
        changed=changed,
        spread=spread,
        regret=regret,
    )


def _relative(stage: StageProfile) -> float:
    mids = {"fwd_s": stage.fwd_s, "bwd_s": stage.bwd_s, "rebuild_s": stage.rebuild_s}
    found = [(high - low) / mids[what] for what, (low, high) in stage.time_spread.items()
             if what in mids and mids[what] > 0]
    return max(found, default=0.0)


def noise_lines(profile: Profile, *, one_thread: bool = False) -> list[str]:
    """What ``remat profile`` (and ``plan``, ``auto``) print about the profile's timing
    noise: one line of figures, and a warning when it is above :data:`NOISY` (which
    suggests one torch thread unless ``one_thread``: torch ran on one already)."""
    noise = profile.timing_noise
    if noise is None:
        return []
    groups: dict[int, int] = {}
    for i, s in enumerate(profile.stages):
        groups[i if s.same_as is None else s.same_as] = groups.get(
            i if s.same_as is None else s.same_as, 0) + 1
    pooled = sum(n for n in groups.values() if n > 1)
    added = (f" ({noise.extra_rounds} added: the first ones were noisy)"
             if noise.extra_rounds else "")
    identical = (
        f"; {pooled} identical stages in {sum(n > 1 for n in groups.values())} group(s), "
        f"timed up to {noise.identical_spread:.0%} apart before pooling (each gets its "
        "group's median)"
        if pooled else "; no identical stages to pool"
    )
    low, high = noise.region_overhead_range_s
    lines = [
        f"timing noise: {noise.rounds} rounds{added}; the plain step spread "
        f"{noise.step_spread:.0%} over them, stage times {noise.stage_spread:.0%} (median "
        f"interquartile range over median){identical}; one region "
        f"{low * 1e3:.2f}..{high * 1e3:.2f} ms over the rounds"
    ]
    if noise.largest > NOISY:
        lines.append(
            f"warning: the timings are noisy (spread up to {noise.largest:.0%}, above "
            f"{NOISY:.0%}): plans chosen from them may differ from run to run; "
            + ("a quieter machine steadies them (torch ran on one thread already)" if one_thread
               else "a quieter machine or one torch thread (--threads 1, or "
               "OMP_NUM_THREADS=1) steadies them")
        )
    return lines
