"""Each timed round's figures, kept for the paired overhead (``remat/core/solve/paired.py``).

A round is one step with one region per stage, one with regions over the longest runs,
one plain step and one step per selective option, run back to back; what a plan adds to
the plain step of that round is predicted from that round's figures alone, so a slow
spell that fell on the round slows both. Within a round each stage's figure is the
median over it and the stages identical to it (:mod:`.pooling`), and an option's extra is
the median over its twins (:mod:`.option_twins`), as the profile's medians are; the plain step
is the one timed without hooks, and the time outside the chain what it took beyond the
stages (:func:`.timing.bare_step_s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.core.profile_format import TimedRound
from remat.profiling.measurements import Measurements
from remat.profiling.noise import option_diffs, samples
from remat.profiling.optimes import (
    link_rounds,
    link_s,
    link_within,
    region_link_rounds,
    region_overhead_rounds,
)
from remat.profiling.option_twins import twin_groups
from remat.profiling.pooling import pool

__all__ = ["measured_link_rounds", "timed_rounds"]


def measured_link_rounds(m: Measurements) -> list[dict[int, float]]:
    """Per round, each link inside the spanning regions priced (Note [Each link its own
    cost] in :mod:`.optimes`); empty where no region spans two stages."""
    if not m.spanning:
        return []
    floor = m.overhead.time_s
    regions = region_overhead_rounds(m.plain_steps, m.per_stage_steps)
    return link_rounds(m.plain_steps, m.per_stage_steps, m.spanning_steps, m.spanning,
                       [max(floor, r) - floor for r in regions])


def _within(values: Sequence[Sequence[float]], same_as: Sequence[int]) -> tuple[float, ...]:
    """Per stage: the median of ``values[i]`` (one round's samples of stage ``i``) over the
    stages identical to it."""
    return tuple(p.median for p in pool(values, same_as))


def timed_rounds(m: Measurements) -> tuple[TimedRound, ...]:
    """Every timed round of ``m`` in the profile's terms; a round's region cost is never
    below the checkpoint frame, its link cost between 0 and the region's cost less the
    frame (as the profile's medians, :mod:`.optimes`)."""
    n = len(m.names)
    same_as = m.same_as or tuple(range(n))
    floor = m.overhead.time_s
    fwd, bwd = samples(m.plain_steps, "fwd_s"), samples(m.plain_steps, "bwd_s")
    rebuild = samples(m.per_stage_steps, "rebuild_s")
    diffs = {o: option_diffs(m.plain_steps, m.option_steps[o]) for o in m.selective_options}
    # option -> per stage, the options whose rounds it pools (its twins where it leads)
    twins: dict[str, list[list[str]]] = {o: [] for o in m.selective_options}
    for i, name in enumerate(m.names):
        lead: dict[str, list[str]] = {}
        for group in twin_groups(m.spans.stage_ops[i], name, m.selective_options):
            lead.update({t: group for t in group})
        for o in m.selective_options:
            twins[o].append(lead.get(o, [o]))
    regions = region_overhead_rounds(m.plain_steps, m.per_stage_steps)
    links = (region_link_rounds(m.plain_steps, m.per_stage_steps, m.spanning_steps,
                                m.spanning)
             if m.spanning else None)
    bare, outside = m.plain_step_s, m.outside_rounds
    per_link = measured_link_rounds(m)
    found = []
    for r in range(len(m.plain_steps)):
        extras = {
            o: tuple(max(floor, x) for x in _within(
                [[diffs[t][i][r] for t in twins[o][i]] for i in range(n)], same_as))
            for o in m.selective_options
        }
        region = max(floor, regions[r])
        link = None if links is None else link_within(links[r], region - floor)
        found.append(TimedRound(
            step_s=bare[r],
            fwd_s=_within([[s[r]] for s in fwd], same_as),
            bwd_s=_within([[s[r]] for s in bwd], same_as),
            rebuild_s=_within([[s[r]] for s in rebuild], same_as),
            extra_bwd_s=extras,
            region_overhead_s=region,
            region_link_s=link,
            outside_chain_s=max(0.0, outside[r]),
            link_s=link_s(per_link[r:r + 1], n) if all(per_link) else None,
        ))
    return tuple(found)
