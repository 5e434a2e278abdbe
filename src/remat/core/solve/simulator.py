"""The cost model: one training step of a plan, event by event (torch-free).

This is the one place where memory and time are added up. Solvers, reports and
benchmarks ask :func:`simulate`; the optimal solver's dynamic program
(:mod:`remat.core.solve.dp`) restates the same arithmetic as a recursion, and the tests prove
the two agree on every plan of small chains. ``docs/cost-model.md`` explains each choice.

What is alive (``a_i`` = ``boundary_bytes`` of stage i, ``a_n`` the chain's output):

* always: parameters, optimizer state, the input batch, the pre-chain's saved bytes
  (until its backward).
* the backward residue (the loss the caller holds, its gradient) from right after the
  post-chain's backward event to the pre-chain's backward.
* parameter gradients, as backward creates them, until the optimizer step: the
  unattributed ones from the post-chain's backward on (an upper bound); the post-chain's
  and each stage's ``grad_bytes`` right after that part's backward event (the gradients
  it creates before its peak are in its measured transient); the pre-chain's at its
  backward.
* boundaries ``x_i``, each counted once however many things hold it: the current
  activation; a region whose input it is; a stage that ran with grad under ``keep`` (if
  it ``saves_input``) or ``selective`` (it keeps its input). Offloaded stages keep
  nothing on the device.
* each stage that ran with grad: its ``saved_bytes[option]`` until its backward.
* during backward: the incoming gradient of ``x_{i+1}`` and the outgoing one of ``x_i``
  (gradients have the size of what they differentiate).
* per event, the transient peak of that step of work (see
  :class:`~remat.core.solve.problem.StageCost`); the optimizer step's temporaries at its event.

Note [Nested non-reentrant regions]
-----------------------------------
Mirrors the runtime (remat.runtime.engine, Note [Which regions open when]):

* forward: outside regions a stage runs with grad under its option. A top-level region
  keeps only its input; everything inside it (child regions too) runs without saving.
* backward walks the top level last to first. A bare stage's backward frees what it
  saved. A region R is rebuilt from its input when backward reaches it: R's own items
  run again with grad, bare stages saving under their option, child regions keeping
  only their inputs and running their insides without saving; then backward recurses
  into R's items last to first, rebuilding each child the same way.
* early stop (torch's default): a rebuild ends as soon as R holds everything its
  backward will ask it for. Stages that keep (keep, selective) and child regions hand R
  something (a selective stage and a child region hand over their input when they open,
  before running); offloaded stages hand R nothing. So R's rebuild runs its items up to
  the last one that hands it something; that item runs only if it is a keep stage; a
  selective stage that did not run is rebuilt in full at its backward instead.
* what the model's code between stages keeps for backward (``StageCost.link_saved_bytes``,
  inside the next stage's saved bytes) is dropped inside a region, except before a
  region's first stage: that code runs before the region, so the region holds it from
  its forward to its backward (once however many regions start there). A boundary that
  code saves (``HeldRead.saved``: ``x * sigmoid(block(x))`` keeps the block's input) is
  held the same way, by the stage after that code when it runs taped and by a region
  opening there, counted once with its other holders. That code's backward comes after
  the stage's (or the region's) and is an event of its own (Note [The backward of the
  code between stages]).
* a tensor a top-level region's stages made that stages after the region read (a
  position bias passed on) outlives the region's forward: held from there to the
  backward of its first reader (``StageCost.reads`` of the readers).
* a region's fixed cost: ``region_overhead_s`` once per step plus the ``link_s`` of
  each link inside it (:meth:`Problem.region_s`), and ``region_overhead_bytes`` from its
  rebuild to the end of its backward.
* gradients pending where backward is (``StageCost.pending_grad_bytes``: ones the
  model's code made for tensors it passed on, waiting for backward to reach their
  maker), from the rebuilds before a stage's backward through that backward.
* what a region's last stage's backward made before it asked for the rebuild
  (``StageCost.rebuild_grad_bytes``), through that rebuild only (Note [What a rebuild
  starts with]).
* boundaries the model's own code holds in the forward (``StageCost.held_through``: a
  skip list, a caller's frame), during the top-level forward only (those still held at
  the chain's end through the post-chain's events, whose figures are measured from the
  chain's end with them alive), counted once with their other holders; and likewise a
  stage's output the model's code still references where it is a tensor apart from the
  next stage's input (``StageCost.output_held_through``: the caller's ``h`` while the
  block it called concatenates or upsamples it).
* tensors a region reads from before it (``StageCost.reads``: a skip connection the code
  between its stages concatenates, a position bias a stage is passed) are held by the
  region from its forward (or its opening in the parent's rebuild) to the end of its
  backward: its rebuild needs them. A boundary counts once with its other holders; any
  other tensor once however many regions hold it.

Note [What a rebuild starts with]
A region's rebuild starts when the backward of its last stage first unpacks a saved
tensor; the backward's nodes that ran before that unpack may have made tensors that are
alive through the whole rebuild. In float32 they are none (the first node's input is the
gradient of the stage's output, which the simulator counts). Under autocast the block's
last op is often a mixed-dtype add (``x + mlp(ln(x))``, a float32 residual plus a
bfloat16 branch), whose backward casts the incoming gradient to the branch's dtype before
the branch's first node asks for its saved tensors: on gpt (n_embd 128, batch 8 x 128)
256 KiB, alive through every rebuild and missed by the prediction (the peak of the minimum
plan was measured 256 KiB over the budget). The profile measures it per stage
(``rebuild_grad_bytes``) and the simulator holds it from the rebuild's start to its end;
after it the stage's own backward runs, whose measured transient has it. A child region
ending at the same stage is rebuilt after its parent's rebuild, with the same tensor
alive: held again there, once. The dynamic program adds it to the gradients alive during
a forward of a level ending at that stage (``Model.grads_during``).

Note [A selective stage's forward]
A selective stage run with grad saves nothing as its forward goes: its checkpoint frame
packs every saved tensor into a handle and its cache keeps only the policy's outputs. So
each op's output goes once the next op has used it, as in a forward that saves nothing,
and the forward's peak over its exit is not keep's transient (measured with everything
saved alive). The profile measures it per option (``fwd_transient_by_option``); the
taped forward event charges the option's saved bytes and it. With keep's figure a
save-nothing block of the built-in gpt (3 blocks of 32, batch 4 x 64) was predicted
507,904 bytes under its forward's measured peak in float32 (509,952 under autocast
bf16); every forward event of a save-nothing / save-matmuls / keep plan of it is now
exact to the byte, in both.

Note [A selective stage rebuilt in full]
A region's rebuild stops at its last item that hands it something; a selective stage
hands over its input when it opens, so the rebuild stops before running it, and the
stage replays its whole forward inside its own backward with nothing cached, as it would
under save-nothing. So its backward event takes save-nothing's measured figure where the
profile has one (``StageCost.full_rebuild_option``), not its own option's, and so do the
tables (``Model.bwd`` with ``runs`` false). Under autocast bf16 the backward of a
save-matmuls block of the built-in gpt (3 blocks of 32) peaks 98,304 bytes above its
save-nothing backward, and a one-block region over such a block measured exactly the
save-nothing plan's peak: predicted with the option's figure it was 5.2% over.

Note [Autocast's cast cache]
Under ``torch.autocast`` the first use of a parameter (a leaf that requires grad) in a
lower-precision op casts it, and autocast keeps the cast in a cache until the outermost
autocast region exits: the end of ``loss_fn`` (the forward), or the end of a rebuild,
whose checkpoint frame enters autocast again outside any region of the caller's (in
backward none is open). So the casts a stage makes stay alive after it returns, whether
autograd saves them or not:

* a stage that runs without saving (in a region's forward, or a child region's in a
  rebuild) leaves all of its casts (``cast_cache_bytes``: a bfloat16 copy of its
  weights and biases) alive to the end of that forward or rebuild. On gpt (4 blocks of
  128) 386 KiB per block; a plan of regions over three tiny blocks was measured 2.7% over
  its budget in its forward before the cache was counted;
* a stage under keep saves the weights' casts (its saved bytes, to its backward) and
  leaves the rest (``cast_unsaved_bytes``: a Linear's bias, which its backward does not
  need) in the cache: the simulator counts those with the stage's saved bytes until the
  forward's (or the rebuild's) end, then drops them. A selective stage's cache saves op
  outputs, not the weights' casts: all of its casts go then (its measured saved bytes
  had them; gpt at 75% with two save-nothing stages was predicted 1.7% over before);
* the profile's backward post-chain figure, measured from the chain's end of the step
  without checkpointing, saw every stage's ``cast_unsaved_bytes`` go at the autocast's exit
  before the post-chain's backward; the problem adds them back (``problem_from_profile``)
  since the simulator now lets go of them itself. Without it, gpt at 75% was predicted
  4.5 KiB under what it measured (the biases of its two region stages).

The pre-chain's casts that autograd does not save (an input projection's weight, the batch
needing no gradient) go at the forward's end too (``Problem.pre_chain_cast_bytes``, a
part of ``pre_chain_bytes``): on mlp-hetero the prediction of every backward event was
8 KiB over without it (1.1%).

A stage's backward event charges keep's saved bytes and its measured transient less
the casts that went at the forward's end (:func:`_gone`): the stage held its saved bytes
without them since, and its transient, measured from its backward's entry, saw them
gone. Charged in full, every plan of the gpt above whose blocks are all selective and
not in regions was predicted 25,152 bytes (one block's casts) over what it measured
under autocast bf16. The tables do not count the cache
(it depends on where the forward ends, not on the item being decided), so problems with
casts are solved as with reads from before a region: the simulator checks each table
plan and the tables are filled again under any overshoot (Note [Reads from before a
region] in ``remat.core.solve.solvers``), and the minimum named is the simulated peak of
the tables' least plan.

Note [Arguments a checkpoint frame holds]
-----------------------------------------
What the model's code passes every stage from before the chain besides its input (a
padded batch's 4-D attention mask, position ids) is alive from the pre-chain on; where no
stage saves it under keep, the model lets go of it when its forward returns
(``Problem.args_at_return_bytes``, a part of ``pre_chain_bytes``). A checkpoint frame keeps
its call's arguments for its rebuild, to its backward: a selective stage's (from its
taped forward, or its opening in a rebuild, to the end of its backward) and a region's
(from its opening to the end of its backward; its rebuild passes them to its stages).
So the simulator holds them once however many hold them: the model from the start to the
return (just before the post-chain's backward event, whose measured figure is taken from
the chain's end with them alive and is raised by them in ``problem_from_profile``), each
such frame as said. hf:llama (4 layers, batch 4 x 64) with a padded mask: selective on
layer 0 kept the 16 KiB bool mask and the 512-byte position ids to layer 0's backward,
and the peak at the post-chain's backward was measured 16,896 bytes over the prediction
before they were counted (frames on later layers only hid it: their peaks were
elsewhere). Stages may get different ones (gemma2: one mask for its sliding-window layers,
another for the rest): each stage's ``call_args`` name those its call got, a region holds
those of its stages and a selective frame its own stage's, each tensor once (keyed by its
index) however many hold it. hf:gemma2 with only layer 0's counted: a region over layers
0 and 1 was 256 KiB under at the top of the backward, and a region per layer 256 KiB
over, the second mask charged to the pre-chain. A profile without ``call_args`` (older
ones) makes every frame hold all of them (an upper bound where one holds fewer).

Note [The last stage's input at the chain's end]
------------------------------------------------
A stage's input is its call's argument: when the last stage returns, its caller's frame
still references it, and lets go of it only after (``h = block(h)``), or later still
(``x + block(x)`` in the model's own code, a list of hidden states). The post-chain's two
figures are measured from that moment, the last stage's return, with it alive. Where the
stage does not save its input under keep (``x + f(x + bias)``, an LSTM's batch-first
transpose: autograd saves a copy), the simulator had let go of it there, so every plan
was one boundary under from the chain's end through the top of the backward: the small
model of ``tests/test_call_args_peaks.py`` 32,768 bytes (+6.9%) there even without
checkpointing. So the problem marks the last stage's input as held by the model's code
at the chain's end (its ``held_through`` at least its own index; a profile's always is):
the simulator holds it after the chain's forward, once with its other holders (the stage
that saved it, a region or selective frame that starts at it), through the post-chain's
forward; the model's forward has returned by the post-chain's backward, so it goes then,
and the backward figure gets it back where the profiled step let go of it (its stage did
not save it: ``let_go_at_return``). The tables charge it with the post-chain's forward
figure (``Problem.last_input_held_bytes``; over where the plan holds it already).

Note [The backward of the code between stages]
----------------------------------------------
The model's own code between stage ``i - 1`` and stage ``i`` runs its backward after stage
``i``'s and before stage ``i - 1``'s: an in-place ``ReLU`` between two convolutions (VGG's
``features``, where the activations cannot be stages: docs/stages.md rule 8) then holds
what it saved (its result, which is stage ``i``'s input ``x_i``: the ReLU wrote into the
convolution's output and saves that), the gradient it was handed and the one it makes,
three tensors of ``x_i``'s size, after stage ``i`` has let go of what it saved. No stage's
backward sees that, and the simulator had no event there: the ``vgg`` built-in was
measured 4.2% over its prediction at the minimum it named (128 KiB at the first ReLU's
backward), 39 KiB over a budget of 3,200,000 bytes, and a small flat conv/ReLU/pool
``Sequential`` 1.6% to 2.9% over without checkpointing and at 75% and 60% (over its 75%
budget). So the profile
measures that backward per link (``StageCost.link_backward_bytes``: the peak of the
events between the two stages' backward above the live total when they are done, when
stage ``i - 1``'s backward begins) and the simulator adds an event for it right after
stage ``i``'s backward, on what is live then (a region starting at ``i`` is closed by
then: the code before it ran outside it), with the gradients pending at stage ``i - 1``
in place of stage ``i``'s. The figure does not depend on the plan: inside a region the
rebuild replays that code with grad (Note [Glue between stages] in
``remat/runtime/glue.py``), which saves the same tensors again. The tables do not count
it; the solvers simulate their plans and tighten under any overshoot (Note [Reads from
before a region] in solvers.py).

The tensor that code saves stays alive from its forward to that event. Where it is stage
``i``'s own input and stage ``i`` does not save its input (a ``Dropout`` after the ReLU
saves only its mask), the simulator would let it go after stage ``i``'s forward; the
profile marks the stage as holding its input (``saves_input``: wherever stage ``i`` runs
with grad, the code before it did too and saved ``x_i``), so it is held to stage ``i``'s
backward, and the event counts it after that. The tables know that flag, so the least
plan they find counts it too: as a boundary the code saves (``HeldRead.saved``, which
they do not count) the named minimum of the small model with a ``Dropout`` came out at a
plan peaking 6.8% above the least one. Before, the step without checkpointing put it
into stage ``i``'s ``pending_grad_bytes`` (the ``vgg`` built-in's two classifier
dropouts, 4 KiB each), held at that stage's backward whatever the plan.

Note [A backward that frees before its peak]
--------------------------------------------
A stage's backward event charges what the stage saved, the gradient it was handed
(``x_{i+1}``'s) and the one it makes (``x_i``'s), plus ``bwd_transient_bytes``. Autograd
lets go of each node's saved tensors and incoming gradient as soon as that node is done,
so where the stage's largest tensor is made last the first two are partly gone by then:
wav2vec2's feature encoder (a convolution of stride 2, then a GELU, which saves the
convolution's output) peaks at the convolution's backward, making the input's gradient
(twice the output's size) after the GELU's backward has freed its saved input and the
gradient it was handed, one of them replaced by the gradient it made. The measured rise
above the backward's start less the input's gradient is then negative (the weight's
gradient less the output's size), and the profile keeps it so; the simulator and the
tables add it like any other transient. Clamped at 0, every plan peaking at such a stage's
backward was over by the difference: hf:wav2vec2, hubert, wavlm, unispeech and
unispeech-sat 5.4% (859,136 bytes) at the minimum they named, which is now predicted to
the byte. The least the figure may be is minus keep's saved bytes and both gradients
(the event would hold less than nothing); the measured rise is never below zero, so a
profile stays above minus the input's gradient. A selective option's own figure
(``bwd_transient_by_option``) is still clamped at 0: an upper bound there.

Note [What the forward lets go of at its return]
------------------------------------------------
The pre-chain's bytes (``pre_chain_bytes``: alive when the first stage starts, beyond its
input) are not all kept for backward. A decoder's code makes the token embeddings and the
position embeddings, adds them into the first stage's input and keeps both in its locals
until its forward returns; the embeddings' backward needs neither (it saves the indices).
Charged to the pre-chain's backward, they put every later event of hf:opt over by their
524,288 bytes (1.5-2.2% at 75% and at the minimum it names; gpt2 655,360, whisper
750,080). The profile measures them (``pre_chain_at_return_bytes``: what the code before
the chain made and still held when the first stage was called, that no code offered to
save and no stage's call was passed, and that is gone once the model's forward has
returned; Note [What the model's forward lets go of at its return] in
``remat.profiling.assemble``), and the simulator lets them go after the post-chain's
forward event, where the cast cache goes: the post-chain's backward figure, measured from
the chain's end, gets them back (``problem_from_profile``), and the tables lower their
backward base by them (``Problem.backward_base_bytes``), with the forward's events that
much above it (``dp.Model.gs``, ``Problem.post_chain_peak_bytes``).

Note [FSDP2 units]
------------------
A per-rank problem under FSDP2 (:func:`remat.core.transforms.per_rank_problem`) gives each
stage that is a unit its gathered bytes ``u`` (``StageCost.unit_bytes``) and its
gradients' reduce-scatter input ``r`` (``StageCost.reduce_bytes``), and the root unit
(everything else) ``Problem.root_unit_bytes``; the sharded parameters are in
``params_bytes``, the root's unsharded ones in ``pre_chain_bytes``. The simulator keeps
them as FSDP2 (torch 2.13, ``reshard_after_forward=True``, implicit prefetch) does,
measured on 2 gloo ranks (``benchmarks/distributed_steadiness.md``):

* forward: a unit's pre-forward all-gathers into a flat buffer (``u``) and copies out the
  unsharded parameters (``u``); the flat buffer stays until the next unit's all-gather
  (the root's, gathered first, until the first stage's; the last stage's through the
  post-chain's forward); the unsharded parameters go after the unit's forward. So a
  stage's forward runs with ``2u`` more, and its all-gather's event adds the previous
  flat buffer too. Regions do not change the forward.
* backward: a unit's pre-backward (when backward reaches its output, before a region
  ending there rebuilds) unshards it and prefetches the unit before it (its flat buffer,
  ``u``); the root's prefetches the last stage at the post-chain's backward. A forward
  that runs during backward (a rebuild) unshards its unit if needed and does not reshard
  it: a unit stays gathered from its rebuild (or pre-backward) to its post-backward.
* a unit's post-backward, right after its backward: it reshards, frees the previous
  unit's reduce-scatter input, and reduce-scatters its gradients through an input of
  ``r`` bytes kept to the next unit's post-backward (the last, stage 0's, to the root's,
  at the end of backward).
* ``collective_copies`` (gloo): an all-gather's output and a reduce-scatter's input are
  copied for the collective, the copy alive while it runs.

Note [Resharding after a rebuild]
---------------------------------
Kept gathered from its rebuild to its own backward, a region's unit costs its ``u``
bytes through the backward of every later stage of the region; gathered again, it costs
one more all-gather (``StageCost.gather_s``). ``Plan.reshard_after_rebuild`` asks the
runtime for the second (``FSDPModule.reshard()`` right after the unit's call in the
rebuild) and the simulator models it so: in a rebuild of region ``[a, b)`` every unit it
calls other than ``b - 1`` (gathered by its pre-backward, whose backward comes next) is
resharded after its call, including the stage a rebuild's early stop ends in (a child
region or selective stage it only opens: FSDP's pre-forward hook gathered the unit before
the stage's frame opened), and each reshard adds ``gather_s`` to the rebuild time (the
unit's pre-backward gathers it again). The optimal solver solves with both and keeps the
faster plan that fits (Note [Keep or reshard after a rebuild] in solvers.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, Option, Plan, Region
from remat.core.solve.problem import Problem, StageCost
from remat.core.stage_record import HeldRead

ARGS = ("args", "before the chain")  # Note [Arguments a checkpoint frame holds]

__all__ = ["Event", "Item", "Simulation", "StepTime", "baseline_time", "plan_tree", "simulate"]


class Event(NamedTuple):
    """One step of the timeline and the bytes alive at its peak."""

    label: str
    live_bytes: int


@dataclass(frozen=True)
class StepTime:
    """The predicted step time, by kind of work (all in seconds)."""

    forward_s: float
    backward_s: float
    rebuild_s: float
    option_s: float  # selective stages' partial rebuilds and offload transfers
    overhead_s: float  # the fixed cost of each region
    outside_chain_s: float

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.rebuild_s + self.option_s
                + self.overhead_s + self.outside_chain_s)


@dataclass(frozen=True)
class Simulation:
    """The memory timeline, peak and step time of one training step under a plan."""

    labels: tuple[str, ...]  # each event's label, in order
    live: tuple[int, ...]  # the bytes alive at each event's peak
    peak_bytes: int
    peak_event: str
    time: StepTime
    forward_runs: tuple[int, ...]  # how many times each stage's forward ran in full
    # what the step holds from its forward to its backward beyond parameters, optimizer
    # state and the input: the saved tensors and boundaries its plan keeps, the chain's
    # output (a pipeline rank holds this much more per micro-batch in flight)
    kept_bytes: int = 0

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """The timeline as (label, live bytes) pairs (built on first use: long chains
        have tens of thousands of events and most callers need only the peak)."""
        return tuple(map(Event._make, zip(self.labels, self.live, strict=True)))

    @property
    def step_time_s(self) -> float:
        return self.time.total_s


class Item(NamedTuple):
    """One entry of a level of the region tree: a bare stage, or a region and its items."""

    start: int
    stop: int
    region: Region | None = None
    items: tuple[Item, ...] = ()


def plan_tree(plan: Plan) -> tuple[Item, ...]:
    """The top level of ``plan`` as items in stage order (regions carry their inside)."""
    regions = list(plan.regions)  # sorted by (start, -stop): parents before children
    pos = 0

    def level(start: int, stop: int) -> tuple[Item, ...]:
        nonlocal pos
        items: list[Item] = []
        i = start
        while i < stop:
            if pos < len(regions) and regions[pos].start == i and regions[pos].stop <= stop:
                r = regions[pos]
                pos += 1
                items.append(Item(r.start, r.stop, r, level(r.start, r.stop)))
                i = r.stop
            else:
                items.append(Item(i, i + 1))
                i += 1
        return tuple(items)

    return level(0, len(plan.stages))




def _call_args(problem: Problem) -> tuple[list[tuple[tuple[Hashable, int], ...]],
                                          list[tuple[Hashable, int]]]:
    """Per stage, the (key, bytes) of the arguments from before the chain a checkpoint
    frame over it holds; and all of them, which the model holds to its return (Note
    [Arguments a checkpoint frame holds])."""
    total, stages = problem.args_at_return_bytes, problem.stages
    if not total:
        return [()] * problem.n, []
    distinct = {a.tensor: a.nbytes for s in stages for a in s.call_args}
    if not distinct or sum(distinct.values()) > total:
        # measured as one figure (or clipped below the parts): every frame holds it all
        return [((ARGS, total),)] * problem.n, [(ARGS, total)]
    per_stage = [tuple({(ARGS, a.tensor): a.nbytes for a in s.call_args}.items())
                 for s in stages]
    everything: list[tuple[Hashable, int]] = [((ARGS, t), b) for t, b in distinct.items()]
    if total > sum(distinct.values()):  # what no stage's record names: the model's alone
        everything.append((ARGS, total - sum(distinct.values())))
    return per_stage, everything


def _gone(stage: StageCost, option: str) -> int:
    """Of what ``stage`` saves under ``option``, the casts autocast's cache holds and
    autograd does not: gone when the forward (or rebuild) ends (Note [Autocast's cast
    cache]). Under keep those are ``cast_unsaved_bytes``; under a selective option all of
    its casts (its selective cache saves op outputs, not the weights' casts)."""
    parsed = Option(option)
    cast = (stage.cast_unsaved_bytes if parsed.is_keep
            else stage.cast_cache_bytes if parsed.is_selective else 0)
    return min(cast, stage.saved_bytes[option]) if cast else 0

class _Walker:
    """Walks one step, keeping the live bytes (boundaries deduplicated by holder).

    Each stage's numbers under its option are read once up front: a step visits every
    stage a few times, and chains of thousands of stages make those visits the cost.
    """

    def __init__(self, problem: Problem, options: Sequence[str],
                 reshard_after_rebuild: bool = False) -> None:
        self.p = problem
        self.options = options
        stages = problem.stages
        off = [Option(o).is_offload for o in options]
        self._init_live_set(problem)
        self._init_casts(stages)
        self._init_reads(stages)
        self._init_args(problem, options)
        self._init_timeline(stages)
        self._init_option_figures(stages, options, off)
        self._init_fsdp(problem, reshard_after_rebuild)
        self._init_transfers(problem, off)

    def _init_live_set(self, problem: Problem) -> None:
        """The boundaries' holders, the named blocks alive and the pending gradients."""
        n = problem.n
        self.a = [s.boundary_bytes for s in problem.stages] + [problem.output_bytes]
        # Who holds each boundary: how many (the current activation, its stage, regions
        # starting there), and whether the current activation and the stage are among them.
        # Counts and flags rather than a set per boundary: at ten thousand stages, that
        # many sets cost a full garbage collection.
        self.holders = [0] * (n + 1)
        self.current = [False] * (n + 1)
        self.by_stage = [False] * (n + 1)
        self.blocks: dict[Hashable, int] = {}
        # boundaries the model's code holds at the chain's end: through the post-chain's
        # events (their figures are measured from the chain's end with these alive)
        self.held_to_post: list[tuple[bool, int]] = []
        self.pending = 0  # gradients pending where backward is (StageCost.pending_grad_bytes)

    def _init_casts(self, stages: Sequence[StageCost]) -> None:
        # Note [Autocast's cast cache]: what each stage's casts leave in the cache, and the
        # keys of the casts held now, to the forward's end or to the current rebuild's
        self.cast = [s.cast_cache_bytes for s in stages]
        self.any_casts = any(self.cast)
        self.casts_held: list[Hashable] = []

    def _init_reads(self, stages: Sequence[StageCost]) -> None:
        """Tensors read from before a region, made inside one for later stages, or saved
        by the code before a stage."""
        # tensors held by whoever needs them, counted once: a read tensor (by its id: regions
        # reading it from before them, readers of one a region made), a link (("link", start):
        # the regions starting there) -> how many hold it
        self.shared: dict[Hashable, int] = {}
        # what each open region reads from before it (read once, at its opening)
        self.any_reads = any(s.reads for s in stages)
        self.open_reads: dict[Region, list[HeldRead]] = {}
        # stage -> tensors made inside a region before it that it reads, held to its backward
        self.escapes: dict[int, list[tuple[int, int]]] = {}
        # made_after -> (tensor, bytes, its readers in order): tensors a region may make
        # for stages after it (Walker.hold_escapes)
        self.made: dict[int, list[tuple[int, int, list[int]]]] = {}
        if self.any_reads:
            readers: dict[int, tuple[int, int, list[int]]] = {}
            for j, st in enumerate(stages):
                for r in st.reads:
                    if not r.boundary:
                        readers.setdefault(r.tensor, (r.made_after, r.nbytes, []))[2].append(j)
            for tensor, (made_after, nbytes, js) in readers.items():
                self.made.setdefault(made_after, []).append((tensor, nbytes, sorted(set(js))))
        # per stage: boundaries the code before it saves (HeldRead.saved), held wherever
        # that code runs with grad (before a taped stage, or before a region opening
        # there) to the stage's backward; whether the stage holds them now
        self.link_keeps = [tuple(r.made_after for r in s.reads if r.saved) for s in stages]
        self.link_kept = [False] * len(stages)

    def _init_args(self, problem: Problem, options: Sequence[str]) -> None:
        # Note [Arguments a checkpoint frame holds]: per stage, the (key, bytes) of the
        # arguments from before the chain a frame over it holds; those the model holds to
        # its return; per stage whether its selective frame holds its own now
        self.args = problem.args_at_return_bytes
        self.stage_args, self.model_args = _call_args(problem)
        self.args_held = [False] * problem.n
        self.frames = [bool(self.stage_args[i]) and Option(o).is_selective
                       for i, o in enumerate(options)]
        self.open_args: dict[Region, list[tuple[Hashable, int]]] = {}

    def _init_timeline(self, stages: Sequence[StageCost]) -> None:
        """What each stage holds for backward, the events so far and the times summed."""
        n = len(stages)
        self.saved: list[int | None] = [None] * n  # what each stage holds for its backward
        self.grad: list[int | None] = [None] * (n + 1)  # the gradient of each boundary
        self.grads_made = [False] * n  # each stage's parameter gradients, once created
        self.live = 0
        self.labels: list[str] = []
        self.lives: list[int] = []
        self.runs = [0] * n
        self.fwd_s = self.bwd_s = self.rebuild_s = self.option_s = self.overhead_s = 0.0
        self.rebuilt_in_full: set[int] = set()  # selective stages whose rebuild stopped early
        self.names = [s.name for s in stages]
        self.forward_labels = [f"forward {s.name}" for s in stages]

    def _init_option_figures(self, stages: Sequence[StageCost], options: Sequence[str],
                             off: Sequence[bool]) -> None:
        """Each stage's bytes under its option, read once (``off``: offloaded)."""
        self.save = [0 if f else s.saved_bytes[o]
                     for s, o, f in zip(stages, options, off, strict=True)]
        # Offloaded copies leave as they are packed: a taped forward peaks like no saving.
        self.taped_extra = [
            s.nosave_peak_extra_bytes if f else s.saved_bytes[o] + s.fwd_transient(o)
            for s, o, f in zip(stages, options, off, strict=True)
        ]
        self.keeps = [s.keeps_input(o) for s, o in zip(stages, options, strict=True)]
        self.nosave_extra = [s.nosave_peak_extra_bytes for s in stages]
        # Of what each stage saves, the casts autocast's cache holds and autograd does
        # not: gone when the forward (or rebuild) ends (Note [Autocast's cast cache])
        self.gone = [0 if f else _gone(s, o) for s, o, f in zip(stages, options, off, strict=True)]
        # During its backward a keep or selective stage holds everything keep saves (a
        # selective one rebuilds the rest first), less the casts gone at the forward's
        # end; an offloaded one has its saved tensors back from the host. That replaces
        # what it held since its forward.
        self.backward_extra = [
            s.offload_bytes + s.bwd_transient_bytes if f
            else s.saved_bytes[KEEP] + s.bwd_transient(o) - gone
            for s, o, f, gone in zip(stages, options, off, self.gone, strict=True)
        ]
        # the same for a selective stage its region's rebuild stopped before (Note [A
        # selective stage rebuilt in full])
        self.backward_in_full = [
            extra if f or not Option(o).is_selective
            else s.saved_bytes[KEEP] + s.bwd_transient(full) - _gone(s, full)
            for s, o, f, extra, full in zip(
                stages, options, off, self.backward_extra,
                (s.full_rebuild_option(o) for s, o in zip(stages, options, strict=True)),
                strict=True)
        ]

    def _init_fsdp(self, problem: Problem, reshard_after_rebuild: bool) -> None:
        # FSDP2 units (Note [FSDP2 units])
        self.u = [s.unit_bytes for s in problem.stages]
        self.fsdp = any(self.u) or problem.root_unit_bytes > 0
        self.copies = problem.collective_copies
        self.reshard_after_rebuild = reshard_after_rebuild and self.fsdp
        self.unsharded: dict[int, bool] = {}  # gathered unit -> unsharded (False: prefetched)
        self.pre_backward_done: set[int] = set()
        self.forward_flat = 0  # the last forward all-gather's flat buffer
        self.reduce_input = 0  # the last reduce-scatter's input

    def _init_transfers(self, problem: Problem, off: Sequence[bool]) -> None:
        """Per stage, an offloaded one's transfer time to the host and back (else None)."""
        self.transfer_s: list[float | None] = [None] * problem.n
        if any(off):
            bandwidth = problem.offload_bandwidth_bytes_per_s
            assert bandwidth is not None
            self.transfer_s = [2 * s.offload_bytes / bandwidth if f else None
                               for s, f in zip(problem.stages, off, strict=True)]

    # -- the live set ------------------------------------------------------------------------

    def hold(self, i: int) -> None:
        if not self.holders[i]:
            self.live += self.a[i]
        self.holders[i] += 1

    def release(self, i: int) -> None:
        self.holders[i] -= 1
        assert self.holders[i] >= 0, i
        if not self.holders[i]:
            self.live -= self.a[i]

    def hold_current(self, i: int) -> None:
        assert not self.current[i], i
        self.current[i] = True
        self.hold(i)

    def release_current(self, i: int) -> None:
        assert self.current[i], i
        self.current[i] = False
        self.release(i)

    def hold_by_stage(self, i: int) -> None:
        assert not self.by_stage[i], i
        self.by_stage[i] = True
        self.hold(i)

    def region_reads(self, region: Region) -> list[HeldRead]:
        """What ``region`` holds from before it besides its input (Note [Nested ...])."""
        start, stages = region.start, self.p.stages
        return [
            r
            for j in range(start, region.stop)
            for r in stages[j].reads
            if r.made_after <= start
            and (r.by_call or j > start)  # the code before the first stage runs outside
            and not (r.boundary and r.made_after == start)  # the region's input
        ]

    def open_region(self, region: Region) -> None:
        """The region holds its input, what the code before its first stage keeps for
        backward (that code ran before the region) and what it reads from before it."""
        self.hold(region.start)
        start = region.start
        if self.p.stages[start].link_saved_bytes:
            self.hold_shared(("link", start), self.p.stages[start].link_saved_bytes)
        for q in self.link_keeps[start]:
            self.hold(q)
        if self.args:
            held = {key: nbytes for j in range(start, region.stop)
                    for key, nbytes in self.stage_args[j]}
            self.open_args[region] = list(held.items())
            for key, nbytes in held.items():
                self.hold_shared(key, nbytes)
        reads = self.region_reads(region) if self.any_reads else []
        self.open_reads[region] = reads
        for r in reads:
            if r.boundary:
                self.hold(r.made_after)
            else:
                self.hold_shared(r.tensor, r.nbytes)

    def close_region(self, region: Region) -> None:
        self.release(region.start)
        start = region.start
        if self.p.stages[start].link_saved_bytes:
            self.release_shared(("link", start), self.p.stages[start].link_saved_bytes)
        for q in self.link_keeps[start]:
            self.release(q)
        if self.args:
            for key, nbytes in self.open_args.pop(region):
                self.release_shared(key, nbytes)
        for r in self.open_reads.pop(region):
            if r.boundary:
                self.release(r.made_after)
            else:
                self.release_shared(r.tensor, r.nbytes)

    def hold_shared(self, key: Hashable, nbytes: int) -> None:
        count = self.shared.get(key, 0)
        if not count:
            self.live += nbytes
        self.shared[key] = count + 1

    def release_shared(self, key: Hashable, nbytes: int) -> None:
        self.shared[key] -= 1
        if not self.shared[key]:
            del self.shared[key]
            self.live -= nbytes

    def frame_holds_args(self, i: int) -> None:
        """Stage i's selective checkpoint frame opens, holding its call's arguments."""
        if self.frames[i]:
            assert not self.args_held[i], i
            self.args_held[i] = True
            for key, nbytes in self.stage_args[i]:
                self.hold_shared(key, nbytes)

    def let_go(self, is_output: bool, b: int) -> None:
        """The model's code lets go of stage ``b``'s output or of boundary ``x_b``."""
        if is_output:
            self.drop(("model holds", b))
        else:
            self.release(b)

    def hold_escapes(self, region: Region) -> None:
        """Tensors the region's stages made that stages after it read (T5's position bias,
        made by the first block and passed to the rest): the region's forward drops its
        stages' saved bytes, which count them, but the readers keep them, to the backward
        of the first reader (the last of them to run backward)."""
        for made_after in range(region.start + 1, region.stop):
            for tensor, nbytes, readers in self.made.get(made_after, ()):
                k = bisect.bisect_left(readers, region.stop)
                if k < len(readers):  # read after the region, first by readers[k]
                    self.hold_shared(tensor, nbytes)
                    self.escapes.setdefault(readers[k], []).append((tensor, nbytes))

    def let_escapes_go(self, i: int) -> None:
        for tensor, nbytes in self.escapes.pop(i, ()):
            self.release_shared(tensor, nbytes)

    def add(self, key: Hashable, nbytes: int) -> None:
        assert key not in self.blocks, key
        self.blocks[key] = nbytes
        self.live += nbytes

    def drop(self, key: Hashable) -> int:
        nbytes = self.blocks.pop(key)
        self.live -= nbytes
        return nbytes

    def keep_saved(self, i: int, nbytes: int) -> None:
        assert self.saved[i] is None, i
        self.saved[i] = nbytes
        self.live += nbytes

    def event(self, label: str, extra: int = 0) -> None:
        self.labels.append(label)
        self.lives.append(self.live + extra)

    # -- FSDP2 units (Note [FSDP2 units]) ----------------------------------------------------

    def forward_gather(self, i: int) -> None:
        """Stage i's unit gathers for its forward: its flat buffer and unsharded parameters
        join, the previous all-gather's flat buffer goes after the copy-out."""
        u = self.u[i]
        if not u:
            return
        self.event(f"all-gather {self.names[i]}", 2 * u)
        self.live += 2 * u - self.forward_flat
        self.forward_flat = u

    def forward_reshard(self, i: int) -> None:
        self.live -= self.u[i]

    def end_forward(self) -> None:
        """The root's post-forward frees the last all-gather's flat buffer."""
        self.live -= self.forward_flat
        self.forward_flat = 0

    def unshard(self, j: int, label: str) -> None:
        """Unit j's parameters are needed in backward (or a rebuild): copied out of its
        prefetched flat buffer, or gathered now; they stay to its post-backward."""
        u = self.u[j]
        state = self.unsharded.get(j)
        if not u or state:
            return
        if state is None:
            self.event(label, 2 * u)  # the flat buffer, then gloo's copy or the copy-out
            self.live += u
        else:
            self.event(label, u)  # the copy-out next to the flat buffer it replaces
        self.unsharded[j] = True

    def after_rebuild_call(self, j: int, region: Region) -> None:
        """Unit j was called in ``region``'s rebuild: under ``reshard_after_rebuild`` it
        is resharded now, unless its backward is next."""
        if not self.reshard_after_rebuild or j == region.stop - 1:
            return
        if self.unsharded.pop(j, None) is not None:
            self.live -= self.u[j]
            self.rebuild_s += self.p.stages[j].gather_s  # gathered again for its backward

    def prefetch(self, j: int) -> None:
        """A pre-backward all-gathers unit j (the one before it in forward order) ahead."""
        if j < 0 or not self.u[j] or j in self.unsharded:
            return
        u = self.u[j]
        self.event(f"all-gather {self.names[j]} (prefetch)", u + (u if self.copies else 0))
        self.live += u
        self.unsharded[j] = False

    def pre_backward(self, i: int) -> None:
        if not self.fsdp or i in self.pre_backward_done:
            return
        self.pre_backward_done.add(i)
        self.unshard(i, f"all-gather {self.names[i]} (backward)")
        self.prefetch(i - 1)

    def post_backward(self, i: int) -> None:
        """Unit i reshards and reduce-scatters its gradients (their shard is grad_bytes)."""
        if not self.u[i]:
            return
        if self.unsharded.pop(i, None) is not None:
            self.live -= self.u[i]
        stage = self.p.stages[i]
        r = stage.reduce_bytes
        self.live += r - self.reduce_input
        self.reduce_input = r
        if r:
            # the input next to the unsharded gradients it replaces, then gloo's copy of it
            extra = r if self.copies else max(0, r - stage.grad_bytes)
            self.event(f"reduce-scatter {stage.name}", extra)

    # -- one stage ---------------------------------------------------------------------------

    def held_link(self, i: int) -> int:
        """Stage i's link bytes when a region starting at i holds them (they are in its
        saved figures, and the code that made them ran before the region)."""
        if ("link", i) in self.shared and not Option(self.options[i]).is_offload:
            return self.p.stages[i].link_saved_bytes
        return 0

    def taped(self, i: int, label: str) -> None:
        """Stage i runs with grad under its option; its input is the current activation."""
        self.runs[i] += 1
        self.hold_current(i + 1)
        self.frame_holds_args(i)
        if self.link_keeps[i]:
            assert not self.link_kept[i], i
            self.link_kept[i] = True
            for q in self.link_keeps[i]:
                self.hold(q)
        link = self.held_link(i)
        self.event(label, self.taped_extra[i] - link)
        if self.keeps[i]:
            self.hold_by_stage(i)
        self.keep_saved(i, self.save[i] - link)
        self.release_current(i)

    def not_saved(self, i: int, label: str) -> None:
        """Stage i runs inside a region's forward (or a child's, in a rebuild): nothing kept."""
        self.runs[i] += 1
        self.hold_current(i + 1)
        self.event(label, self.nosave_extra[i])
        self.release_current(i)

    def pending_at(self, i: int) -> None:
        """Backward has reached stage ``i``: the gradients pending there are alive."""
        nbytes = self.p.stages[i].pending_grad_bytes if i >= 0 else 0
        self.live += nbytes - self.pending
        self.pending = nbytes

    def backward_stage(self, i: int) -> None:
        self.pending_at(i)
        self.pre_backward(i)
        stage = self.p.stages[i]
        saved = self.saved[i]
        assert saved is not None, i
        assert self.grad[i] is None, i
        self.saved[i] = None
        self.grad[i] = self.a[i]
        self.live += self.a[i] - saved
        extra = self.backward_in_full[i] if i in self.rebuilt_in_full else self.backward_extra[i]
        self.event(f"backward {stage.name}", extra - self.held_link(i))
        assert not self.grads_made[i], i
        self.grads_made[i] = True  # after its peak, alive to the optimizer step
        self.live += stage.grad_bytes
        self.bwd_s += stage.bwd_s
        transfer = self.transfer_s[i]
        if transfer is not None:
            self.option_s += transfer
        if i in self.rebuilt_in_full:
            self.runs[i] += 1
            self.rebuild_s += stage.rebuild_s
        else:
            self.option_s += stage.extra_bwd_s.get(self.options[i], 0.0)
        if self.by_stage[i]:
            self.by_stage[i] = False
            self.release(i)
        if self.link_kept[i]:
            self.link_kept[i] = False
            for q in self.link_keeps[i]:
                self.release(q)
        if self.args_held[i]:
            self.args_held[i] = False
            for key, nbytes in self.stage_args[i]:
                self.release_shared(key, nbytes)
        grad = self.grad[i + 1]
        assert grad is not None, i
        self.grad[i + 1] = None
        self.live -= grad
        if i in self.escapes:
            self.let_escapes_go(i)
        if self.fsdp:
            self.post_backward(i)

    # -- levels ------------------------------------------------------------------------------

    def forward_level(self, items: Sequence[Item]) -> None:
        """The top-level forward; the model's code holds boundaries as their
        ``held_through`` says (each counted once with its other holders) and outputs apart
        from the next stage's input as their ``output_held_through`` says."""
        stages, labels = self.p.stages, self.forward_labels
        n = self.p.n
        starts: dict[int, list[tuple[bool, int]]] = {}  # stage -> (is an output, b)
        ends: dict[int, list[tuple[bool, int]]] = {}
        for b, s in enumerate(stages):
            holds = ((False, s.held_through), (True, s.output_held_through))
            if b == n - 1:  # its input, held at the chain's end where its held_through
                # reaches it (Note [The last stage's input at the chain's end])
                at_end = s.held_through is not None and s.held_through >= b
                holds = ((False, s.held_through),) if at_end else ()
            for is_output, through in holds:
                if through is None or (through <= b and b < n - 1):
                    continue
                starts.setdefault(b + 1, []).append((is_output, b))
                if through >= n - 1:  # still held at the chain's end
                    self.held_to_post.append((is_output, b))
                else:
                    ends.setdefault(through, []).append((is_output, b))

        def model_holds(i: int) -> None:
            for is_output, b in starts.get(i, ()):
                if is_output:
                    self.add(("model holds", b), stages[b].output_held_bytes)
                else:
                    self.hold(b)

        def model_lets_go(i: int) -> None:
            for is_output, b in ends.get(i, ()):
                self.let_go(is_output, b)

        for item in items:
            if item.region is None:
                self.fwd_s += stages[item.start].fwd_s
                model_holds(item.start)
                self.forward_gather(item.start)
                self.taped(item.start, labels[item.start])
                if self.any_casts:
                    self.unsaved_to_cache(("cast", item.start))
                self.forward_reshard(item.start)
                model_lets_go(item.start)
                continue
            self.open_region(item.region)
            where = f"(in {item.region}, not saved)"
            for i in range(item.start, item.stop):
                self.fwd_s += stages[i].fwd_s
                model_holds(i)
                self.forward_gather(i)
                self.not_saved(i, f"{labels[i]} {where}")
                self.cache_casts(("cast", i))
                self.forward_reshard(i)
                model_lets_go(i)
            if self.any_reads:
                self.hold_escapes(item.region)
        model_holds(n)

    def rebuild(self, region: Region, items: Sequence[Item]) -> None:
        """Region's rebuild: its items run again, with early stop as in the module note."""
        run, opener = len(items), None  # items[:run] run; items[opener] only opens
        if self.p.early_stop:
            packers = [k for k, it in enumerate(items)
                       if it.region is not None or not Option(self.options[it.start]).is_offload]
            run = 0
            if packers:
                last = packers[-1]
                keeps = (items[last].region is None
                         and Option(self.options[items[last].start]).is_keep)
                run, opener = (last + 1, None) if keeps else (last, last)
        stages, names = self.p.stages, self.names
        cur = region.start
        self.hold_current(cur)
        for_region = f"(for {region})"
        for item in items[:run]:
            if item.region is None:
                self.rebuild_s += stages[item.start].rebuild_s
                if self.fsdp:
                    self.unshard(item.start, f"all-gather {names[item.start]} {for_region}")
                self.taped(item.start, f"rebuild {names[item.start]} {for_region}")
                if self.any_casts:
                    self.unsaved_to_cache(("cast", region, item.start))
                if self.fsdp:
                    self.after_rebuild_call(item.start, region)
            else:
                self.open_region(item.region)
                where = f"(for {region}, in {item.region}, not saved)"
                for i in range(item.start, item.stop):
                    self.rebuild_s += stages[i].rebuild_s
                    if self.fsdp:
                        self.unshard(i, f"all-gather {names[i]} {where}")
                    self.not_saved(i, f"rebuild {names[i]} {where}")
                    self.cache_casts(("cast", region, i))
                    if self.fsdp:
                        self.after_rebuild_call(i, region)
            cur = item.stop
        for k in range(run, len(items)):
            item = items[k]
            if k == opener and self.fsdp:
                # FSDP's pre-forward gathers the stage before its frame opens and stops the
                # rebuild (Note [Resharding after a rebuild])
                self.unshard(item.start, f"all-gather {names[item.start]} (opens {for_region})")
                self.after_rebuild_call(item.start, region)
            if k == opener and item.region is not None:
                self.open_region(item.region)
            elif k == opener:  # a selective stage: hands over its input, caches nothing
                self.hold_by_stage(item.start)
                self.frame_holds_args(item.start)
                self.keep_saved(item.start, 0)
                self.rebuilt_in_full.add(item.start)
            else:  # an offloaded stage after the last hand-over: nothing on the device
                self.keep_saved(item.start, 0)
        self.release_current(cur)
        self.casts_cleared()  # the rebuild's autocast region exits

    def cache_casts(self, key: Hashable) -> None:
        """A stage ran without saving: its parameters' casts stay in autocast's cache."""
        i = key[-1]
        assert isinstance(i, int)
        if self.cast[i]:
            self.add(key, self.cast[i])
            self.casts_held.append(key)

    def unsaved_to_cache(self, key: Hashable) -> None:
        """A stage ran with grad: of its saved bytes, the casts autograd does not keep
        (:func:`_gone`) are the cache's, gone when the autocast region exits (a move: live
        is unchanged)."""
        i = key[-1]
        assert isinstance(i, int)
        saved = self.saved[i]
        if not self.gone[i] or not saved:
            return
        moved = min(self.gone[i], saved)
        self.saved[i] = saved - moved
        self.blocks[key] = moved
        self.casts_held.append(key)

    def casts_cleared(self) -> None:
        """The autocast region exits: its cache lets go of every cast it held."""
        for key in self.casts_held:
            self.drop(key)
        self.casts_held.clear()

    def backward_link(self, i: int) -> None:
        """The backward of the model's code between stage ``i - 1`` and stage ``i`` (Note
        [The backward of the code between stages])."""
        nbytes = self.p.stages[i].link_backward_bytes if i else 0
        if nbytes:
            after = self.p.stages[i - 1].pending_grad_bytes  # pending once it is done
            self.event(f"backward of the code before {self.names[i]}",
                       nbytes + after - self.pending)

    def backward_level(self, items: Sequence[Item], start: int | None = None) -> None:
        """``start``: where the region whose items these are starts (its link's backward
        comes after the region's)."""
        for item in reversed(items):
            if item.region is None:
                self.backward_stage(item.start)
                if item.start != start:
                    self.backward_link(item.start)
                continue
            self.overhead_s += self.p.region_s(item.start, item.stop)
            self.pending_at(item.stop - 1)
            self.pre_backward(item.stop - 1)
            self.add(("overhead", item.region), self.p.region_overhead_bytes)
            # what the last stage's backward made before asking for the rebuild (Note
            # [What a rebuild starts with]); its own backward's transient has it after
            self.add(("rebuild grad", item.region), self.p.stages[item.stop - 1].rebuild_grad_bytes)
            self.rebuild(item.region, item.items)
            self.drop(("rebuild grad", item.region))
            self.backward_level(item.items, item.start)
            self.drop(("overhead", item.region))
            self.close_region(item.region)
            if item.start != start:
                self.backward_link(item.start)


def simulate(plan: Plan, problem: Problem) -> Simulation:
    """The memory timeline, peak and step time of one training step of ``plan``.

    The plan must name the problem's stages in order, and each option must be available
    for its stage (measured selective bytes; offload only with a host link).
    """
    _check_plan(plan, problem)
    w = _Walker(problem, plan.options, plan.reshard_after_rebuild)
    _forward_pre_chain(w)
    top = plan_tree(plan)
    w.forward_level(top)
    kept = _forward_post_chain(w)
    _backward_post_chain(w)
    w.backward_level(top)
    _backward_pre_chain(w)
    w.event("optimizer step", problem.optimizer_step_bytes)
    _check_all_let_go(w)
    return _simulation(w, kept)


def _check_plan(plan: Plan, problem: Problem) -> None:
    """The plan names the problem's stages in order, with options each stage has, and no
    region across a chain break."""
    names = problem.stage_names
    if len(plan.stages) != len(names):
        raise UsageError(
            f"the plan has {len(plan.stages)} stages but the problem has {len(names)}; "
            "plan and problem must list the same stages in the same order"
        )
    for i, (ours, theirs) in enumerate(zip(plan.stages, names, strict=True)):
        if ours != theirs:
            raise UsageError(
                f"the plan's stage {i} is {ours!r} but the problem's is {theirs!r}; plan and "
                "problem must list the same stages in the same order"
            )
    for i, option in enumerate(plan.options):
        problem.check_option(i, option)
    for b in problem.breaks:
        r = next((r for r in plan.regions if r.start < b < r.stop), None)
        if r is not None:
            raise UsageError(
                f"region {r} spans a chain break before stage {names[b]!r} "
                f"({problem.stages[b].break_before}); end the region at stage {b}"
            )


def _forward_pre_chain(w: _Walker) -> None:
    """What is alive from the step's start, to the pre-chain's forward event."""
    p = w.p
    w.add("params", p.params_bytes)
    w.add("optimizer", p.optimizer_state_bytes)
    w.add("input", p.inputs_bytes)
    w.add("pre-chain", p.pre_chain_bytes - p.args_at_return_bytes)
    for key, nbytes in w.model_args:  # the model's code holds them (Note [Arguments a ...])
        w.hold_shared(key, nbytes)
    w.hold_current(0)
    w.forward_flat = p.root_unit_bytes  # the root's all-gather, kept to the first unit's
    w.live += w.forward_flat
    w.event("forward pre-chain", w.forward_flat if p.collective_copies else 0)


def _forward_post_chain(w: _Walker) -> int:
    """The post-chain's forward and the model's return; what the step keeps from its
    forward to its backward (``Simulation.kept_bytes``)."""
    p = w.p
    # the loss the caller holds from the post-chain's forward to backward is kept too (the
    # residue, its gradient included: an upper bound)
    kept = (w.live - p.params_bytes - p.optimizer_state_bytes - p.inputs_bytes
            + p.backward_residue_bytes)
    w.event("forward post-chain", p.post_chain_bytes)
    w.casts_cleared()  # the loss_fn's autocast region exits (Note [Autocast's cast cache])
    # the model's forward has returned: what only its code held of the pre-chain's goes
    # (Note [What the forward lets go of at its return])
    for nbytes in (p.pre_chain_cast_bytes, p.pre_chain_at_return_bytes):
        w.blocks["pre-chain"] -= nbytes
        w.live -= nbytes
    w.end_forward()
    if w.fsdp:
        w.prefetch(p.n - 1)  # the root's pre-backward
    return kept


def _backward_post_chain(w: _Walker) -> None:
    """The post-chain's backward, to the chain output's gradient."""
    p, n = w.p, w.p.n
    # Gradients nobody claims, from the first backward event on (an upper bound).
    w.add(("param grads", "unattributed"), p.unattributed_grads_bytes)
    # The chain output x_n (or its gradient, the same size) plus the post-chain's peak.
    if p.post_chain_backward_bytes is not None:
        # the model's forward has returned: what its code held is gone (the figure is
        # measured so, from the chain's end less what that let go of without a plan)
        for is_output, b in w.held_to_post:
            w.let_go(is_output, b)
        for key, nbytes in w.model_args:  # the model lets go of the stages' arguments
            w.release_shared(key, nbytes)
        w.event("backward post-chain", p.post_chain_backward_bytes)
    else:
        w.event("backward post-chain", p.post_chain_bytes)
        for is_output, b in w.held_to_post:
            w.let_go(is_output, b)
    w.add(("param grads", "post-chain"), p.post_chain_grads_bytes)  # after its peak
    # the loss the caller holds and its gradient: in the post-chain's figures (measured
    # from the chain's end), alive beside the chain from here to the pre-chain's backward
    w.add("residue", p.backward_residue_bytes)
    w.release_current(n)
    w.grad[n] = w.a[n]
    w.live += w.a[n]


def _backward_pre_chain(w: _Walker) -> None:
    """The pre-chain's backward, then the root unit's post-backward under FSDP2."""
    p = w.p
    w.pending_at(-1)
    w.add(("param grads", "pre-chain"), p.pre_chain_grads_bytes)
    w.event("backward pre-chain")
    assert w.grad[0] is not None
    w.live -= w.grad[0]
    w.grad[0] = None
    w.drop("pre-chain")
    w.drop("residue")
    if w.fsdp:  # the root's post-backward: stage 0's reduce-scatter input goes, its own
        root = p.root_unit_bytes
        w.live -= w.reduce_input
        w.event("reduce-scatter root", root + (root if p.collective_copies else 0))
        w.reduce_input = 0
        assert not w.unsharded, w.unsharded


def _check_all_let_go(w: _Walker) -> None:
    """At the step's end only parameters, optimizer state, input and gradients remain."""
    grads = {("param grads", "unattributed"), ("param grads", "post-chain"),
             ("param grads", "pre-chain")}
    assert not any(w.holders) and not any(w.current) and not any(w.by_stage)
    assert not w.shared and not w.open_reads and not w.escapes, w.shared
    assert set(w.blocks) == {
        "params", "optimizer", "input", *grads}, (w.holders, w.blocks)
    assert all(s is None for s in w.saved) and all(g is None for g in w.grad)
    assert all(w.grads_made)


def _simulation(w: _Walker, kept: int) -> Simulation:
    """The walked step as a :class:`Simulation`."""
    p = w.p
    peak_bytes = max(w.lives)
    peak = w.lives.index(peak_bytes)  # the first event at the peak
    time = StepTime(
        forward_s=w.fwd_s,
        backward_s=w.bwd_s,
        rebuild_s=w.rebuild_s,
        option_s=w.option_s,
        overhead_s=w.overhead_s,
        outside_chain_s=p.outside_chain_s,
    )
    return Simulation(tuple(w.labels), tuple(w.lives), peak_bytes, w.labels[peak], time,
                      tuple(w.runs), kept)


def baseline_time(problem: Problem) -> StepTime:
    """The step time :func:`simulate` predicts without checkpointing, without walking the
    timeline: the same sums in the same order (forward from the first stage, backward
    from the last), so the same floats."""
    fwd = bwd = option = 0.0
    for stage in problem.stages:
        fwd += stage.fwd_s
    for stage in reversed(problem.stages):
        bwd += stage.bwd_s
        option += stage.extra_bwd_s.get(KEEP, 0.0)
    return StepTime(forward_s=fwd, backward_s=bwd, rebuild_s=0.0, option_s=option,
                    overhead_s=0.0, outside_chain_s=problem.outside_chain_s)
