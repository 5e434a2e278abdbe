"""From a measured :class:`~remat.profile_format.Profile` to the solver's :class:`Problem`.

Torch-free: it reads the profile's plain fields. The profile already measures in the
simulator's conventions (``docs/cost-model.md``: saved bytes exclude a stage's input and
output, transients are beyond what the simulator counts at that event), so most fields
map one to one. The rest:

* ``params_bytes`` holds parameters and buffers: both stay on the device all step.
* where code between two stages changes the hidden state's size, the simulator still
  tracks one tensor between them; it gets the larger of the two sizes.
* ``extra_bwd_s``: a selective option's measured cost (its unsaved ops rebuilt and its
  checkpoint frame); a profile of schema version 1 has none, and its options cost no time.
* parameter gradients: the profile says which part creates each (stages' ``grad_bytes``,
  ``pre_chain_grads``, ``post_chain_grads``) and the tracker counts their total. The
  parts count every parameter that requires grad; one that gets no gradient (unused in
  the step) makes them exceed the total, which then becomes their sum (an upper bound).
"""

from __future__ import annotations

import itertools

from remat.plan import Plan
from remat.profile_format import Profile
from remat.solve.problem import Problem, StageCost
from remat.solve.simulate import simulate

__all__ = ["no_checkpoint_plan", "predict_no_checkpoint_peak", "problem_from_profile"]


def problem_from_profile(profile: Profile, *, slots: int = 500) -> Problem:
    """The chain problem a profile describes (one StageCost per profiled stage)."""
    stages = profile.stages
    # x_{i+1}: what stage i returns and stage i+1 receives, one size for both.
    links = [max(a.output_bytes, b.boundary_bytes) for a, b in itertools.pairwise(stages)]
    costs = []
    for i, s in enumerate(stages):
        costs.append(
            StageCost(
                name=s.name,
                boundary_bytes=links[i - 1] if i > 0 else s.boundary_bytes,
                output_bytes=links[i] if i < len(links) else s.output_bytes,
                # What the code before the stage keeps goes where the stage's does: held
                # at the top level, dropped inside a region (not at a region's first stage,
                # where it stays outside the region: docs/cost-model.md).
                saved_bytes={o: b + s.link_saved_bytes for o, b in s.saved_bytes.items()},
                fwd_s=s.fwd_s,
                bwd_s=s.bwd_s,
                rebuild_s=s.rebuild_s,
                extra_bwd_s={o: t for o, t in s.extra_bwd_s.items() if o in s.saved_bytes},
                fwd_transient_bytes=s.fwd_transient_bytes,
                bwd_transient_bytes=s.bwd_transient_bytes,
                nosave_transient_bytes=s.nosave_transient_bytes,
                grad_bytes=s.grad_bytes,
                saves_input=s.saves_input,
                break_before=s.break_before,
            )
        )
    fixed = profile.fixed
    parts = (
        sum(s.grad_bytes for s in stages)
        + fixed.pre_chain_grads_bytes
        + fixed.post_chain_grads_bytes
    )
    return Problem(
        stages=tuple(costs),
        params_bytes=fixed.params_bytes + fixed.buffers_bytes,
        grads_bytes=max(fixed.grads_bytes, parts),
        pre_chain_grads_bytes=fixed.pre_chain_grads_bytes,
        post_chain_grads_bytes=fixed.post_chain_grads_bytes,
        optimizer_step_bytes=fixed.optimizer_step_bytes,
        optimizer_bytes=fixed.optimizer_state_bytes,
        pre_chain_bytes=fixed.pre_chain_bytes,
        post_chain_bytes=fixed.post_chain_bytes,
        input_bytes=fixed.inputs_bytes,
        region_overhead_bytes=profile.region_overhead_bytes,
        region_overhead_s=profile.region_overhead_s,
        outside_chain_s=profile.outside_chain_s,
        measured_no_checkpoint_peak_bytes=profile.measured_peak_bytes,
        slots=slots,
        description=profile.model,
    )


def no_checkpoint_plan(profile: Profile) -> Plan:
    """The plan that checkpoints nothing: every stage keeps, no regions."""
    return Plan(stages=profile.stage_names, solver="none")


def predict_no_checkpoint_peak(profile: Profile) -> int:
    """The simulator's peak for one training step of the profiled model without checkpointing."""
    return simulate(no_checkpoint_plan(profile), problem_from_profile(profile)).peak_bytes
