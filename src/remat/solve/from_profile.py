"""From a measured :class:`~remat.profile_format.Profile` to the solver's :class:`Problem`.

Torch-free: it reads the profile's plain fields. The profile already measures in the
simulator's conventions (``docs/cost-model.md``: saved bytes exclude a stage's input and
output, transients are beyond what the simulator counts at that event), so most fields
map one to one. The rest:

* ``params_bytes`` holds parameters and buffers: both stay on the device all step.
* where code between two stages changes the hidden state's size, the simulator still
  tracks one tensor between them; it gets the larger of the two sizes.
* a selective option's measured backward (its replay included,
  ``selective_bwd_transient_bytes``) becomes the option's own backward transient
  (``bwd_transient_by_option``) where it differs from keep's: a block ending in a ReLU
  makes its output again in the replay, which keep's backward never holds
  (docs/cost-model.md, assumption 7).
* ``backward_residue_bytes`` (the loss the caller holds through backward) is charged with
  ``pre_chain_bytes``: alive to the pre-chain's backward, as it is (a few bytes over in
  forward, where it does not exist yet).
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
    links = _links(profile)
    held, after_chain = held_outside(profile)
    costs = []
    for i, s in enumerate(stages):
        by_option = {
            o: b
            for o, b in s.selective_bwd_transient_bytes.items()
            if o in s.saved_bytes and b != s.bwd_transient_bytes
        }
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
                fwd_transient_bytes=s.fwd_transient_bytes + held[i],
                bwd_transient_bytes=s.bwd_transient_bytes,
                bwd_transient_by_option=by_option,
                nosave_transient_bytes=s.nosave_transient_bytes + held[i],
                grad_bytes=s.grad_bytes,
                saves_input=s.saves_input,
                break_before=s.break_before,
                reads=s.reads,
                pending_grad_bytes=s.pending_grad_bytes,
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
        # The loss (and what autograd keeps with it), alive through the chain's backward to the
        # pre-chain's, ride with what the pre-chain keeps: a few bytes over in forward.
        pre_chain_bytes=fixed.pre_chain_bytes + fixed.backward_residue_bytes,
        post_chain_bytes=fixed.post_chain_bytes + after_chain,
        input_bytes=fixed.inputs_bytes,
        region_overhead_bytes=profile.region_overhead_bytes,
        region_overhead_s=profile.region_overhead_s,
        outside_chain_s=profile.outside_chain_s,
        measured_no_checkpoint_peak_bytes=profile.measured_peak_bytes,
        slots=slots,
        description=profile.model,
    )


def _links(profile: Profile) -> list[int]:
    """x_{i+1}: what stage i returns and stage i+1 receives, one size for both."""
    return [max(a.output_bytes, b.boundary_bytes) for a, b in itertools.pairwise(profile.stages)]


def held_outside(profile: Profile) -> tuple[list[int], int]:
    """Bytes the model's own code holds outside the chain during each stage's forward, and
    during the post-chain's (docs/cost-model.md, "Held outside the chain").

    Boundary ``x_b`` referenced through stage ``k``'s forward is charged to the forward
    figures of stages ``b + 1 .. k`` (through the post-chain when the model returns it),
    unless every plan holds it there anyway: stage ``b`` keeps its input under every
    option and no region can start before ``b`` and contain it (``b`` is 0 or a break).
    An upper bound: the charge also lands where a plan holds ``x_b`` already, and on the
    stage's runs inside rebuilds, where the model's frames are gone.
    """
    stages = profile.stages
    n = len(stages)
    links = _links(profile)
    sizes = [stages[0].boundary_bytes, *links]
    # boundary -> the last stage whose forward it outlives (as stage b's input, or as
    # stage b - 1's output: one tensor, charged once)
    last: dict[int, int] = {}
    for b, through in [(i, s.input_held_through) for i, s in enumerate(stages)] + [
        (i + 1, s.output_held_through) for i, s in enumerate(stages) if i + 1 < n
    ]:
        if through is not None and through > b:
            last[b] = max(last.get(b, through), through)
    held = [0] * n
    after_chain = 0
    for b, through in sorted(last.items()):
        always = stages[b].saves_input and (b == 0 or stages[b].break_before is not None)
        if always:
            continue
        for p in range(b + 1, min(through, n - 1) + 1):
            held[p] += sizes[b]
        if through >= n:
            after_chain += sizes[b]
    return held, after_chain


def no_checkpoint_plan(profile: Profile) -> Plan:
    """The plan that checkpoints nothing: every stage keeps, no regions."""
    return Plan(stages=profile.stage_names, solver="none")


def predict_no_checkpoint_peak(profile: Profile) -> int:
    """The simulator's peak for one training step of the profiled model without checkpointing."""
    return simulate(no_checkpoint_plan(profile), problem_from_profile(profile)).peak_bytes
