"""Selective options that are one computation on a stage, offered once.

An option saves the ops its policy names; on a stage that runs none of ``save-attention``'s
ops (an MLP block), ``save-attention`` saves what ``save-nothing`` saves, and the two
replay the same ops in backward: one computation under two names. The profile still times
each option in its own steps, so their figures differ by noise alone, and the planner,
choosing between them on that noise, named a different mix from run to run on a noisy
machine (benchmarks/noise_stability.md, mlp-hetero). So, per stage, options whose saved
ops in that stage are the same set are twins: they get one set of figures, the first
twin's (the one whose policy names the fewest ops, then by name: ``save-nothing`` where it
is a twin), timed on the samples of all of them pooled (as identical stages are,
:mod:`.pooling`), and the first twin comes first in the stage's options, so that solvers,
which take the first of equal choices, and the steadiest-plan rule name it.

Twins stay offered (a plan naming ``save-attention`` on every stage still runs and is
priced), with figures that cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import replace

from remat.core.plan_format import KEEP, Option
from remat.core.profile_format import Profile, StageProfile
from remat.profiling.measurements import Measurements
from remat.profiling.noise import option_diffs, pooled_extras
from remat.profiling.optimes import policy_op_names

__all__ = ["merge_twin_options", "twin_groups"]


def twin_groups(stage_ops: frozenset[str], stage: str, options: tuple[str, ...]
                ) -> list[list[str]]:
    """The selective ``options`` grouped by the ops each saves in ``stage`` (which runs
    ``stage_ops``), each group led by the option it is offered under."""
    by_saved: dict[object, list[str]] = {}
    for option in options:
        # a partitioned option saves what inductor's partitioner chooses: no twin of any
        key = option if Option(option).is_partitioned else (
            stage_ops & policy_op_names(option, stage))
        by_saved.setdefault(key, []).append(option)
    return [sorted(group, key=lambda o: (len(policy_op_names(o, stage)), o))
            for group in by_saved.values()]


def merge_twin_options(profile: Profile, m: Measurements) -> Profile:
    """``profile`` with each stage's twin options given one set of figures, the first twin
    listed first (module docstring)."""
    options = m.selective_options
    if len(options) < 2:
        return profile
    group_of = m.same_as or tuple(range(len(m.names)))
    diffs = {o: option_diffs(m.plain_steps, m.option_steps[o]) for o in options}
    floor = m.overhead.time_s
    groups = [twin_groups(m.spans.stage_ops[i], name, options) for i, name in enumerate(m.names)]
    # the pooled times of each option as offered (its twins' samples with its own), per
    # stage, pooled over identical stages too (they have the same twins)
    pooled = {}
    for option in options:
        merged = [
            [x for g in stage_groups if g[0] == option for twin in g for x in diffs[twin][i]]
            or diffs[option][i]
            for i, stage_groups in enumerate(groups)
        ]
        pooled[option] = pooled_extras(merged, group_of, floor)
    stages: list[StageProfile] = []
    for i, s in enumerate(profile.stages):
        if all(len(g) == 1 for g in groups[i]):
            stages.append(s)
            continue
        lead = {twin: g[0] for g in groups[i] for twin in g}  # option -> its first twin
        order = [o for g in groups[i] for o in g]
        times = {o: pooled[lead[o]][i] for o in order}
        replay, taped = s.selective_bwd_transient_bytes, s.selective_fwd_transient_bytes
        stages.append(replace(
            s,
            saved_bytes={KEEP: s.saved_bytes[KEEP],
                         **{o: s.saved_bytes[lead[o]] for o in order}},
            extra_bwd_s={o: times[o].median for o in order},
            selective_bwd_transient_bytes={
                o: replay[lead[o]] for o in order if lead[o] in replay},
            selective_fwd_transient_bytes={
                o: taped[lead[o]] for o in order if lead[o] in taped},
            time_spread={
                **{k: v for k, v in s.time_spread.items()
                   if not k.startswith("extra_bwd_s.")},
                **{f"extra_bwd_s.{o}": (times[o].low, times[o].high)
                   for o in order if times[o].samples > 1},
            },
        ))
    return replace(profile, stages=tuple(stages))
