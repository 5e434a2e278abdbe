"""What happens at each stage call: which checkpoint frames open and close, and the rebuild.

One :class:`Engine` serves one model with an applied plan. The stage modules' ``forward``
is replaced by :meth:`Engine.wrap`, and two hooks on the root model mark where a forward
pass begins and ends. Everything goes through torch's non-reentrant checkpoint
(:class:`~remat.runtime._torch_checkpoint.CheckpointFrame`), selective-checkpoint
contexts and saved-tensor hooks; this module only decides *when* to open which.

Note [Which regions open when]
------------------------------
torch's nestable checkpoint (``NOTE [ Nestable Checkpoint ]`` in torch/utils/checkpoint.py)
gives each frame the tensors saved while it is the innermost frame, plus the inputs of
the frames opened directly inside it (Rule 2). A frame's rebuild must save exactly the
same sequence again, or torch raises "A different number of tensors was saved". So the
frame structure inside a region must be identical in its forward and in its rebuild:

* forward: every region opens, nested (kind OPEN). Only frames' inputs are packed, and
  packed into placeholders, so nothing inside the top-level regions is kept; the inner
  frames cost a generator step each, no memory. (Opening only the top-level regions in
  forward and the children in the rebuild would save fewer tensors in the rebuild than
  in forward: torch rejects that.)
* the rebuild of region R (kind REPLAYING) replays R's recorded stage calls; R's children
  open again, as SHADOW frames: they only hide their insides from R and hand R their
  inputs, and are never rebuilt themselves (nothing ever unpacks what they saved), so
  nothing opens inside a shadow. R itself never reopens inside its own rebuild.
* backward then rebuilds each child from the frame it opened in forward, whose input
  R's rebuild just restored, and so on down: a stage at depth d runs at most d + 1 times
  per step (exactly d + 1 with early stop off), and at any moment only one region per
  level holds its insides.

With early stop (torch's default) torch ends a rebuild by raising inside it as soon as
it has what backward needs; the rebuild aborts what it opened, innermost first, in a
``finally`` and restores the engine state (``_unwind``).

Note [Options inside regions]
-----------------------------
An option applies where the stage really runs with grad: in forward outside regions,
or in the rebuild of its innermost region. By Note [Which regions open when] the
saved-tensor hooks around a stage must match between forward and that rebuild:

* ``selective`` opens a single-stage frame around the stage in both. Outside regions it
  is torch's selective checkpoint. Inside a region the forward frame must not cache
  anything (the region keeps nothing), so its forward context is a no-op; the rebuild
  of the innermost region runs the stage under the caching half of a fresh
  selective-checkpoint pair and leaves the recompute half on the call record, where the
  forward frame's rebuild (at this stage's backward) picks it up (``_RecomputeContext``).
  When early stop ends the region's rebuild before this stage runs, nothing was
  cached and the stage is rebuilt in full: the same values, only slower.
* ``offload`` inside a region moves the saved tensors to host memory in forward (the
  copies backward uses) and drops them in the region's rebuild; outside regions it is
  ``save_on_cpu``. The device keeps nothing of the stage either way.

Note [Code between the stages of a region]
------------------------------------------
The model's own code between two stages of an open region (a residual add, a skip
concatenation, a norm, collecting hidden states, an auxiliary loss) runs inside the
region's frame and is recorded (a GAP entry holds the recorder), and the rebuild replays
it between the stage calls: Note [Glue between stages] in ``glue.py``. Each stage call
inside a region is recorded the same way, its arguments by slot, so the rebuild feeds
each stage what the rebuilt code before it made, whichever argument that is. A link
whose code cannot be replayed raises in forward; the profile finds those links first
(``Engine.breaks``, a pass with one region over the chain) and the planner never puts a
region across them.

Note [Slots from enclosing regions]
-----------------------------------
A region nested in another may use a tensor its parent made before it opened: a UNet's
up block, in a child region, concatenates a skip tensor a down block made earlier in the
parent. Holding the forward tensor from forward to the child's rebuild would keep alive
what the parent exists to free. The child notes the slot instead (``outer``), and the
parent's rebuild, which always runs first (the child's input is saved in the parent's
frame) and always reaches the child's first call (early stop cannot end it before the
child's input is saved), hands the child the rebuilt values (``children_at``). In the
common case they are alive then anyway: a later stage of the parent saved them.

Note [One engine, several plans]
--------------------------------
A plan set (Note [Plan sets] in remat.core.plan_set) runs one plan per batch shape. The
engine keeps one :class:`Layout` per plan (what a call reads of a plan: its regions,
options, which stages are hooked) and the root's shape hook picks one before each pass
begins (:meth:`Engine.use`: a few attribute assignments). The stage hooks of every plan
are installed once; a stage no region of the running plan spans ignores them. A region
remembers the layout that opened it, and its rebuild, in a backward that may come after
the next forward began with another plan, runs under that layout.

Note [Buffers mutated in forward]
---------------------------------
A rebuild re-runs stage code, so in-place buffer updates (BatchNorm's running_mean,
running_var and num_batches_tracked, user counters kept as buffers) would happen twice
per step: plain ``torch.utils.checkpoint`` does exactly that, and BatchNorm's running
statistics then drift from an unwrapped model's. In forward we note which buffers of a
recorded call changed (``_version``); a rebuild clones just those first and copies them
back in a ``finally``. torch's batch-norm kernels update running_mean and running_var
without bumping ``_version``, so a norm module's running statistics count as changed
whenever its ``num_batches_tracked`` did; another kernel that hides an in-place update
the same way would go unnoticed. The rebuild sees the post-step values: code that reads a buffer
it also updates (BatchNorm in training reads batch statistics, not running ones) would
compute something else in the rebuild.

Note [Observing stage calls]
----------------------------
``remat.verify`` needs to see each stage's code run, in forward and in every rebuild
(the region rebuilds here, and the replays torch runs for selective frames), to compare
what the rebuild computes with what the forward computed. With an observer set,
:meth:`Engine.call` wraps the stage's own forward so that the observer hears
``stage_started`` / ``stage_finished`` around exactly the stage's code: not the frames
the engine opens, nor the buffer restores. Whether a call is a rebuild is read when the
call runs: only the forward of a pass runs in phase FORWARD; region rebuilds run in
REBUILD, and a selective frame's replay runs from backward, after the pass ended (IDLE).
Without an observer the only cost is one attribute test per stage call.

Note [Stages with hooks of their own]
-------------------------------------
A stage module can carry forward hooks of its own that change what its ``forward``
receives and returns. FSDP2's ``fully_shard(block)`` is the common case: its pre-hook
all-gathers the unit's parameters and hands the block *new* input tensors (its
``RegisterPostBackwardFunction``), and its forward hook reshards (and casts the output
under a mixed-precision policy). Inside a multi-stage region the engine must see the
stage call as the model's code makes it: the input the model passed (made inside the
region, so the rebuild can feed it again) and the output the model gets back, with the
hooks' own work (gathers, reshards) outside the recorded glue, since the rebuild calls
the stage module again and its hooks run again there. So every stage inside a
multi-stage region gets a forward pre-hook that runs first (:meth:`Engine.enter_stage`:
it ends the glue recording and notes the model's arguments) and a forward hook that runs
last (:meth:`Engine.leave_stage`: it notes the output the model receives and starts the
glue recording). Hooks registered after ``apply`` (``fully_shard`` after the plan) would
run outside ours, so each training pass moves ours back to first and last
(``_keep_hooks_outermost``; torch's own ``prepend=True`` does the same move). The stage's
code still runs on what the other hooks handed it; a stage module called as
``module.forward(...)`` runs no hooks and is recorded as before.

Note [Calls of one module as stages]
------------------------------------
A module the forward calls several times (ALBERT's shared layer group, a looped block) can
be several stages, one per call (``path#k``: Note [Stages that are calls of one module] in
remat.core.stage_names). Its ``forward`` is replaced once, by one :class:`StageForward`
that knows all its stage indices, and so are its stage hooks. Which stage a call is comes
from the engine, not from a counter of the module's calls: in forward it is the stage the
chain expects next (``next_stage``), in a rebuild the stage whose recorded call is being
replayed (``current``; a rebuild calls the module again, with its hooks, so a counter
would count it as one more forward call), and a stage hook's leave belongs to the call
whose record opens the gap (``gap_due``). A call the chain does not expect (the loop runs
the module once more than the plan has calls) is handed to the module's first stage, and
the usual order check reports it. Each call is recorded and rebuilt on its own; the
module's parameters are the same tensors in every call, so torch sums their gradients.

Note [torch.compile sees the engine as one opaque call]
-------------------------------------------------------
Under ``torch.compile`` Dynamo would trace into the engine. It cannot trace torch's
checkpoint generator (a skipped function: a graph break at every frame it opens), and what
it does trace goes wrong in two ways, both measured with torch 2.13 on CPU:

* the stage's own code, traced in forward inside the graph Dynamo builds there, runs as a
  compiled graph in forward but eagerly in the rebuild (backward runs outside the compiled
  frame), and a compiled graph saves other tensors than eager code: torch raises
  "Recomputed values for the following tensors have different metadata";
* the engine's own bookkeeping (``next_stage = i + 1``) becomes graph code; after a
  recompile it is a symbolic int that inductor's generated code then fails to define
  (``NameError: name 's34' is not defined``).

So the stage calls and the root hooks run through ``torch.compiler.disable``
(:func:`opaque`): Dynamo graph-breaks there and runs them eagerly, exactly as without
compile, and compiles the code around them. The stage's own ``forward`` runs eagerly too,
unless it is itself a compiled function: compile the stage forwards *before* ``apply``
(``block.forward = torch.compile(block.forward)``) and the engine calls that compiled
function both in forward and in the rebuild, one graph, the same saved tensors, the same
random numbers (torch restores the RNG state the graph draws its seeds from). In eval mode
or under no-grad the wrapped forward is the stage's own, and Dynamo traces it whole. The
disabled wrapper costs about 0.7 us per stage call.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from remat.core.errors import RematError, UsageError
from remat.core.plan_format import Plan
from remat.runtime._torch_checkpoint import CheckpointFrame, noop_context_fn
from remat.runtime.fsdp_units import check_fsdp_units, reshard_units
from remat.runtime.glue import (
    GlueRecorder,
    GlueStep,
    Slot,
    Tape,
    Template,
    bind,
    call_restoring,
)
from remat.runtime.policies import (
    StagePolicy,
    discard_saved_tensors,
    offload_saved_tensors,
    routes,
    routing_contexts,
    selective_contexts,
    wants_offload,
)
from remat.runtime.rebuild_once import RebuildOnceFrame

__all__ = ["NOT_PICKLED", "Engine", "EngineCallable", "PassHook", "Phase", "StageForward",
           "StageHook", "StageObserver", "main_input", "main_output", "opaque"]


class StageObserver(Protocol):
    """Told when a stage's own code starts and ends (Note [Observing stage calls]).

    ``rebuild`` is False for the forward call and True for every rebuild of it. An
    exception inside the stage (including torch's early stop) still ends the call,
    with ``output`` None.
    """

    def stage_started(
        self, stage: int, rebuild: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None: ...

    def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None: ...


class Phase(enum.Enum):
    IDLE = "idle"  # no pass, or an eval / no-grad pass: stages run their own forward
    FORWARD = "forward"  # a training forward of the root model
    REBUILD = "rebuild"  # a region's rebuild, called from backward


class Kind(enum.Enum):
    OPEN = "open"  # opened in forward; backward rebuilds it
    REPLAYING = "replaying"  # its rebuild is running
    SHADOW = "shadow"  # a child reopened inside its parent's rebuild; never rebuilt
    GAP = "gap"  # between two stages of an open region in forward (Note [Code between ...])


class _Where(enum.Enum):
    TOP = "top"  # forward, outside every region
    IN_REGION = "in-region"  # forward, inside an OPEN region
    REBUILD = "rebuild"  # the rebuild of the stage's innermost region


@dataclass(eq=False)
class CallRecord:
    """One stage call, enough to replay it inside a region.

    ``inputs`` holds the call's arguments with the tensors made inside the pass's regions
    as slots (Note [Glue between stages]): keeping forward intermediates here would
    defeat the region. Outside regions (a selective or offload stage) it is None.
    """

    stage: int
    inputs: Template | None = None
    outputs: tuple[int | None, ...] = ()  # the output's tensors' slots
    mutated: tuple[torch.Tensor, ...] = ()  # Note [Buffers mutated in forward]
    sac_cache: Any = None  # Note [Options inside regions]


@dataclass(eq=False)
class _Entry:
    region: int
    kind: Kind
    frame: CheckpointFrame | RebuildOnceFrame | None  # None while REPLAYING, and for a GAP
    calls: list[CallRecord | GlueStep] = field(default_factory=list)
    hooks: Any = None  # a GAP's entered recorder
    input_slot: int = -1  # the slot of the region's input
    first_slot: int = 0  # slots from here on are made inside the region
    # Slots made in enclosing regions before this one opened that its steps use (a skip
    # tensor), and their values, put here by the parent's rebuild (Note [Slots from
    # enclosing regions]); children_at: the child regions opening at each step.
    outer: set[int] = field(default_factory=set)
    externals: dict[int, torch.Tensor] = field(default_factory=dict)
    children_at: dict[int, list[_Entry]] = field(default_factory=dict)
    rebuilt: int = 0  # how many times backward rebuilt it (Note [Backward in passes])
    layout: Layout | None = None  # the plan that opened it (Note [One engine, several plans])

    def dead_after(self) -> list[list[int]]:
        """Per step, the slots no later step (nor a child region opening later) reads: a
        rebuild lets them go there, as the forward did, rather than at its end."""
        last: dict[int, int] = {}
        for index, step in enumerate(self.calls):
            assert step.inputs is not None
            for child in self.children_at.get(index, ()):
                for k in child.outer:
                    last[k] = index - 1  # taken before the step runs
            for leaf in step.inputs.leaves:
                if isinstance(leaf, Slot):
                    last[leaf.k] = index
            for made in step.outputs:
                if made is not None:
                    last.setdefault(made, index)  # made and never read: gone at once
        dead: list[list[int]] = [[] for _ in self.calls]
        for k, index in last.items():
            if k != self.input_slot and index >= 0:
                dead[index].append(k)
        return dead

    def add(self, step: CallRecord | GlueStep) -> None:
        """Append a step; note the slots it uses from enclosing regions."""
        self.calls.append(step)
        assert step.inputs is not None  # recorded inside a region
        for leaf in step.inputs.leaves:
            if isinstance(leaf, Slot) and leaf.k < self.first_slot and leaf.k != self.input_slot:
                self.outer.add(leaf.k)


def main_input(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The hidden state a stage receives: its first tensor argument, positional first."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def main_output(out: object) -> torch.Tensor | None:
    """The hidden state a stage returns: the output, or its first item, if a tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        first = out[0]
    elif isinstance(out, Mapping) and out:
        first = next(iter(out.values()))
    else:
        return None
    return first if isinstance(first, torch.Tensor) else None


@dataclass(frozen=True, eq=False)
class Layout:
    """What the engine reads of one plan at every call (Note [One engine, several plans])."""

    plan: Plan
    policies: tuple[StagePolicy, ...]
    parent: tuple[int, ...]  # each region's parent's index, -1 at the top
    opens_at: tuple[tuple[int, ...], ...]  # per stage, the regions opening there
    closes_at: tuple[tuple[int, ...], ...]
    plain: tuple[bool, ...]  # stages whose forward outside regions needs nothing from us
    hooked: tuple[int, ...]  # stages inside multi-stage regions (Note [Stages with hooks ...])
    saves_routing: tuple[bool, ...]  # per region (Note [Routing saved in regions])


def make_layout(plan: Plan, policies: Sequence[StagePolicy],
                stage_routes: Sequence[Any]) -> Layout:
    n = len(plan.stages)
    regions = plan.regions
    index = {r: k for k, r in enumerate(regions)}
    parents = (plan.parent(r) for r in regions)
    opens: list[list[int]] = [[] for _ in range(n)]
    closes: list[list[int]] = [[] for _ in range(n)]
    for k, r in enumerate(regions):
        opens[r.start].append(k)  # outermost first
        closes[r.stop - 1].insert(0, k)  # innermost first
    return Layout(
        plan=plan,
        policies=tuple(policies),
        parent=tuple(-1 if p is None else index[p] for p in parents),
        opens_at=tuple(map(tuple, opens)),
        closes_at=tuple(map(tuple, closes)),
        plain=tuple(not opens[i] and policies[i].is_keep for i in range(n)),
        hooked=tuple(i for i in range(n) if any(
            r.start <= i < r.stop and r.stop - r.start > 1 for r in regions)),
        saves_routing=tuple(any(stage_routes[i] for i in range(r.start, r.stop))
                            for r in regions),
    )


def _never_rebuilt(*_args: Any) -> None:
    raise RematError("internal error: a shadow checkpoint frame was rebuilt; please report it")


class _RecomputeContext:
    """Recompute context of a selective stage's own frame, entered by torch in backward.

    It enters the recompute half of a selective-checkpoint pair (a fixed one outside
    regions, or the one the region's rebuild left on the record: Note [Options inside
    regions]) and puts the stage's mutated buffers back afterwards (Note [Buffers
    mutated in forward]). The restore lives here, not in the frame's ``fn``, because
    ``fn`` runs inside the selective mode, which would take the clone and ``copy_`` for
    ops of the stage.
    """

    __slots__ = ("_fixed", "_mode", "_record", "_saved")

    def __init__(self, record: CallRecord, fixed: Any = None) -> None:
        self._record = record
        self._fixed = fixed
        self._mode: Any = None
        self._saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        with torch.no_grad():
            self._saved = [b.clone() for b in self._record.mutated]
        if self._fixed is not None:
            self._mode = self._fixed
        else:  # taken, not read: a later backward must not reuse a consumed cache
            self._mode, self._record.sac_cache = self._record.sac_cache, None
        if self._mode is not None:
            self._mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            saved, self._saved = self._saved, []
            with torch.no_grad():
                for b, s in zip(self._record.mutated, saved, strict=True):
                    b.copy_(s)


class Engine:
    """Per-model runtime state and the logic run at every stage call."""

    def __init__(
        self,
        plan: Plan,
        modules: Sequence[nn.Module],
        policies: Sequence[StagePolicy],
        *,
        preserve_rng_state: bool = True,
        split_backward: bool = False,
    ) -> None:
        n = len(plan.stages)
        self.names = plan.stages
        self.modules = tuple(modules)
        # Submodules with buffers, and those with running statistics, per stage
        # (Note [Buffers mutated in forward]); walking module.buffers() per call is slow.
        self.buffer_owners = tuple(
            tuple(m for m in module.modules() if m._buffers) for module in self.modules
        )
        self.norms = tuple(
            tuple(m for m in owners if "num_batches_tracked" in m._buffers)
            for owners in self.buffer_owners
        )
        # Regions over a stage that routes keep its routing decisions (Note [Routing saved
        # in regions]).
        self.routes = tuple(routes(module) for module in self.modules)
        # The plan's layout; a plan set has one per plan (Note [One engine, several plans])
        self.layouts: tuple[Layout, ...] = (make_layout(plan, policies, self.routes),)
        self._set_layout(self.layouts[0])
        self.hook_ids: list[tuple[nn.Module, int, int]] = []
        self.entered: tuple[int, tuple[Any, ...], dict[str, Any]] | None = None
        self.gap_due: CallRecord | None = None  # the call whose forward hook opens the GAP
        self.units_checked = False  # FSDP units made after apply: checked at the first pass

        self.phase = Phase.IDLE
        self.next_stage = 0
        self.stack: list[_Entry] = []
        self.tape = Tape()  # slots of the tensors made inside regions (Note [Glue ...])
        # The profile's probe pass sets this to [None] * n: link hazards are noted here
        # (why no region may span the link into stage i) instead of raised.
        self.breaks: list[str | None] | None = None
        # ... and, per stage, what its call and the code before it read from earlier in the
        # pass: (slot, made after, bytes, by its call); with each stage's input slot.
        self.reads: list[list[tuple[int, int, int, bool]]] | None = None
        self.input_slots: list[int | None] = [None] * n
        # ... and those made before the chain that get a gradient: (id, storage bytes)
        self.reads_before: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.current: CallRecord | None = None  # the call a rebuild is replaying
        self.rebuilds = 0
        self.warned_passes = False  # Note [Backward in passes]
        self.offload_noop: dict[int, str] = {}  # stage -> device of its input
        # Debugging switches, off in normal training (Note [Observing stage calls]).
        self.preserve_rng_state = preserve_rng_state
        # Regions rebuilt once for a backward in passes (Note [One rebuild for a backward
        # in passes] in rebuild_once.py); apply refuses the plans it cannot run.
        self.frames: type[CheckpointFrame] | type[RebuildOnceFrame] = (
            RebuildOnceFrame if split_backward else CheckpointFrame)
        self.observer: StageObserver | None = None
        self.split_backward = split_backward
        # Note [torch.compile sees the engine as one opaque call]
        self.opaque_call = opaque(self.call)
        self.opaque_begin = opaque(self.begin_pass)
        self.opaque_end = opaque(self.end_pass)
        self.opaque_enter = opaque(self.enter_stage)
        self.opaque_leave = opaque(self.leave_stage)

    def __deepcopy__(self, memo: dict[int, Any]) -> Engine:
        """A new engine over the copies of the stages (Note [Copies of an applied model])."""
        if self.phase is not Phase.IDLE:
            raise UsageError("the model was deep-copied in the middle of a forward or backward "
                             "pass with a remat plan applied; copy it between training steps")
        new = object.__new__(Engine)
        memo[id(self)] = new  # the copied stages' forwards refer to it
        modules = copy.deepcopy(self.modules, memo)
        new.__init__(self.plan, modules, self.policies,  # type: ignore[misc]
                     preserve_rng_state=self.preserve_rng_state,
                     split_backward=self.split_backward)
        new.layouts = self.layouts  # immutable, no modules in them
        new._set_layout(self.layout)
        new.hook_ids = [(copy.deepcopy(m, memo), pre, post) for m, pre, post in self.hook_ids]
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UsageError(NOT_PICKLED)

    def _set_layout(self, layout: Layout) -> None:
        self.layout = layout
        # what a copy is made from (Note [Copies of an applied model])
        self.plan = layout.plan
        self.policies = layout.policies
        self.regions = layout.plan.regions  # sorted by (start, -stop): parents first
        self.parent = layout.parent
        self.opens_at = layout.opens_at
        self.closes_at = layout.closes_at
        self.plain = layout.plain
        self.hooked_set = frozenset(layout.hooked)
        self.saves_routing = layout.saves_routing
        self.reshard_after_rebuild = layout.plan.reshard_after_rebuild  # see reshard_units

    def add_layouts(self, plans: Sequence[Plan], policies: Sequence[Sequence[StagePolicy]]
                    ) -> None:
        """The plans of a plan set, each with its stages' policies; the first is used."""
        self.layouts = tuple(make_layout(p, pol, self.routes)
                             for p, pol in zip(plans, policies, strict=True))
        self._set_layout(self.layouts[0])

    def use(self, k: int) -> None:
        """Run plan ``k`` of a plan set from the pass beginning now (Note [One engine,
        several plans])."""
        if self.layout is not self.layouts[k]:
            self._set_layout(self.layouts[k])

    # -- installation -------------------------------------------------------------------

    def wrap(self, i: int | Sequence[int], orig: Callable[..., Any] | Sequence[Callable[..., Any]]
             ) -> Callable[..., Any]:
        """The ``forward`` installed on stage ``i``; ``orig`` is its own forward. For a module
        that is several stages (its calls: Note [Calls of one module as stages]), ``i`` are
        their indices and ``orig`` the forward each runs."""
        if isinstance(i, int):
            return StageForward(self, (i,), (cast(Callable[..., Any], orig),))
        origs = tuple(cast(Sequence[Callable[..., Any]], orig))
        return StageForward(self, tuple(i), origs)

    def calls_of(self) -> list[tuple[nn.Module, tuple[int, ...]]]:
        """Each distinct stage module, with the indices of the stages that are its calls."""
        found: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, module in enumerate(self.modules):
            found.setdefault(id(module), (module, []))[1].append(i)
        return [(module, tuple(indices)) for module, indices in found.values()]

    def stage_called(self, indices: tuple[int, ...]) -> int:
        """Which of ``indices`` (the stages that are calls of one module) the call of that
        module starting now is (Note [Calls of one module as stages]): in forward the stage
        the chain expects next, in a rebuild the one whose recorded call is replayed. When
        neither is one of them, the first: the caller's checks then report the misplaced
        call."""
        if len(indices) == 1:
            return indices[0]
        if self.phase is Phase.FORWARD and self.next_stage in indices:
            return self.next_stage
        if self.phase is Phase.REBUILD and self.current is not None \
                and self.current.stage in indices:
            return self.current.stage
        return indices[0]

    def install_stage_hooks(self) -> list[RemovableHandle]:
        """Hooks on the stages inside multi-stage regions (Note [Stages with hooks ...]);
        one pair per module, however many stages are its calls."""
        handles = []
        hooked = {i for layout in self.layouts for i in layout.hooked}
        for module, indices in self.calls_of():
            mine = tuple(i for i in indices if i in hooked)
            if not mine:
                continue
            pre = module.register_forward_pre_hook(
                StageHook(self, indices, enter=True), prepend=True, with_kwargs=True
            )
            post = module.register_forward_hook(StageHook(self, indices, enter=False))
            self.hook_ids.append((module, pre.id, post.id))
            handles += [pre, post]
        return handles

    def enter_stage(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Stage ``i``'s call begins, before any other hook of it: end the glue recording
        and note what the model passes (Note [Stages with hooks of their own])."""
        if self.phase is Phase.IDLE or i not in self.hooked_set:
            return
        if self.phase is Phase.FORWARD and self.stack and self.stack[-1].kind is Kind.GAP:
            self._unwind(len(self.stack) - 1)
        self.entered = (i, args, dict(kwargs))

    def leave_stage(self, i: int, output: Any) -> None:
        """Stage ``i``'s call ends, after every other hook of it: its output is what the
        model receives; the code after it is recorded from here."""
        if i not in self.hooked_set:
            return
        record, self.gap_due = self.gap_due, None
        if record is None or record.stage != i or self.phase is not Phase.FORWARD:
            return
        record.outputs = self.tape.outputs(output, i + 1)
        self._open_gap(i + 1)

    def _keep_hooks_outermost(self) -> None:
        """Our stage hooks first and last again, whoever hooked the stages after ``apply``."""
        for module, pre, post in self.hook_ids:
            pres = cast(OrderedDict, module._forward_pre_hooks)
            posts = cast(OrderedDict, module._forward_hooks)
            if pre in pres and next(iter(pres)) != pre:
                pres.move_to_end(pre, last=False)
            if post in posts and next(reversed(posts)) != post:
                posts.move_to_end(post)

    def begin_pass(self, module: nn.Module, _args: Any) -> None:
        """Root forward pre-hook: a new pass starts (training with grad: checkpointing)."""
        if self.phase is not Phase.IDLE or self.stack:  # stale after a KeyboardInterrupt
            self._unwind(0)
        self._reset()
        if module.training and torch.is_grad_enabled():
            if not self.units_checked:
                check_fsdp_units(module, self.names, self.modules, self.regions)
                self.units_checked = True
            self.phase = Phase.FORWARD
            if self.hook_ids:
                self._keep_hooks_outermost()

    def end_pass(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        """Root forward hook (``always_call``): check the pass closed every region, reset."""
        if self.phase is Phase.IDLE:
            return
        left_open = self.stack[0] if self.stack else None
        failed = sys.exc_info()[0] is not None
        self._unwind(0)
        self._reset()
        if left_open is not None and not failed:
            r = self.regions[left_open.region]
            raise UsageError(
                f"region {r} was still open when the forward ended: its last stage "
                f"{self.names[r.stop - 1]!r} was not called; end the region at a stage "
                "the forward always runs"
            )

    def _reset(self) -> None:
        self.phase = Phase.IDLE
        self.next_stage = 0
        self.current = None
        self.entered = None
        self.gap_due = None
        self.tape.reset()

    def _unwind(self, depth: int) -> None:
        """Abort the frames above ``depth``, innermost first (their hooks are a stack)."""
        while len(self.stack) > depth:
            entry = self.stack.pop()
            if entry.frame is not None:
                entry.frame.abort()
            elif entry.hooks is not None:
                entry.hooks.__exit__(None, None, None)

    # -- stage calls --------------------------------------------------------------------

    def call(self, i: int, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        # What the model passed, if our pre-hook saw this call (Note [Stages with hooks ...])
        entered, self.entered = self.entered, None
        given = (entered[1], entered[2]) if entered is not None and entered[0] == i else None
        if self.observer is not None:
            orig = functools.partial(self._observed, i, orig)
        if self.phase is Phase.REBUILD:
            return self._call_in_rebuild(i, orig, args, kwargs, given)
        if i != self.next_stage:
            raise self._order_error(i)
        self.next_stage = i + 1
        if not self.stack and self.plain[i]:
            return orig(*args, **kwargs)
        return self._call_in_forward(i, orig, args, kwargs, given)

    def _call_in_forward(
        self,
        i: int,
        orig: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        given: tuple[tuple[Any, ...], dict[str, Any]] | None,
    ) -> Any:
        """Run stage ``i`` in forward; ``args``/``kwargs`` are what its code gets, ``given``
        what the model passed, when hooks of the stage stand between (the engine records
        and links by the latter)."""
        model_args, model_kwargs = given if given is not None else (args, kwargs)
        boundary = main_input(model_args, model_kwargs)
        if self.stack and self.stack[-1].kind is Kind.GAP:
            self._unwind(len(self.stack) - 1)
        if not torch.is_grad_enabled():
            if self.stack:
                r = self.regions[self.stack[-1].region]
                raise UsageError(
                    f"stage {self.names[i]!r} ran with grad disabled inside region {r}; "
                    "keep grad mode unchanged within a region"
                )
            return orig(*args, **kwargs)
        if self.stack:
            self._check_link(i, boundary)
        depth = len(self.stack)
        for k in self.opens_at[i]:
            self._open(k, boundary, Kind.OPEN)
        for child in self.stack[max(depth, 1):]:  # a parent rebuild hands it its outer slots
            parent = next(e for e in self.stack if e.region == self.parent[child.region])
            parent.children_at.setdefault(len(parent.calls), []).append(child)
        if not self.stack:  # a selective or offload stage outside regions
            return self._run_recording(i, orig, args, kwargs, CallRecord(i), _Where.TOP)
        template = self.tape.encode((model_args, model_kwargs))
        if self.reads is not None:
            self._note_reads(i, template, by_call=True, main=self.tape.slot_of(boundary))
        record = CallRecord(i, template)
        for entry in self.stack:
            entry.add(record)
        out = self._run_recording(i, orig, args, kwargs, record, _Where.IN_REGION)
        record.outputs = self.tape.outputs(out, i + 1)
        for k in self.closes_at[i]:
            entry = self.stack.pop()
            assert entry.region == k and entry.frame is not None
            entry.frame.close()
        if not self.stack:
            self.tape.reset()
            return out
        if given is not None:  # our forward hook runs after the stage's others: it opens
            self.gap_due = record
        else:
            self._open_gap(i + 1)
        return out

    def _open_gap(self, stages_called: int) -> None:
        """Record the model's code from here to the next stage (Note [Code between ...])."""
        recorder = GlueRecorder(self.tape, stages_called, self._glue_step, self._glue_hazard)
        recorder.__enter__()
        self.stack.append(_Entry(-1, Kind.GAP, None, hooks=recorder))

    def _check_link(self, i: int, boundary: torch.Tensor | None) -> None:
        """Stage ``i``'s input must be made inside its innermost open region (or be its input).

        In the profile's probe pass (``self.breaks`` set) a link whose input was made before
        the previous stage ran is noted as a break instead: a region over it would hold
        that tensor from forward to its rebuild, which the cost model does not count.
        """
        k = self.tape.slot_of(boundary)
        if self.breaks is not None:
            if k is None or self.tape.made_after[k] < i:
                self.breaks[i] = self.breaks[i] or (
                    f"stage {self.names[i]!r} does not get a tensor made after stage "
                    f"{self.names[i - 1]!r} ran as its input"
                )
            return
        inner = self._innermost_region()
        if k is None or (k < inner.first_slot and k != inner.input_slot):
            r = self.regions[inner.region]
            raise UsageError(
                f"stage {self.names[i]!r} does not get a tensor made inside region {r} as its "
                f"input (its first tensor argument), so the region cannot rebuild it from "
                f"{self.names[r.start]!r}'s input; end the region before this stage"
            )

    def _innermost_region(self) -> _Entry:
        return next(e for e in reversed(self.stack) if e.kind is not Kind.GAP)

    def _note_reads(self, i: int, template: Template, *, by_call: bool, main: int | None) -> None:
        assert self.reads is not None
        if by_call:
            self.input_slots[i] = main
        if i < len(self.reads):
            tape = self.tape
            self.reads[i] += [(leaf.k, tape.made_after[leaf.k], tape.nbytes(leaf.k), by_call)
                              for leaf in template.leaves
                              if isinstance(leaf, Slot) and leaf.k != main]
            # tensors from before the chain that get a gradient (a time embedding); not a
            # parameter, whose gradient is a parameter gradient (Note [Gradients pending
            # before the chain] in remat.profiling.links)
            self.reads_before[i] += [
                (id(leaf), leaf.untyped_storage().nbytes()) for leaf in template.leaves
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad
                and not isinstance(leaf, nn.Parameter)
            ]

    def _glue_step(self, step: GlueStep) -> None:
        if self.reads is not None:
            self._note_reads(self.next_stage, step.inputs, by_call=False, main=None)
        for entry in self.stack:
            if entry.kind is not Kind.GAP:
                entry.add(step)

    def _glue_hazard(self, reason: str) -> None:
        i = self.next_stage
        if self.breaks is not None:
            if i < len(self.breaks):
                before = f"the code before stage {self.names[i]!r}"
                self.breaks[i] = self.breaks[i] or f"{before}: {reason}"
            return
        r = self.regions[self._innermost_region().region]
        after = self.names[i - 1] if i > 0 else "the start"
        raise UsageError(
            f"the model's code after stage {after!r} cannot be replayed by region {r}'s rebuild "
            f"({reason}); end the region at {after!r}"
        )

    def _run_recording(
        self,
        i: int,
        orig: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        record: CallRecord,
        where: _Where,
    ) -> Any:
        """Run the stage with its option and note the buffers it changed."""
        buffers = [b for m in self.buffer_owners[i] for b in m._buffers.values() if b is not None]
        versions = [b._version for b in buffers]
        out = self._run(i, orig, args, kwargs, record, where)
        changed = [b for b, v in zip(buffers, versions, strict=True) if b._version != v]
        for norm in self.norms[i]:
            stats = norm._buffers
            if any(b is stats["num_batches_tracked"] for b in changed):
                running = (stats.get("running_mean"), stats.get("running_var"))
                changed += [b for b in running if b is not None]
        record.mutated = tuple(changed)
        return out

    def _call_in_rebuild(
        self,
        i: int,
        orig: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        given: tuple[tuple[Any, ...], dict[str, Any]] | None,
    ) -> Any:
        record = self.current
        if record is None or record.stage != i:
            raise RematError(
                f"stage {self.names[i]!r} was called during a rebuild that did not call it; "
                "a stage must not call another stage"
            )
        top = self.stack[-1]
        if top.kind is Kind.SHADOW:
            out = orig(*args, **kwargs)
        else:  # REPLAYING: open the child starting here, or run as the innermost region
            child = next((k for k in self.opens_at[i] if self.parent[k] == top.region), -1)
            if child >= 0:
                model_args, model_kwargs = given if given is not None else (args, kwargs)
                self._open(child, main_input(model_args, model_kwargs), Kind.SHADOW)
                out = orig(*args, **kwargs)
            else:
                out = self._run(i, orig, args, kwargs, record, _Where.REBUILD)
        top = self.stack[-1]
        if top.kind is Kind.SHADOW and self.regions[top.region].stop == i + 1:
            self.stack.pop()
            assert top.frame is not None
            top.frame.close()
        return out

    def _observed(self, i: int, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``orig(*args, **kwargs)`` announced to the observer (Note [Observing ...])."""
        observer = self.observer
        if observer is None:  # dropped while a selective replay was still pending
            return orig(*args, **kwargs)
        rebuild = self.phase is not Phase.FORWARD
        observer.stage_started(i, rebuild, args, kwargs)
        out = None
        try:
            out = orig(*args, **kwargs)
        finally:
            observer.stage_finished(i, rebuild, out)
        return out

    def _open(self, k: int, boundary: object, kind: Kind) -> None:
        if not isinstance(boundary, torch.Tensor):
            r = self.regions[k]
            raise UsageError(
                f"region {r} starts at stage {self.names[r.start]!r}, whose first positional "
                f"argument is {type(boundary).__name__}, not a tensor; start regions at stages "
                "that take the hidden state as their first positional argument"
            )
        entry = _Entry(k, kind, None, layout=self.layout)
        if kind is Kind.OPEN:
            entry.input_slot = self.tape.give(boundary, self.next_stage - 1)
            entry.first_slot = self.tape.count
        fn = functools.partial(self._rebuild, entry) if kind is Kind.OPEN else _never_rebuilt
        entry.frame = self.frames.open(
            fn, boundary, preserve_rng_state=self.preserve_rng_state,
            context_fn=routing_contexts if self.saves_routing[k] else noop_context_fn,
        )
        self.stack.append(entry)

    @property
    def routing_saved(self) -> frozenset[int]:
        """Stages inside a region that keeps routing decisions (Note [Routing saved in
        regions])."""
        return frozenset(i for k, r in enumerate(self.regions) if self.saves_routing[k]
                         for i in range(r.start, r.stop))

    def _rebuild(self, entry: _Entry, boundary: torch.Tensor) -> None:
        """Replay region ``entry.region``'s calls (torch calls this from backward)."""
        saved = (self.phase, self.next_stage, self.current)
        running = self.layout  # a later pass may run another plan of a plan set
        if entry.layout is not None and entry.layout is not running:
            self._set_layout(entry.layout)
        depth = len(self.stack)
        self.stack.append(_Entry(entry.region, Kind.REPLAYING, None, entry.calls))
        self.phase = Phase.REBUILD
        self.rebuilds += 1
        entry.rebuilt += 1
        if entry.rebuilt == 2 and not self.warned_passes:
            self.warned_passes = True
            warnings.warn(rebuilt_again(self.regions[entry.region], self.names),
                          RuntimeWarning, stacklevel=2)
        env = dict(entry.externals)
        env[entry.input_slot] = boundary
        dead_after = entry.dead_after()
        # the unit whose backward comes next stays gathered (Note [Resharding after a rebuild])
        last = self.regions[entry.region].stop - 1 if self.reshard_after_rebuild else -1
        try:
            for index, step in enumerate(entry.calls):
                for child in entry.children_at.get(index, ()):
                    child.externals = {k: env[k] for k in child.outer}
                if isinstance(step, GlueStep):
                    step.replay(env)
                else:
                    self.current = step
                    name = f"stage {self.names[step.stage]!r}"
                    assert step.inputs is not None
                    args, kwargs = step.inputs.decode(env, name)
                    module = self.modules[step.stage]
                    try:
                        out = call_restoring(step.mutated, module, *args, **kwargs)
                    finally:  # early stop too: FSDP gathered the unit before the stop
                        if last >= 0 and step.stage != last:
                            reshard_units(module)
                    bind(step.outputs, out, env, name)
                    del args, kwargs, out
                for k in dead_after[index]:  # no later step reads it: free it now
                    env.pop(k, None)
        finally:
            self._unwind(depth)
            self.phase, self.next_stage, self.current = saved
            if self.layout is not running:
                self._set_layout(running)

    # -- options ------------------------------------------------------------------------

    def _run(
        self,
        i: int,
        orig: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        record: CallRecord,
        where: _Where,
    ) -> Any:
        """Run stage ``i`` with its option (Note [Options inside regions])."""
        policy = self.policies[i]
        if policy.is_keep:
            return orig(*args, **kwargs)
        if policy.is_offload:
            boundary = main_input(args, kwargs)
            if not wants_offload(boundary):
                device = boundary.device.type if isinstance(boundary, torch.Tensor) else "none"
                self.offload_noop.setdefault(i, device)
                return orig(*args, **kwargs)
            hooks = discard_saved_tensors() if where is _Where.REBUILD else offload_saved_tensors()
            with hooks:
                return orig(*args, **kwargs)
        # selective
        if where is _Where.REBUILD:
            caching, cached = selective_contexts(policy)
            frame = CheckpointFrame.open(
                _never_rebuilt, *args, context_fn=lambda: (caching, contextlib.nullcontext())
            )
            out = _run_in(frame, orig, args, kwargs)
            record.sac_cache = cached
            return out

        def context_fn() -> tuple[Any, Any]:
            if where is _Where.TOP:
                caching, cached = selective_contexts(policy)
                if self.routes[i]:  # Note [Routing saved in regions] in policies.py
                    recording, replaying = routing_contexts()
                    return (_together(caching, recording),
                            _together(_RecomputeContext(record, cached), replaying))
                return caching, _RecomputeContext(record, cached)
            return contextlib.nullcontext(), _RecomputeContext(record)

        replay = functools.partial(_call_with, orig, kwargs)
        # a selective stage outside regions may run in the rebuild-once frame (apply
        # refuses one inside a region with split_backward: that frame does not nest)
        own = self.frames.open(
            replay, *args, context_fn=context_fn, preserve_rng_state=self.preserve_rng_state
        )
        return _run_in(own, orig, args, kwargs)

    def _order_error(self, i: int) -> UsageError:
        name = self.names[i]
        if self.next_stage >= len(self.names):
            where = f"after the last stage {self.names[-1]!r}"
        else:
            where = f"where stage {self.names[self.next_stage]!r} was expected"
        return UsageError(
            f"stage {name!r} was called {where}; the model's loop skips, repeats or reorders "
            "stages, so list the plan's stages in the order the forward calls them, once each"
        )


@contextlib.contextmanager
def _together(first: Any, second: Any) -> Iterator[None]:
    """Two context managers as one, entered in order and left in reverse."""
    with first, second:
        yield


_OPAQUE_REASON = "remat runs its checkpoint regions eagerly; see docs/compile.md"


# Note [Backward in passes]: torch's non-reentrant checkpoint rebuilds a region once per
# backward pass that reaches it (its rebuilt tensors are keyed by the graph task), so a
# backward run as several passes rebuilds it in each. torch.distributed.pipelining's
# zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
# ScheduleDualPipeV) do that: an input-gradient pass (``stage_backward_input``), then one
# weight-gradient ``autograd.grad`` per parameter group (``stage_backward_weight``).
# Measured (torch 2.13, gpt half of two blocks, one region per block): the input pass
# rebuilt part of each block, the weight passes rebuilt the blocks 9 times over, and the
# step's peak was 9.5 MB against 4.7 MB with no region; torch's GraphExecGroup (one
# rebuild per group) refuses the weight passes, which unpack tensors the input pass
# already did (pytorch/pytorch#136766 is the same interaction). The gradients are right,
# so this warns once per model rather than failing a step, and points to
# ``split_backward=True``, which rebuilds once for all the passes (Note [One rebuild for a
# backward in passes] in rebuild_once.py).
def rebuilt_again(region: Any, names: Sequence[str]) -> str:
    """The warning for a region rebuilt a second time for one forward."""
    first, last = names[region.start], names[region.stop - 1]
    return (
        f"remat: region {first if first == last else f'{first}..{last}'} was rebuilt a second "
        "time for one forward because its backward ran in several passes (torch's "
        "zero-bubble pipeline schedules split it into input and weight passes), which costs "
        "more time and memory than the region saves; apply the plan with "
        "split_backward=True, which rebuilds once for all the passes (docs/pipeline.md)"
    )


# Note [Copies of an applied model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# EMA models, teacher copies and some frameworks ``copy.deepcopy`` a model in training. A
# plan applied as closures would be copied as the very same closures (deepcopy takes
# functions as atomic), so the copy's stages would call the original's engine and, through
# it, the original's blocks: the copy's parameters would get no gradient. Everything
# ``apply`` puts on the model is therefore an object that refers to its engine by
# attribute (a stage's forward, the root's pass hooks, the stage hooks), and the engine
# copies itself as a new engine over the copied stages; deepcopy's memo makes every
# object of the copy refer to that one engine. ``remat.runtime.install`` registers the
# copy as applied, so ``remat.remove(copy)`` works. Pickling an applied model (and
# ``torch.save(model)``) is refused instead: a pickle outlives the process whose engine
# it would need.

NOT_PICKLED = ("a model with a remat plan applied cannot be pickled (torch.save(model) "
               "included); call remat.remove(model) first, or save model.state_dict()")


class EngineCallable:
    """Base of what ``apply`` installs on a model: copied with its engine by
    ``copy.deepcopy``, refused by pickle (Note [Copies of an applied model])."""

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineCallable:
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UsageError(NOT_PICKLED)


class StageForward(EngineCallable):
    """A stage module's ``forward`` while a plan is applied: its own when no pass is
    running. A module that is several stages (one per call: Note [Calls of one module as
    stages]) has one, which hands each call to the stage the engine expects."""

    def __init__(self, engine: Engine, indices: tuple[int, ...],
                 origs: tuple[Callable[..., Any], ...]) -> None:
        self.engine = engine
        self.indices = indices
        self.origs = origs
        self.orig = origs[0]
        functools.update_wrapper(self, origs[0])  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine.phase is Phase.IDLE:
            return self.orig(*args, **kwargs)
        if len(self.indices) == 1:
            return engine.opaque_call(self.indices[0], self.orig, args, kwargs)
        i = engine.stage_called(self.indices)
        return engine.opaque_call(i, self.origs[self.indices.index(i)], args, kwargs)


class PassHook(EngineCallable):
    """The root's forward pre-hook (a pass begins) or ``always_call`` forward hook (it
    ends); ``installation``: what ``apply`` registered, set by it."""

    def __init__(self, engine: Engine, *, begin: bool) -> None:
        self.engine = engine
        self.begin = begin
        self.installation: Any = None

    def __call__(self, *args: Any) -> None:
        engine = self.engine
        if self.begin:
            engine.opaque_begin(*args)
        else:
            engine.opaque_end(*args)


class StageHook(EngineCallable):
    """A stage's own first forward pre-hook (``enter``) or last forward hook inside a
    multi-stage region (Note [Stages with hooks of their own])."""

    def __init__(self, engine: Engine, indices: tuple[int, ...], *, enter: bool) -> None:
        self.engine = engine
        self.indices = indices  # the stages that are calls of the module
        self.enter = enter

    def __call__(self, _module: nn.Module, args: tuple[Any, ...], third: Any) -> None:
        engine = self.engine
        if self.enter:  # with_kwargs: third is the kwargs
            engine.opaque_enter(engine.stage_called(self.indices), args, third)
        else:  # third is the output; the call's own stage is the one that opens the gap
            due = engine.gap_due
            i = due.stage if due is not None and due.stage in self.indices else self.indices[0]
            engine.opaque_leave(i, third)


def opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run eagerly and whole where Dynamo meets it (Note [torch.compile sees ...])."""
    wrapped: Callable[..., Any]
    try:  # the reason shows in TORCH_LOGS=graph_breaks
        wrapped = torch.compiler.disable(fn, recursive=True, reason=_OPAQUE_REASON)
    except TypeError:  # torch < 2.7 has no reason
        wrapped = torch.compiler.disable(fn, recursive=True)
    return wrapped


def _run_in(
    frame: CheckpointFrame | RebuildOnceFrame, orig: Callable[..., Any],
    args: tuple[Any, ...], kwargs: Any
) -> Any:
    try:
        out = orig(*args, **kwargs)
    except BaseException:
        frame.abort()
        raise
    frame.close()
    return out


def _call_with(orig: Callable[..., Any], kwargs: dict[str, Any], *args: Any) -> None:
    """Rebuild of a selective stage's own frame (torch calls it from backward)."""
    orig(*args, **kwargs)
