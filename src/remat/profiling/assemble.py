"""From raw measurements to the profile's fields, in the simulator's conventions.

Each figure is read off the measured no-checkpoint step where it can be (so the pieces
add up to what that step really did), in the terms ``remat.core.solve.simulate`` counts:

* saved (keep): how much the live total grew across the stage's forward, less its new
  output; the input was alive before and the output is the next stage's input.
* forward transient: the stage forward's peak above the live total when it returned, plus
  the buffers the stage changes in place (BatchNorm's running statistics, 8 bytes for
  ``num_batches_tracked`` alone): the runtime clones them around every rebuild of the
  stage (Note [Buffers mutated in forward] in ``remat.runtime.engine``), so a rebuild
  peaks that much higher than the forward. The no-save transient gets them too (a child
  region runs its stages that way inside a rebuild).
* backward transient: the stage backward's peak above the live total when it began, less
  its input's gradient (the simulator counts it), plus its output when it saved that (the
  simulator no longer counts it there); negative where the backward lets go of what the
  stage saved, or of the gradient it was handed, before its peak; no clones: keep's
  backward makes none. The parameter gradients it has created by its peak are in it; the
  simulator adds the stage's ``grad_bytes`` after that peak.
* times (``fwd_s``, ``bwd_s``, ``rebuild_s``, ``extra_bwd_s``): medians over the timed
  rounds of the stage and of every stage identical to it (:mod:`.noise`), each with its
  interquartile range (``time_spread``).
* selective options' extra time (``extra_bwd_s``): what the stage's forward and backward
  took with the option on every stage beyond the plain step of the same round (the
  median over rounds): the option's replay in backward and its dispatch mode's cost in
  forward, which the simulator charges together at the stage's backward; never less than
  one checkpoint frame (``region_overhead`` on the tiny chain); see :mod:`.optimes`.
* link (``link_saved_bytes``): what the model's own code between stage ``i - 1``'s return
  and stage ``i``'s call keeps for backward (a norm's input, a dropout mask, the residual
  stream when the block's input is a norm of it): the live total's rise over that code,
  less stage ``i``'s input when that code made it, plus stage ``i - 1``'s output when that
  code let it go (neither saved by the stage nor referenced outside the chain; one the
  model's code still references is held outside the chain, ``output_held_through``).
* link backward (``link_backward_bytes``): the peak of the backward of the model's code
  between stage ``i - 1`` and stage ``i`` (the events between the two stages' backward)
  above the live total when it is done: what that code saved (an in-place ReLU's output,
  which is stage ``i``'s input), the gradient it was handed and the one it makes.
* selective backward (``selective_bwd_transient_bytes``): the stage's backward under a
  selective option (its replay included), measured in a step with the option on, as the
  backward transient the simulator would need while it charges keep's saved bytes there:
  the rise above the backward's start, plus the option's saved bytes, less keep's and the
  input's gradient.
* backward residue: what the step holds outside the chain when the chain's backward
  begins, beyond the chain's end in forward, the output's gradient and the post-chain's
  parameter gradients: the loss the caller holds and what autograd keeps with it (8 bytes
  for a float32 cross entropy), which no part of the chain frees.
* pre-chain: what is alive when the first stage starts, beyond the step's start and the
  first stage's input. Of it, ``args_at_return``: what the stages' calls are passed
  from before the chain besides their input (a padded batch's 4-D attention mask, position
  ids) that no stage saves and the model's code lets go of at its forward's return (read
  in the no-save pass); the residue is read with it added back (it went before the
  chain's backward began), the simulator lets it go at the return unless a checkpoint
  frame holds it (Note [Arguments a checkpoint frame holds] in the simulator).
  Of it too, ``pre_chain_at_return``: Note [What the model's forward lets go of at its
  return] below.
  Post-chain: its larger rise in forward and in backward above the
  live total at the chain's end (the backward's with the parameter gradients it has
  created by its peak; the simulator adds all of them after it).

Note [What the model's forward lets go of at its return]
--------------------------------------------------------
The pre-chain's figure is the live total's rise before stage 0 is called, beyond its
input: what the code before the chain saves for backward, and what the model's code
merely holds (a decoder's token and position embeddings, kept in its locals after their
sum became the first layer's input) until its forward returns. The second is gone through
the whole backward. The no-save pass lists the storages the step made before stage 0 was
called that are still alive then; of those, the ones no code offered to save, no stage's
call was passed (``args_at_return`` counts those), and that are gone once the model's
forward has returned make ``pre_chain_at_return`` (at most the pre-chain less its casts
and arguments). hf:opt: 524,288 bytes, every backward event of the chain over by them
before (docs/cost-model.md, "What the forward lets go of at its return").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.core.maxima import largest
from remat.core.plan_format import KEEP, Option
from remat.core.profile_format import FixedBytes, StageProfile
from remat.profiling._tensors import storage_bytes
from remat.profiling.measurements import NOTHING, Measurements
from remat.profiling.noise import option_extras, stage_times
from remat.profiling.pooling import Pooled
from remat.runtime.stage_calls import stage_submodule

__all__ = ["fixed_bytes", "gradient_owners", "stage_profiles"]


def gradient_owners(
    model: nn.Module, names: Sequence[str], post_modules: frozenset[str]
) -> tuple[int, list[int], int]:
    """Parameter-gradient bytes first created by the post-chain, each stage, the pre-chain.

    Backward meets the post-chain first, then the stages last to first, then the rest;
    a parameter used in several places (tied embeddings) gets its gradient at the first.
    """
    seen: set[int] = set()

    def take(params: Any) -> int:
        total = 0
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                total += storage_bytes(p)
        return total

    post = take(
        p for path in sorted(post_modules)
        for p in stage_submodule(model, path).parameters(False)
    )
    # a module that is several stages (its calls): its parameters' gradient is made by the
    # backward of its last call, the first backward meets
    stages = [take(stage_submodule(model, name).parameters()) for name in reversed(names)][::-1]
    pre = take(model.parameters())
    return post, stages, pre


def link_saved_bytes(m: Measurements, i: int) -> int:
    """What the model's code between stage ``i - 1`` and stage ``i`` keeps (module docstring)."""
    if i == 0:
        return 0
    before, after = m.nosave.stages[i - 1], m.nosave.stages[i]
    rise = m.spans.stage_forward[i].entry_bytes - m.spans.stage_forward[i - 1].exit_bytes
    if after.gets_previous_output:
        return max(0, rise)
    let_go = not (m.nosave.kept_outside[i - 1] or before.saves_output
                  or m.nosave.output_held_through[i - 1] is not None)
    back = before.new_output_bytes if let_go else 0
    if let_go and m.nosave.output_saved_after and m.nosave.output_saved_after[i - 1]:
        # Note [Two tensors at one boundary]: the problem holds the larger of the two
        # to the stage's backward as its input; the code keeps the other
        back = min(back, after.boundary_bytes)
    return max(0, rise - after.boundary_bytes + back)


# Note [Two tensors at one boundary]
# The problem has one tensor per boundary, x_i, the larger of what stage i - 1 returns and
# what stage i is passed (remat.core.solve.from_profile._links). Where the code between
# makes the next input apart and saves the previous output for its own backward (SigLIP
# norms its vision tower's last hidden state, 401,408 bytes, and its text tower starts
# from token embeddings, 131,072), both are alive to that code's backward, after the
# stage's: the boundary held as the stage's input counts the larger, and the code's saved
# bytes the smaller. Counting the previous output there in full had every text stage of
# hf:siglip over by the difference, 270,336 bytes.


# Note [What the code between stages holds to the return]
# The code between two stages may make tensors that only the model's own code holds, to
# its return or past it, with no backward needing them: SigLIP's vision tower's last
# hidden state, in the model's output while the text tower runs (its attention-pooling
# head saves a reshaped copy, not it). The link's rise counts it, so it was part of what
# that code keeps (``link_saved_bytes``), to the next stage's backward: every text stage's
# backward of hf:siglip was over by its 401,408 bytes. The no-save pass lists what the
# code before each stage made and still holds at the stage's call; of it, what no code
# offered to save, no stage's call got, and is gone once loss_fn has returned is
# ``link_at_return_bytes``. Where no region may span that code (``break_before``: it is
# never replayed in a rebuild) the problem lets it go with what the pre-chain held to
# the return (``Problem.pre_chain_at_return_bytes``: charged from the forward's start, an
# upper bound before the link, and gone after the post-chain's forward); elsewhere it is
# left in ``link_saved_bytes`` (a rebuild replaying that code would make it again).


def link_at_return_bytes(m: Measurements, i: int) -> int:
    """Of ``link_saved_bytes(m, i)``, what the code before stage ``i`` merely held until
    the forward returned, where no region may span that code (Note [What the code between
    stages holds to the return])."""
    if i == 0 or m.breaks[i] is None or not m.nosave.link_at_return_bytes:
        return 0
    return min(m.nosave.link_at_return_bytes[i], link_saved_bytes(m, i))


def link_backward_bytes(m: Measurements, i: int) -> int:
    """The peak of the backward of the model's code between stage ``i - 1`` and stage ``i``
    above what is live once it is done (Note [The backward of the code between stages] in
    ``remat.core.solve.simulator``)."""
    if i == 0 or not m.spans.link_backward:
        return 0
    span = m.spans.link_backward[i]
    return max(0, span.peak_bytes - span.exit_bytes)


# Note [Outputs a selective cache holds]
# torch's selective checkpoint keeps the outputs of the ops its policy saves in its own
# cache, whether or not backward needs them, until the region's backward. A stage whose
# last op is one of them (a block ending in a Linear under save-matmuls) thus holds its
# output from its forward to its backward. Where the next stage takes it as its input
# that changes nothing the simulator counts; where the model's code between makes the
# next input from it (``x = x + block(x)``), that code would let it go, and the simulator
# does so (``link_saved_bytes``). Found by comparing what is alive two stages later (or
# after the forward) in the option's pass with a saving pass without checkpointing: held
# there only, by the option; counted as part of what the option saves.


# The same holds for keep where the stage's own last op saves its output (a block ending
# in a ReLU, then ``x = x + block(x)``): the output is part of what keep saves, to the
# stage's backward, and only then; a region or an option that saves nothing frees it.


def code_lets_go_output(m: Measurements, i: int) -> bool:
    """Whether the model's code after stage ``i`` makes the next stage's input and then
    has no use for stage ``i``'s output (the chain's last stage excepted)."""
    nosave = m.nosave
    return (i + 1 < len(m.names) and nosave.stages[i].output_is_new
            and not nosave.stages[i + 1].gets_previous_output
            and not nosave.kept_outside[i] and nosave.output_held_through[i] is None)


def output_held_by_option(m: Measurements, option: str, i: int) -> bool:
    """Whether stage ``i`` under ``option`` holds the output the model's code lets go."""
    option_pass = m.selective.get(option)
    if (option_pass is None or m.plain_pass is None
            or i not in m.measured_in.get(option, ())):
        return False
    return (code_lets_go_output(m, i) and option_pass.kept_outside[i]
            and not m.plain_pass.kept_outside[i])


def _saved_bytes(m: Measurements, i: int) -> tuple[dict[str, int], dict[str, bool], bool]:
    """What stage ``i`` saves under keep and each option, whether each option's own graph
    kept its input (compiled stages), and whether keep's figure has its output in it."""
    fwd, nosave = m.spans.stage_forward[i], m.nosave.stages[i]
    kept = max(0, fwd.exit_bytes - fwd.entry_bytes - nosave.new_output_bytes)
    # Note [Outputs a selective cache holds], its last paragraph
    output_saved = nosave.saves_output and code_lets_go_output(m, i)
    if output_saved:
        kept += nosave.output_bytes
    saved: dict[str, int] = {KEEP: kept}
    input_kept: dict[str, bool] = {}
    for option, stages in m.measured_in.items():
        if i in stages:
            saved[option] = m.selective[option].stages[i].kept_bytes
            if output_held_by_option(m, option, i):
                saved[option] += nosave.output_bytes
            if m.compiled and m.compiled[i]:  # the option's own graph: see what it kept
                input_kept[option] = m.selective[option].stages[i].saves_input
    # An option whose ops the stage never runs saves what saving nothing saves; a
    # partitioned one is offered only where it was measured (a compiled stage that
    # draws no random numbers).
    for option in m.selective_options:
        if not Option(option).is_partitioned:
            saved.setdefault(option, nosave.kept_bytes)
    return saved, input_kept, output_saved


def _replay_bytes(
    m: Measurements, i: int, offered: Sequence[str], saved: dict[str, int], input_grad: int
) -> dict[str, int]:
    """Under a selective option the stage's backward replays its unsaved ops first; in
    the simulator's terms (its backward event charges keep's saved bytes), the
    transient that backward needs (the problem offers the option only where keep's
    figure covers it)."""
    replay = {}
    for option in offered:
        measured = option in m.measured_in and i in m.measured_in[option]
        spans = m.selective_backward.get(option if measured else NOTHING)
        if spans is not None:
            rise = spans[i].peak_bytes - spans[i].entry_bytes
            replay[option] = largest(0, rise + saved[option] - saved[KEEP] - input_grad)
    return replay


def _taped_forward_bytes(m: Measurements, i: int, offered: Sequence[str], clones: int
                         ) -> dict[str, int]:
    """Under a selective option the stage's checkpoint frame saves nothing as its forward
    goes (its cache keeps the policy's outputs): the forward peaks over its exit as its
    own pass measured, or as the pass that saves nothing where the stage runs none of the
    option's ops. Keep's figure, with everything saved alive, was short by up to the
    block's saved bytes (Note [A selective stage's forward] in the simulator)."""
    taped = {}
    for option in offered:
        measured = option in m.measured_in and i in m.measured_in[option]
        span = m.selective[option].stages[i] if measured else m.nosave.stages[i]
        taped[option] = span.peak_bytes - span.exit_bytes + clones
    return taped


@dataclass(frozen=True)
class _Times:
    """The stages' pooled times: which stage each is identical to, each option's extra
    backward time and the plain figures (``fwd_s``, ``bwd_s``, ``rebuild_s``)."""

    same_as: tuple[int, ...]
    extras: dict[str, list[Pooled]]
    times: dict[str, list[Pooled]]

    def of_stage(self, i: int, offered: Sequence[str]) -> dict[str, Pooled]:
        """Stage ``i``'s plain times and its offered options' extra backward times."""
        return {
            **{what: self.times[what][i] for what in self.times},
            **{f"extra_bwd_s.{o}": self.extras[o][i] for o in offered},
        }


def _stage_profile(m: Measurements, i: int, grads: Sequence[int], t: _Times) -> StageProfile:
    fwd, bwd, nosave = m.spans.stage_forward[i], m.spans.stage_backward[i], m.nosave.stages[i]
    saved, input_kept, output_saved = _saved_bytes(m, i)
    # The simulator counts the input's gradient at the stage's backward whether or not
    # one is made; the measured rise has it only where the input requires grad, so a
    # stage fed the batch itself (a Sequential's first) was over by its input there
    # (README's own example: 512 KiB at 'backward 0', its peak under a plan)
    input_grad = nosave.boundary_bytes
    clones = nosave.mutated_buffer_bytes
    saved_before = bool(m.nosave.input_saved_before) and m.nosave.input_saved_before[i]
    # A stage that saves its own output (ends in a ReLU) holds it into its backward;
    # the simulator has let go of it by then (docs/cost-model.md, assumption 2).
    held_output = nosave.output_bytes if nosave.saves_output and not output_saved else 0
    offered = [o for o in m.selective_options if o in saved]
    extra = {option: t.extras[option][i].median for option in offered}
    pooled = t.of_stage(i, offered)
    replay = _replay_bytes(m, i, offered, saved, input_grad)
    return StageProfile(
        name=m.names[i],
        boundary_bytes=nosave.boundary_bytes,
        output_bytes=nosave.output_bytes,
        saved_bytes=saved,
        fwd_s=t.times["fwd_s"][i].median,
        bwd_s=t.times["bwd_s"][i].median,
        rebuild_s=t.times["rebuild_s"][i].median,
        extra_bwd_s=extra,
        # A rebuild of the stage runs with its changed buffers cloned (module
        # docstring): counted in both forward figures, a few bytes over elsewhere.
        fwd_transient_bytes=fwd.peak_bytes - fwd.exit_bytes + clones,
        # keep's backward clones no buffer (a selective stage's replay does: its
        # own transient, measured with the option on, has them), so none here:
        # with them a BatchNorm stage's backward was over by its changed buffers,
        # and the peak without checkpointing with it (issue 47, item 4). Negative
        # where the backward frees what the stage saved before its peak
        # (Note [A backward that frees before its peak] in the simulator).
        bwd_transient_bytes=bwd.peak_bytes - bwd.entry_bytes + held_output - input_grad,
        nosave_transient_bytes=nosave.over_io_bytes + clones,
        grad_bytes=grads[i],
        output_kept_outside=m.nosave.kept_outside[i],
        # the code before the stage holds its input to the backward of that code,
        # after the stage's (Note [The backward of the code between stages])
        saves_input=nosave.saves_input or saved_before,
        saves_output=nosave.saves_output,
        break_before=m.breaks[i],
        reads=m.reads[i],
        call_args=m.nosave.call_args[i] if m.nosave.call_args else (),
        link_saved_bytes=link_saved_bytes(m, i),
        link_backward_bytes=link_backward_bytes(m, i),
        link_at_return_bytes=link_at_return_bytes(m, i),
        selective_bwd_transient_bytes=replay,
        selective_fwd_transient_bytes=_taped_forward_bytes(m, i, offered, clones),
        input_kept_by_option=(dict.fromkeys(input_kept, True) if saved_before
                              else input_kept),
        input_held_through=m.nosave.input_held_through[i],
        output_held_through=m.nosave.output_held_through[i],
        gets_previous_output=i == 0 or nosave.gets_previous_output,
        same_as=t.same_as[i] if t.same_as[i] != i else None,
        time_spread={what: (x.low, x.high) for what, x in pooled.items()
                     if x.samples > 1},
    )


def stage_profiles(m: Measurements, grads: Sequence[int]) -> list[StageProfile]:
    same_as = m.same_as or tuple(range(len(m.names)))
    extras = {
        o: option_extras(m.plain_steps, m.option_steps[o], same_as, m.overhead.time_s)
        for o in m.selective_options
    }
    times = stage_times(m.plain_steps, m.per_stage_steps, same_as)
    pooled = _Times(same_as, extras, times)
    return [_stage_profile(m, i, grads, pooled) for i in range(len(m.names))]


def fixed_bytes(
    m: Measurements, first_boundary_bytes: int, post_grads: int, pre_grads: int,
    loss_bytes: int = 0,
) -> FixedBytes:
    """``loss_bytes``: the scalar loss and its gradient, alive through every backward
    whatever the measured residue says (it comes out below them where the post-chain's
    gradients are credited before they exist, e.g. a weight tied to the embedding)."""
    spans = m.spans
    chain_end = spans.stage_forward[-1].exit_bytes
    pre_chain = spans.stage_forward[0].entry_bytes - spans.start_bytes - first_boundary_bytes
    # When the chain's backward begins, beyond the chain's end in forward: the chain
    # output's gradient in place of the output (the same size; the output stays too when
    # the last stage saved it), the post-chain's parameter gradients, and what the caller
    # still holds (the loss).
    last = m.nosave.stages[-1]
    held_output = last.output_bytes if last.saves_output else 0
    # what the stages were passed from before the chain and the model's code let go of at
    # its return (a padded batch's 4-D mask): gone by then, but not what the caller holds
    args_at_return = min(m.nosave.args_at_return_bytes, max(0, pre_chain))
    # and what the code before the chain made and only the model's code held (Note [What
    # the model's forward lets go of at its return])
    at_return = min(m.nosave.pre_chain_at_return_bytes,
                    max(0, pre_chain - args_at_return - m.pre_chain_casts))
    # and what the code between stages merely held to the return (Note [What the code
    # between stages holds to the return])
    links_at_return = sum(link_at_return_bytes(m, i) for i in range(len(m.names)))
    residue = (spans.stage_backward[-1].entry_bytes - chain_end - held_output - post_grads
               + args_at_return + at_return + links_at_return)
    return FixedBytes(
        **m.counts,
        pre_chain_bytes=max(0, pre_chain),
        # below zero: the first stage's input was alive at the step's start (the batch
        # itself, a parameter), counted there already (Note [The first input at the start]
        # in remat.core.solve.from_profile)
        first_input_at_start_bytes=min(first_boundary_bytes, max(0, -pre_chain)),
        post_chain_bytes=largest(
            0,
            spans.post_forward.peak_bytes - chain_end,
            spans.post_backward.peak_bytes - chain_end,
        ),
        pre_chain_grads_bytes=pre_grads,
        post_chain_grads_bytes=post_grads,
        optimizer_step_bytes=spans.optimizer.rise_bytes,
        backward_residue_bytes=max(loss_bytes, residue),
        post_chain_forward_bytes=largest(0, spans.post_forward.peak_bytes - chain_end),
        post_chain_backward_bytes=largest(0, spans.post_backward.peak_bytes - chain_end),
        args_at_return_bytes=args_at_return,
        pre_chain_at_return_bytes=at_return,
    )
