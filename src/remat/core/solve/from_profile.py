"""From a measured :class:`~remat.core.profile_format.Profile` to the solver's :class:`Problem`.

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
* ``backward_residue_bytes`` (the loss the caller holds through backward, its gradient)
  is the problem's own: alive from right after the post-chain's backward event to the
  pre-chain's backward. The post-chain's figures are measured from the chain's end with
  the loss alive, so charging it there too (with ``pre_chain_bytes``, as before) counted
  it twice: a float32 loss and its gradient put the predicted peak without checkpointing
  8 bytes above the measured one wherever that peak is the post-chain's.
* Note [The first input at the start]: where the first stage's input was alive when the
  step began (a Sequential model fed the batch itself, a learned query parameter), the
  simulator would count it twice, in ``inputs_bytes`` (or ``params_bytes``) and as the
  chain's first boundary ``x_0``: every event over by its size, and the peak without
  checkpointing of such a model with it (64 KiB on a 6-block MLP fed a 256 x 64 batch).
  ``pre_chain_bytes`` then goes below zero by those bytes
  (``fixed.first_input_at_start_bytes``), which is exact while ``x_0`` is held; after
  stage 0's backward lets ``x_0`` go, the pre-chain's backward event is short of it as
  much as it counts ``x_0``'s gradient, which a batch that does not require grad never
  gets, and the pre-chain's bytes are back from the optimizer step on. The caller holds
  ``x_0`` all step, so the problem's stage 0 keeps it to its backward under every option
  (``saves_input``) whether or not autograd saves it: a stack of ``nn.LSTM`` blocks fed
  the batch (the LSTM saves a transposed copy, not its input) let it go after stage 0's
  forward, every later event 64 KiB under, which the profile then read as gradients
  pending at every stage's backward and charged to rebuilds too (plans whose peak was an
  early stage's backward 1.3% over).
* Note [The last stage's input at the chain's end] (``remat.core.solve.simulator``): its
  caller's frame holds it when the chain's forward ends; ``held_outside`` says so.
* ``extra_bwd_s``: a selective option's measured cost (its unsaved ops rebuilt and its
  checkpoint frame); a profile of schema version 1 has none, and its options cost no time.
* parameter gradients: the profile says which part creates each (stages' ``grad_bytes``,
  ``pre_chain_grads``, ``post_chain_grads``) and the tracker counts their total. The
  parts count every parameter that requires grad; one that gets no gradient (unused in
  the step) makes them exceed the total, which then becomes their sum (an upper bound).
"""

from __future__ import annotations

import itertools

from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve.problem import Problem, StageCost
from remat.core.solve.simulator import simulate
from remat.core.stage_record import shared_fields

__all__ = ["no_checkpoint_plan", "predict_no_checkpoint_peak", "problem_from_profile"]


def problem_from_profile(profile: Profile, *, slots: int = 500) -> Problem:
    """The chain problem a profile describes (one StageCost per profiled stage)."""
    stages = profile.stages
    held_through, output_held = held_outside(profile)
    # Note [What the code between stages holds to the return] (remat/profiling/assemble.py):
    # let go at the return with what the pre-chain held there, not held to the backward
    to_return = ([0] * len(stages) if profile.fixed.post_chain_backward_bytes is None
                 else [s.link_at_return_bytes for s in stages])
    costs = _stage_costs(profile, held_through, output_held, to_return)
    fixed = profile.fixed
    backward, at_return = _post_chain_backward(profile, held_through, output_held, to_return)
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
        optimizer_state_bytes=fixed.optimizer_state_bytes,
        # Note [The first input at the start]
        pre_chain_bytes=fixed.pre_chain_bytes - fixed.first_input_at_start_bytes
        + sum(to_return),
        # The loss (and what autograd keeps with it), alive through the chain's backward to
        # the pre-chain's; the post-chain's figures, measured from the chain's end, have it.
        backward_residue_bytes=fixed.backward_residue_bytes,
        pre_chain_cast_bytes=min(fixed.pre_chain_cast_bytes,
                                 max(0, fixed.pre_chain_bytes - fixed.first_input_at_start_bytes)),
        args_at_return_bytes=0 if backward is None else min(fixed.args_at_return_bytes,
                                 max(0, fixed.pre_chain_bytes - fixed.first_input_at_start_bytes
                                     - fixed.pre_chain_cast_bytes)),
        pre_chain_at_return_bytes=at_return,
        post_chain_bytes=(fixed.post_chain_bytes if backward is None
                          else fixed.post_chain_forward_bytes or 0),
        post_chain_backward_bytes=backward,
        inputs_bytes=fixed.inputs_bytes,
        region_overhead_bytes=profile.region_overhead_bytes,
        region_overhead_s=profile.region_overhead_s,
        outside_chain_s=profile.outside_chain_s,
        measured_no_checkpoint_peak_bytes=profile.measured_peak_bytes,
        slots=slots,
        description=profile.model,
    )


def _stage_costs(profile: Profile, held_through: list[int | None],
                 output_held: list[tuple[int, int] | None], to_return: list[int]
                 ) -> list[StageCost]:
    """One StageCost per profiled stage (``to_return``: per stage, what the code before it
    held to the forward's return)."""
    stages = profile.stages
    links = _links(profile)
    # Note [Links inside a region] (remat/profiling/optimes.py): a region over t stages
    # costs region_overhead_s and the t - 1 links inside it (StageCost.link_s).
    link = min(profile.region_link_s or 0.0, profile.region_overhead_s)
    # Note [The first input at the start]: the caller holds x_0 to stage 0's backward
    caller_holds = [_caller_holds_first_input(profile, i) for i in range(len(stages))]
    costs = []
    for i, (s, out_held) in enumerate(zip(stages, output_held, strict=True)):
        by_option = {
            o: b
            for o, b in s.selective_bwd_transient_bytes.items()
            if o in s.saved_bytes and b != s.bwd_transient_bytes
        }
        taped = {o: b for o, b in s.selective_fwd_transient_bytes.items()
                 if o in s.saved_bytes and b != s.fwd_transient_bytes}
        costs.append(
            StageCost(
                **{
                    **shared_fields(s),
                    "boundary_bytes": links[i - 1] if i > 0 else s.boundary_bytes,
                    "output_bytes": links[i] if i < len(links) else s.output_bytes,
                    # What the code before the stage keeps goes where the stage's does:
                    # held at the top level, dropped inside a region (not at a region's
                    # first stage, where it stays outside the region: docs/cost-model.md).
                    "saved_bytes": {o: b + s.link_saved_bytes - to_return[i]
                                    for o, b in s.saved_bytes.items()},
                    "link_saved_bytes": s.link_saved_bytes - to_return[i],
                    # measured link by link where the profile did, else the average
                    "link_s": (0.0 if i + 1 == len(stages) else link if s.link_s is None
                               else s.link_s),
                    "extra_bwd_s": {o: t for o, t in s.extra_bwd_s.items() if o in s.saved_bytes},
                    **({"saves_input": True,
                        "input_kept_by_option": dict.fromkeys(s.input_kept_by_option, True)}
                       if caller_holds[i] else {}),
                },
                bwd_transient_by_option=by_option,
                fwd_transient_by_option=taped,
                held_through=held_through[i],
                output_held_through=out_held[0] if out_held else None,
                output_held_bytes=out_held[1] if out_held else 0,
            )
        )
    return costs


def _post_chain_backward(profile: Profile, held_through: list[int | None],
                         output_held: list[tuple[int, int] | None], to_return: list[int]
                         ) -> tuple[int | None, int]:
    """The post-chain's backward figure with what the simulator lets go of itself added
    back (None where the profile has none), and the problem's
    ``pre_chain_at_return_bytes``."""
    stages, fixed = profile.stages, profile.fixed
    backward = fixed.post_chain_backward_bytes
    at_return = 0 if backward is None else min(
        fixed.pre_chain_at_return_bytes,
        max(0, fixed.pre_chain_bytes - fixed.first_input_at_start_bytes
            - fixed.pre_chain_cast_bytes - fixed.args_at_return_bytes))
    if backward is not None:
        backward += let_go_at_return(profile, held_through, output_held)
        # the casts autocast's cache let go of at the forward's end, which the simulator
        # now lets go of itself (Note [Autocast's cast cache] in simulator.py)
        backward += sum(s.cast_unsaved_bytes for s in stages)
        # the stages' arguments from before the chain the model let go of at its return,
        # which the simulator lets go of itself (Note [Arguments a checkpoint frame holds])
        backward += fixed.args_at_return_bytes
        # what the code before the chain made and only the model's code held, and what the
        # code between stages held to the return (a part of the pre-chain's bytes, from
        # the forward's start: an upper bound before its link), which the simulator lets
        # go of itself (Note [What the forward lets go of at its return])
        at_return += sum(to_return)
        backward += at_return
    return backward, at_return


def _caller_holds_first_input(profile: Profile, i: int) -> bool:
    """Whether stage ``i`` is the first and its whole input was alive when the step began
    (Note [The first input at the start]): the caller holds it, whether or not autograd
    saves it."""
    stages = profile.stages
    return i == 0 and 0 < stages[0].boundary_bytes <= profile.fixed.first_input_at_start_bytes


def _links(profile: Profile) -> list[int]:
    """x_{i+1}: what stage i returns and stage i+1 receives, one size for both."""
    return [max(a.output_bytes, b.boundary_bytes) for a, b in itertools.pairwise(profile.stages)]


def held_outside(
    profile: Profile,
) -> tuple[list[int | None], list[tuple[int, int] | None]]:
    """What the model's own code holds outside the chain (docs/cost-model.md, "Held
    outside the chain"): per stage, the last stage whose forward still finds its input
    ``x_b`` referenced (None: not beyond the chain's own hold), and (through, bytes) for
    its output where that is a tensor apart from the next stage's input.

    Where the next stage's input is this stage's output itself, the two are one boundary,
    ``x_{b + 1}``: the later of their two figures counts for it. The problem holds them in
    the top-level forward (the simulator exactly, the DP as an upper bound,
    ``Problem.held_in_forward``), through the post-chain's events when still held at the
    chain's end.
    """
    stages = profile.stages
    n = len(stages)
    last: dict[int, int] = {}
    output: list[tuple[int, int] | None] = [None] * n

    def note(b: int, through: int | None) -> None:
        if through is not None and through > b:
            last[b] = max(last.get(b, through), through)

    for i, s in enumerate(stages):
        note(i, s.input_held_through)
        if i + 1 >= n or s.output_held_through is None:
            continue
        if stages[i + 1].gets_previous_output:
            note(i + 1, s.output_held_through)
        elif s.output_held_through > i:
            output[i] = (s.output_held_through, s.output_bytes)
    if n:  # Note [The last stage's input at the chain's end]: its caller's frame holds it
        last[n - 1] = max(last.get(n - 1, n - 1), n - 1)
    return [last.get(i) for i in range(n)], output


def let_go_at_return(profile: Profile, held_through: list[int | None],
                     output_held: list[tuple[int, int] | None]) -> int:
    """What the model's code still held at the chain's end and let go of by the post-chain's
    backward, in the profiled step (no plan: a boundary whose stage saved it stayed): the
    measured backward figure, taken from the chain's end, already has it gone."""
    stages = profile.stages
    last = len(stages) - 1
    boundaries = sum(
        stages[b].boundary_bytes
        for b, through in enumerate(held_through)
        if through is not None and through >= last and not stages[b].saves_input
        and not _caller_holds_first_input(profile, b)
    )
    outputs = sum(held[1] for held in output_held[:last] if held and held[0] >= last)
    return boundaries + outputs


def no_checkpoint_plan(profile: Profile) -> Plan:
    """The plan that checkpoints nothing: every stage keeps, no regions."""
    return Plan(stages=profile.stage_names, solver="none")


def predict_no_checkpoint_peak(profile: Profile) -> int:
    """The simulator's peak for one training step of the profiled model without checkpointing."""
    return simulate(no_checkpoint_plan(profile), problem_from_profile(profile)).peak_bytes
