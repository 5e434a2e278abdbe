"""Each timed round's figures, kept for the paired overhead (``remat/solve/paired.py``).

A round is one step with one region per stage, one with regions over the longest runs,
one plain step and one step per selective option, run back to back; what a plan adds to
the plain step of that round is predicted from that round's figures alone, so a slow
spell that fell on the round slows both. Within a round each stage's figure is the
median over it and the stages identical to it (:mod:`.pooling`), and an option's extra is
the median over its twins (:mod:`.twins`), as the profile's medians are; the plain step
is the one timed without hooks, and the time outside the chain what it took beyond the
stages (:func:`.timing.bare_step_s`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from remat.profile_format import TimedRound
from remat.profiling.noise import option_diffs, samples
from remat.profiling.optimes import region_link_rounds, region_overhead_rounds
from remat.profiling.run import Measurements
from remat.profiling.twins import twin_groups

__all__ = ["timed_rounds"]


def _within(values: Sequence[Sequence[float]], groups: Sequence[Sequence[int]], r: int
            ) -> tuple[float, ...]:
    """Per stage: the median of round ``r``'s values over the stages in its group."""
    return tuple(float(statistics.median(values[j][r] for j in group)) for group in groups)


def timed_rounds(m: Measurements) -> tuple[TimedRound, ...]:
    """Every timed round of ``m`` in the profile's terms; a round's region cost is never
    below the checkpoint frame, its link cost between 0 and the region's cost less the
    frame (as the profile's medians, :mod:`.optimes`)."""
    n = len(m.names)
    same_as = m.same_as or tuple(range(n))
    members: dict[int, list[int]] = {}
    for i, g in enumerate(same_as):
        members.setdefault(g, []).append(i)
    groups = [members[g] for g in same_as]
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
    bare = m.bare_steps or tuple(s.step_s for s in m.plain_steps)
    found = []
    for r, plain in enumerate(m.plain_steps):
        extras = {
            o: tuple(max(floor, float(statistics.median(
                diffs[t][j][r] for j in groups[i] for t in twins[o][i]))) for i in range(n))
            for o in m.selective_options
        }
        region = max(floor, regions[r])
        link = None
        if links is not None:
            link = min(max(0.0, links[r]), max(0.0, region - floor))
        found.append(TimedRound(
            step_s=bare[r],
            fwd_s=_within(fwd, groups, r),
            bwd_s=_within(bwd, groups, r),
            rebuild_s=_within(rebuild, groups, r),
            extra_bwd_s=extras,
            region_overhead_s=region,
            region_link_s=link,
            outside_chain_s=max(0.0, bare[r] - sum(plain.fwd_s) - sum(plain.bwd_s)),
        ))
    return tuple(found)
