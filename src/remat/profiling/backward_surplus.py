"""What the measured backward peaks hold beyond the simulator's figures, per stage.

The stage figures come from spans of measured steps (:mod:`remat.profiling.assemble`);
the simulator adds them up. Where the model's own code makes gradients the chain does not
account for, the sum falls short of the measured backward peaks: a skip connection's
gradient is made at the later stage that reads it (a view of that stage's input gradient,
after a concatenation) and stays until backward passes the stage that made the skip; a
tensor passed on to several stages (a position bias) gathers its gradient across them.
Such bytes depend on where backward is, not on the plan, so they are read off the steps
the profile measured, as the difference between each stage's measured backward peak and
the simulator's event for the same step:

* the step without checkpointing gives each stage's ``pending_grad_bytes``, beyond the
  gradients of tensors made before the chain that a later stage reads (a time embedding
  every block gets), which the chain-break pass counted;
* each selective step (one option on every stage) gives what that option's backward
  needs beyond it: added to the stage's ``selective_bwd_transient_bytes``.

* the step with one region per stage gives each stage's ``rebuild_grad_bytes``: what its
  backward made before the rebuild began (measured directly, not as a difference);
* one forward outside any plan gives what autocast's cache keeps of each stage's casts
  (``cast_cache_bytes``, ``cast_unsaved_bytes``: :mod:`.casts`).

A chain the simulator already counts to the byte (a transformer stack) gets zeros.
Differences below zero (the simulator over by a conservative term) are left at zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile
from remat.core.solve.simulator import simulate
from remat.profiling.measurements import NOTHING, Measurements
from remat.profiling.timeline import Span

__all__ = ["calibrated"]


def _shortfall(profile: Profile, plan: Plan, spans: Sequence[Span]) -> list[int]:
    """Per stage: measured backward peak minus the simulator's, at least 0."""
    at = dict(simulate(plan, problem_from_profile(profile)).events)
    # int(): a shortfall is no peak over the ops (remat.core.maxima), whatever its parts
    return [max(0, int(span.peak_bytes) - int(at[f"backward {s.name}"]))
            for s, span in zip(profile.stages, spans, strict=True)]


def calibrated(profile: Profile, m: Measurements) -> Profile:
    """``profile`` with the pending gradients and the selective backward shortfalls."""
    # Known first (the probe pass saw which pre-chain tensors the stages read), then
    # whatever the step still shows beyond it.
    profile = replace(profile, stages=tuple(
        replace(s, pending_grad_bytes=b)
        for s, b in zip(profile.stages, m.before_chain_grads, strict=True)
    ))
    pending = _shortfall(profile, no_checkpoint_plan(profile), m.spans.stage_backward)
    profile = replace(profile, stages=tuple(
        replace(s, pending_grad_bytes=s.pending_grad_bytes + p)
        for s, p in zip(profile.stages, pending, strict=True)
    ))
    if m.rebuild_grads:  # measured, not a difference (Note [What a rebuild starts with])
        profile = replace(profile, stages=tuple(
            replace(s, rebuild_grad_bytes=r)
            for s, r in zip(profile.stages, m.rebuild_grads, strict=True)
        ))
    if m.pre_chain_casts:
        profile = replace(profile, fixed=replace(profile.fixed,
                                                 pre_chain_cast_bytes=m.pre_chain_casts))
    if any(m.cast_cache):  # measured (remat.profiling.casts)
        profile = replace(profile, stages=tuple(
            replace(s, cast_cache_bytes=c, cast_unsaved_bytes=u)
            for s, c, u in zip(profile.stages, m.cast_cache, m.cast_unsaved, strict=True)
        ))
    names = profile.stage_names
    short = {
        option: _shortfall(profile, Plan(names, options=(option,) * len(names)), spans)
        for option, spans in m.selective_backward.items()
        # save-nothing's replay is measured for stages an option does not touch, also
        # where save-nothing itself was not asked for (no stage prices it then)
        if all(option in s.saved_bytes for s in profile.stages)
    }
    stages = []
    for i, s in enumerate(profile.stages):
        replay = dict(s.selective_bwd_transient_bytes)
        for option in replay:
            measured = option in m.measured_in and i in m.measured_in[option]
            step = option if measured else NOTHING  # the step its figure came from
            if step in short:
                replay[option] += short[step][i]
        stages.append(replace(s, selective_bwd_transient_bytes=replay))
    return replace(profile, stages=tuple(stages))
