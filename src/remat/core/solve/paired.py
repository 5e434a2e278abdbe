"""A plan's predicted overhead as the median of per-round ratios (Note [Paired overhead]).

Note [Paired overhead]: ``remat auto`` measures a plan's overhead as the median of
per-pair ratios (each plain step against the planned step right after it), the statistic
that a slow spell of a shared machine moves least. The profile's medians predict it as a
ratio of sums of medians, taken over rounds that ran at different speeds. On the
built-in gpt (one thread, 20 rounds in one process, plan ``[0,2) [2,5)``), predictions
from four rounds at a time spread with a standard deviation of 4.5 points that way,
against 3.0 points for the median over the same rounds of each round's own prediction
(that round's stage, region and option figures against that round's plain step); from
eight rounds, 3.1 against 2.3. Neither is biased (within a point of the overhead measured
over all 20 rounds). So where the profile kept its rounds (``Profile.timed_rounds``), the
predicted overhead is the median over rounds of the plan's simulated step over the
simulated step without checkpointing, each priced with that round's figures alone.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from remat.core.plan_format import Plan
from remat.core.profile_format import Profile, TimedRound
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.simulator import baseline_time, simulate

__all__ = ["at_round", "paired_overhead", "round_overheads"]


def at_round(profile: Profile, timed: TimedRound) -> Profile:
    """``profile`` with its times replaced by one round's (``timed``)."""
    stages = tuple(
        replace(
            s,
            fwd_s=timed.fwd_s[i],
            bwd_s=timed.bwd_s[i],
            rebuild_s=timed.rebuild_s[i],
            link_s=s.link_s if timed.link_s is None else timed.link_s[i],
            extra_bwd_s={o: timed.extra_bwd_s[o][i] if o in timed.extra_bwd_s else t
                         for o, t in s.extra_bwd_s.items()},
        )
        for i, s in enumerate(profile.stages)
    )
    return replace(
        profile,
        stages=stages,
        region_overhead_s=timed.region_overhead_s,
        region_link_s=timed.region_link_s,
        outside_chain_s=timed.outside_chain_s,
        step_s=timed.step_s,
    )


def round_overheads(plan: Plan, profile: Profile) -> list[float]:
    """Per timed round: the plan's simulated step over the one without checkpointing, less
    1, both priced with that round's figures (empty when the profile kept no rounds)."""
    found = []
    for timed in profile.timed_rounds or ():
        problem = problem_from_profile(at_round(profile, timed))
        base = baseline_time(problem).total_s
        if base > 0:
            found.append(simulate(plan, problem).step_time_s / base - 1)
    return found


def paired_overhead(plan: Plan, profile: Profile) -> float | None:
    """The median of :func:`round_overheads`; None when the profile kept no rounds."""
    ratios = round_overheads(plan, profile)
    return float(statistics.median(ratios)) if ratios else None
