"""The chain a solver works on: per-stage costs and the fixed bytes of one training step.

Torch-free. A :class:`Problem` is what a profile measures (or what a fixture file says);
the meaning of every field is fixed by the simulator (:mod:`remat.core.solve.simulator`) and
written out in ``docs/cost-model.md``. In short, for stage ``i``:

* ``boundary_bytes``: its input ``x_i``; the output of stage ``i`` is ``x_{i+1}``, so
  ``output_bytes`` of every stage but the last must equal the next ``boundary_bytes``.
* ``saved_bytes[option]``: what autograd keeps for the stage's backward when it runs
  with grad under that option, *not counting its input and its output* (those are
  boundaries, tracked once each by the simulator). ``keep`` is required; selective
  options are optional; ``offload`` is the volume moved to the host and back (default:
  the ``keep`` bytes plus the input).
* transients: extra bytes alive at the peak of its forward (with saving, and without
  saving) and of its backward, beyond input, output, saved bytes and gradients.
* ``grad_bytes``: the parameter gradients its backward creates first; they join right
  after its backward's peak (those created before the peak are part of its
  ``bwd_transient_bytes``) and stay alive until the optimizer step. ``saves_input``:
  whether it keeps its input under ``keep``.

Outside the chain, ``grads_bytes`` is the total of all parameter gradients. The parts
with a known creator (``grad_bytes`` of each stage, ``pre_chain_grads_bytes``,
``post_chain_grads_bytes``) must add up to at most that total; the rest
(:attr:`Problem.unattributed_grads_bytes`) is charged from the first backward event on,
an upper bound. A problem file of schema version 1 has no such parts: all of its
gradients are unattributed, which is exactly how version 1 counted them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

import remat.core.fields as fields
from remat.core.artifact import JsonArtifact
from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, OFFLOAD, Option
from remat.core.stage_record import StageRecord

__all__ = ["SCHEMA_VERSION", "Problem", "StageCost"]

SCHEMA_VERSION = 2
#: Versions this remat reads: 1 lacks the gradient parts, ``saves_input`` and the
#: optimizer step's temporaries, whose defaults reproduce how version 1 counted.
READABLE_VERSIONS = (1, 2)
def _bytes(value: object, what: str) -> int:
    return fields.byte_count(value, what, sizes=True)


@dataclass(frozen=True)
class StageCost(StageRecord):
    """What one stage costs in memory and time: the :class:`StageRecord` fields in the
    simulator's conventions, and the figures it derives (see the module docstring)."""

    takes_sizes: ClassVar[bool] = True

    # A selective option's backward transient where it differs from keep's
    # (``bwd_transient_bytes``): its replay may make more than keep's backward holds (a
    # block ending in a ReLU makes its output again). Same convention: beyond keep's saved
    # bytes, which the backward of a selective stage holds too.
    bwd_transient_by_option: Mapping[str, int] = field(default_factory=dict, hash=False)
    # A selective option's forward transient where it differs from keep's
    # (``fwd_transient_bytes``), beyond its own saved bytes: its checkpoint frame saves
    # nothing as the forward goes, so that forward peaks as one that saves nothing does.
    fwd_transient_by_option: Mapping[str, int] = field(default_factory=dict, hash=False)
    # The last stage (by index) whose forward still finds this stage's input referenced by
    # the model's own code beyond what the chain holds (a skip list, a caller's frame);
    # n or more: through the chain's end. None: nothing. Only the top-level forward: the
    # simulator holds the input there exactly, the DP charges it (Problem.held_in_forward).
    # On the last stage, its own index or more: its input is still referenced when it
    # returns (the caller's frame), held through the post-chain's forward
    # (Problem.last_input_held_bytes).
    held_through: int | None = None
    # This stage's output where it is a tensor apart from the next stage's input (the
    # model's code made that one from it: a concatenation, an upsampling) and the model's
    # code still references it (a caller's frame): held from the next stage's top-level
    # forward through this one's (n - 1 or more: through the chain's end), of these bytes.
    output_held_through: int | None = None
    output_held_bytes: int = 0
    # FSDP2 (a per-rank problem, remat.core.transforms): the bytes of this stage's unit when
    # gathered (its unsharded parameters; the all-gather's flat output is as large), and
    # of its gradients' reduce-scatter input; 0: the stage is not a unit of its own. The
    # simulator keeps them as FSDP2 does (Note [FSDP2 units] in simulator.py).
    unit_bytes: int = 0
    reduce_bytes: int = 0
    # FSDP2: seconds of one all-gather of this stage's unit, which a plan that reshards
    # units after their rebuild pays again (Note [Resharding after a rebuild] in simulator.py).
    gather_s: float = 0.0
    # What a region holding both this stage and the next costs for the link between them,
    # beyond the stages' rebuilds: the model's code between them replayed (and recorded in
    # forward), this stage's forward past where its own rebuild would stop. A region over
    # stages a .. b-1 costs region_overhead_s plus the link_s of stages a .. b-2
    # (Note [Links inside a region] in remat/profiling/optimes.py); the last stage's is 0.
    link_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        where = self.where
        object.__setattr__(self, "link_s", fields.seconds(self.link_s, f"{where} link_s"))
        object.__setattr__(self, "gather_s", fields.seconds(self.gather_s, f"{where} gather_s"))
        for name in ("unit_bytes", "reduce_bytes", "output_held_bytes"):
            object.__setattr__(self, name, self.nbytes(getattr(self, name), name))
        for option in self.extra_bwd_s:
            if not Option(option).is_offload and option not in self.saved_bytes:
                raise UsageError(
                    f"{where} has extra_bwd_s for {option!r} but no saved_bytes for it; "
                    "add saved_bytes for that option or drop the entry"
                )
        for name in ("bwd_transient_by_option", "fwd_transient_by_option"):
            self._check_by_option(name)
        for name in ("held_through", "output_held_through"):
            fields.stage_index(getattr(self, name), f"{where} {name}")
        if any(self.link_saved_bytes > nbytes for nbytes in self.saved_bytes.values()):
            raise UsageError(f"{where} link_saved_bytes={self.link_saved_bytes} is more than "
                             "one of its saved_bytes, which include it; give at most the "
                             "smallest")

    def _check_by_option(self, name: str) -> None:
        """Field ``name`` maps measured selective options to bytes."""
        where = self.where
        if not isinstance(getattr(self, name), Mapping):
            raise UsageError(f"{where} {name} must map options to bytes")
        by_option: dict[str, int] = {}
        for text, nbytes in getattr(self, name).items():
            option = self.option(text, name)
            if not (option.is_selective and option in self.saved_bytes):
                raise UsageError(
                    f"{where} has {name} for {option!r}, which is not one of its measured "
                    "selective options; drop the entry"
                )
            by_option[option] = self.nbytes(nbytes, f"{name}[{option!r}]")
        object.__setattr__(self, name, MappingProxyType(by_option))

    def bwd_transient(self, option: str) -> int:
        """The backward transient under ``option`` (keep's unless measured apart)."""
        return self.bwd_transient_by_option.get(option, self.bwd_transient_bytes)

    def fwd_transient(self, option: str) -> int:
        """The transient of a forward with grad under ``option``, beyond its saved bytes
        (keep's unless measured apart)."""
        return self.fwd_transient_by_option.get(option, self.fwd_transient_bytes)

    def full_rebuild_option(self, option: str) -> str:
        """The option whose measured backward is this stage's under ``option`` when its
        region's rebuild stopped before it (a selective stage rebuilt in full at its
        backward, Note [What a rebuild starts with] in the simulator): save-nothing's where
        measured, else ``option``'s own."""
        nothing = Option.selective("save-nothing")
        if Option(option).is_selective and nothing in self.saved_bytes:
            return nothing
        return option

    @property
    def selective_options(self) -> tuple[Option, ...]:
        """The selective options measured for this stage, in the order given."""
        return tuple(o for o in map(Option, self.saved_bytes) if o.is_selective)

    def keeps_input(self, option: str) -> bool:
        """Whether the stage holds its input from its forward to its backward under ``option``."""
        parsed = Option(option)
        if parsed.is_offload:
            return False  # its saved tensors, input included, went to the host
        if parsed in self.input_kept_by_option:
            return self.input_kept_by_option[parsed]
        return self.saves_input or not parsed.is_keep

    @property
    def offload_bytes(self) -> int:
        """Bytes moved to the host in forward and back in backward when offloaded."""
        if OFFLOAD in self.saved_bytes:
            return self.saved_bytes[OFFLOAD]
        return self.saved_bytes[KEEP] + self.boundary_bytes

    @property
    def nosave_peak_extra_bytes(self) -> int:
        """Extra bytes at the peak of a forward that saves nothing (beyond input, output)."""
        if self.nosave_transient_bytes is not None:
            return self.nosave_transient_bytes
        return self.saved_bytes[KEEP] + self.fwd_transient_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "boundary_bytes": self.boundary_bytes,
            "output_bytes": self.output_bytes,
            "saved_bytes": dict(self.saved_bytes),
            "fwd_s": self.fwd_s,
            "bwd_s": self.bwd_s,
            "rebuild_s": self.rebuild_s,
            "extra_bwd_s": dict(self.extra_bwd_s),
            "fwd_transient_bytes": self.fwd_transient_bytes,
            "bwd_transient_bytes": self.bwd_transient_bytes,
            "nosave_transient_bytes": self.nosave_transient_bytes,
            "grad_bytes": self.grad_bytes,
            "saves_input": self.saves_input,
            **({"break_before": self.break_before} if self.break_before is not None else {}),
            **({"bwd_transient_by_option": dict(self.bwd_transient_by_option)}
               if self.bwd_transient_by_option else {}),
            **({"fwd_transient_by_option": dict(self.fwd_transient_by_option)}
               if self.fwd_transient_by_option else {}),
            **({"input_kept_by_option": dict(self.input_kept_by_option)}
               if self.input_kept_by_option else {}),
            **({"reads": [r.to_dict() for r in self.reads]} if self.reads else {}),
            **({"pending_grad_bytes": self.pending_grad_bytes} if self.pending_grad_bytes
               else {}),
            **({"rebuild_grad_bytes": self.rebuild_grad_bytes} if self.rebuild_grad_bytes
               else {}),
            **({"cast_cache_bytes": self.cast_cache_bytes,
                "cast_unsaved_bytes": self.cast_unsaved_bytes} if self.cast_cache_bytes
               else {}),
            **({"call_args": [a.to_dict() for a in self.call_args]} if self.call_args
               else {}),
            **({"held_through": self.held_through} if self.held_through is not None else {}),
            **({"output_held_through": self.output_held_through,
                "output_held_bytes": self.output_held_bytes}
               if self.output_held_through is not None else {}),
            **({"link_saved_bytes": self.link_saved_bytes} if self.link_saved_bytes else {}),
            **({"link_backward_bytes": self.link_backward_bytes} if self.link_backward_bytes
               else {}),
            **({"unit_bytes": self.unit_bytes} if self.unit_bytes else {}),
            **({"reduce_bytes": self.reduce_bytes} if self.reduce_bytes else {}),
            **({"link_s": self.link_s} if self.link_s else {}),
            **({"gather_s": self.gather_s} if self.gather_s else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int = 0, version: int = SCHEMA_VERSION
                  ) -> StageCost:
        if not isinstance(data, Mapping):
            raise UsageError(f"stage {index} must be a JSON object, got {type(data).__name__}")
        where = f"stage {data.get('name', index)!r}"
        known = _STAGE_KEYS if version >= 2 else _STAGE_KEYS_V1
        fields.check_keys(data, _STAGE_REQUIRED, known, where)
        return cls(**{key: data[key] for key in known if key in data})


_STAGE_REQUIRED = ("name", "boundary_bytes", "output_bytes", "saved_bytes")
_STAGE_KEYS_V1 = (
    *_STAGE_REQUIRED,
    "fwd_s",
    "bwd_s",
    "rebuild_s",
    "extra_bwd_s",
    "fwd_transient_bytes",
    "bwd_transient_bytes",
    "nosave_transient_bytes",
)
_STAGE_KEYS = (
    *_STAGE_KEYS_V1, "grad_bytes", "saves_input", "break_before", "bwd_transient_by_option",
    "reads", "pending_grad_bytes", "held_through", "output_held_through", "output_held_bytes",
    "link_saved_bytes", "unit_bytes", "reduce_bytes", "input_kept_by_option", "link_s",
    "gather_s", "rebuild_grad_bytes", "cast_cache_bytes", "cast_unsaved_bytes", "call_args",
    "link_backward_bytes", "fwd_transient_by_option",
)
_FIXED_BYTES_V1 = (
    "params_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "pre_chain_bytes",
    "post_chain_bytes",
    "inputs_bytes",
    "region_overhead_bytes",
)
_FIXED_BYTES = (
    *_FIXED_BYTES_V1,
    "pre_chain_grads_bytes",
    "post_chain_grads_bytes",
    "optimizer_step_bytes",
)
_PROBLEM_KEYS_V1 = (
    "schema_version",
    "description",
    "stages",
    *_FIXED_BYTES_V1,
    "region_overhead_s",
    "outside_chain_s",
    "offload_bandwidth_bytes_per_s",
    "measured_no_checkpoint_peak_bytes",
    "early_stop",
    "slots",
)
#: Old keys of problem files (remat up to 7be8d88) and the profile's names that replaced
#: them: read as the new ones, never written. ``Problem(...)`` takes the new names only.
_OLD_KEYS = MappingProxyType({"optimizer_bytes": "optimizer_state_bytes",
                              "input_bytes": "inputs_bytes"})
_PROBLEM_KEYS = (*_PROBLEM_KEYS_V1, *_FIXED_BYTES[len(_FIXED_BYTES_V1):],
                 "post_chain_backward_bytes", "root_unit_bytes", "collective_copies",
                 "backward_residue_bytes", "pre_chain_cast_bytes", "args_at_return_bytes",
                 "pre_chain_at_return_bytes")


@dataclass(frozen=True)
class Problem(JsonArtifact):
    """A chain of stages plus everything else one training step keeps on the device.

    ``early_stop``: the runtime lets torch end a region's rebuild as soon as it has what
    backward needs (torch's default). ``slots``: how finely the optimal solver divides the
    memory left for the chain.
    """

    artifact: ClassVar[str] = "problem"

    stages: tuple[StageCost, ...]
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0
    pre_chain_bytes: int = 0
    post_chain_bytes: int = 0
    inputs_bytes: int = 0
    region_overhead_bytes: int = 0
    region_overhead_s: float = 0.0
    outside_chain_s: float = 0.0
    offload_bandwidth_bytes_per_s: float | None = None
    measured_no_checkpoint_peak_bytes: int | None = None
    early_stop: bool = True
    slots: int = 500
    description: str = ""
    # Parameter gradients the pre- and post-chain's backward create first (the stages'
    # own are StageCost.grad_bytes), and the optimizer step's temporaries beyond
    # parameters, gradients and optimizer state.
    pre_chain_grads_bytes: int = 0
    post_chain_grads_bytes: int = 0
    optimizer_step_bytes: int = 0
    # The post-chain's backward peak beyond the chain's end once the model's code has let
    # go of what it held there (its forward has returned); post_chain_bytes is then the
    # forward's alone. None: post_chain_bytes is both, with those holds alive.
    post_chain_backward_bytes: int | None = None
    # What the caller holds through the chain's backward beyond the chain (the loss and
    # its gradient, with what autograd keeps with them): alive from right after the
    # post-chain's backward event (whose figure, measured from the chain's end, has it
    # already) to the pre-chain's backward; never in forward (docs/cost-model.md,
    # assumption 14).
    backward_residue_bytes: int = 0
    # FSDP2: the root unit's gathered bytes (everything outside the stages' units), and
    # whether the backend copies a collective's buffer (gloo: an all-gather's output, a
    # reduce-scatter's input). Note [FSDP2 units] in simulator.py.
    root_unit_bytes: int = 0
    collective_copies: bool = False
    # Of pre_chain_bytes, the casts autocast's cache keeps for the pre-chain that autograd
    # does not save (an input projection's weight, when the batch needs no gradient): gone
    # at the forward's end (Note [Autocast's cast cache] in simulator.py).
    pre_chain_cast_bytes: int = 0
    # Of pre_chain_bytes, what the stages' calls are passed from before the chain that the
    # model lets go of at its forward's return unless a checkpoint frame holds it (Note
    # [Arguments a checkpoint frame holds] in simulator.py).
    args_at_return_bytes: int = 0
    # Of pre_chain_bytes, what the model's code alone held and lets go of at its forward's
    # return, whatever the plan: gone from the post-chain's backward on (Note [What the
    # forward lets go of at its return] in simulator.py).
    pre_chain_at_return_bytes: int = 0

    def __post_init__(self) -> None:
        stages = self._check_stages()
        self._check_fixed_bytes(stages)
        self._check_grads_total(stages)
        self._check_times()
        self._check_step_fields()
        self._check_pre_chain_parts()
        self._check_flags()

    def _set_bytes(self, name: str) -> None:
        """Field ``name`` as a byte count (sizes given as text are parsed)."""
        object.__setattr__(self, name, _bytes(getattr(self, name), name))

    def _check_stages(self) -> tuple[StageCost, ...]:
        """The stages as a tuple of distinct StageCosts, each output the next one's input."""
        stages = tuple(self.stages)
        if not stages:
            raise UsageError("the problem has no stages; give at least one stage")
        for i, stage in enumerate(stages):
            if not isinstance(stage, StageCost):
                raise UsageError(f"stage {i} is {type(stage).__name__}, not a StageCost")
        object.__setattr__(self, "stages", stages)
        names = [s.name for s in stages]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise UsageError(f"stage {name!r} is listed twice; each stage must be distinct")
        if stages[-1].link_s:
            raise UsageError(f"the last stage {stages[-1].name!r} has link_s="
                             f"{stages[-1].link_s}, but no stage follows it; give 0")
        for a, b in itertools.pairwise(stages):
            if a.output_bytes != b.boundary_bytes:
                raise UsageError(
                    f"stage {a.name!r} has output_bytes={a.output_bytes} but the next stage "
                    f"{b.name!r} has boundary_bytes={b.boundary_bytes}; one stage's output is "
                    "the next one's input, so give them the same size"
                )
        return stages

    def _check_fixed_bytes(self, stages: tuple[StageCost, ...]) -> None:
        """The fixed byte counts; ``pre_chain_bytes`` may go below zero by the first input."""
        for name in _FIXED_BYTES:
            if name != "pre_chain_bytes":
                self._set_bytes(name)
        # below zero by at most x_0: the first input was alive at the step's start (Note
        # [The first input at the start] in from_profile.py)
        pre, first = self.pre_chain_bytes, stages[0].boundary_bytes
        if isinstance(pre, int) and not isinstance(pre, bool) and pre < 0:
            if pre < -first:
                raise UsageError(
                    f"pre_chain_bytes={pre} is below minus the first stage's boundary_bytes "
                    f"({first}); it goes below zero only by the bytes of the first input "
                    "alive at the step's start, at most that boundary")
        else:
            pre = _bytes(pre, "pre_chain_bytes")
        object.__setattr__(self, "pre_chain_bytes", pre)
        if self.post_chain_backward_bytes is not None:
            self._set_bytes("post_chain_backward_bytes")

    def _check_grads_total(self, stages: tuple[StageCost, ...]) -> None:
        parts = (sum(s.grad_bytes for s in stages) + self.pre_chain_grads_bytes
                 + self.post_chain_grads_bytes)
        if parts > self.grads_bytes:
            raise UsageError(
                f"the stages' grad_bytes plus pre_chain_grads_bytes and post_chain_grads_bytes "
                f"add up to {parts} bytes, more than grads_bytes={self.grads_bytes}, the total "
                "of all parameter gradients; give grads_bytes of at least their sum"
            )

    def _check_times(self) -> None:
        for name in ("region_overhead_s", "outside_chain_s"):
            object.__setattr__(self, name, fields.seconds(getattr(self, name), name))
        bandwidth = self.offload_bandwidth_bytes_per_s
        if bandwidth is not None:
            if fields.seconds(bandwidth, "offload_bandwidth_bytes_per_s") <= 0:
                raise UsageError(
                    "offload_bandwidth_bytes_per_s must be above zero, or null when the "
                    "device has no host link"
                )
            object.__setattr__(self, "offload_bandwidth_bytes_per_s", float(bandwidth))

    def _check_step_fields(self) -> None:
        """The measured peak, ``early_stop``, and the byte counts of FSDP's root unit, the
        backward's residue and the pre-chain's parts let go of at the forward's end."""
        if self.measured_no_checkpoint_peak_bytes is not None:
            self._set_bytes("measured_no_checkpoint_peak_bytes")
        if not isinstance(self.early_stop, bool):
            raise UsageError(f"early_stop={self.early_stop!r} must be true or false")
        for name in ("root_unit_bytes", "backward_residue_bytes", "pre_chain_cast_bytes",
                     "args_at_return_bytes", "pre_chain_at_return_bytes"):
            self._set_bytes(name)

    def _check_pre_chain_parts(self) -> None:
        """What goes at the forward's return is a part of ``pre_chain_bytes``."""
        if self.pre_chain_at_return_bytes and self.post_chain_backward_bytes is None:
            raise UsageError(f"pre_chain_at_return_bytes={self.pre_chain_at_return_bytes} needs "
                             "post_chain_backward_bytes, measured after the forward returned; "
                             "give both or neither")
        if (self.pre_chain_cast_bytes + self.args_at_return_bytes + self.pre_chain_at_return_bytes
                > max(0, self.pre_chain_bytes)):
            raise UsageError(f"pre_chain_cast_bytes={self.pre_chain_cast_bytes}, "
                             f"args_at_return_bytes={self.args_at_return_bytes} and "
                             f"pre_chain_at_return_bytes={self.pre_chain_at_return_bytes} are "
                             f"more than pre_chain_bytes={self.pre_chain_bytes}; they are "
                             "parts of them")

    def _check_flags(self) -> None:
        if not isinstance(self.collective_copies, bool):
            raise UsageError(f"collective_copies={self.collective_copies!r} must be true or false")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise UsageError(f"slots={self.slots!r} must be a whole number of at least 1")
        if not isinstance(self.description, str):
            raise UsageError(f"description={self.description!r} must be a string")

    # -- views ------------------------------------------------------------------------------

    @functools.cached_property
    def link_prefix(self) -> tuple[float, ...]:
        """``link_prefix[i]``: the ``link_s`` of stages ``0 .. i-1`` summed, left to right
        (every solver and the simulator price the links inside a region from it, so their
        sums are the same floats)."""
        return tuple(itertools.accumulate((s.link_s for s in self.stages), initial=0.0))

    @functools.cached_property
    def without_grads(self) -> Problem:
        """The same chain with no parameter gradient anywhere (a pipeline rank's later
        backward, whose gradients exist already: Note [Pipeline rank peak] in
        remat.core.pipeline). Kept: a rank's search prices every plan against it, and
        building it cost more than the simulation it is for."""
        stages = tuple(replace(s, grad_bytes=0, pending_grad_bytes=0) for s in self.stages)
        return replace(self, stages=stages, grads_bytes=0, pre_chain_grads_bytes=0,
                       post_chain_grads_bytes=0)

    def region_s(self, start: int, stop: int) -> float:
        """What region ``[start, stop)`` costs beyond its stages' rebuilds: the region's own
        cost and the links inside it (``StageCost.link_s`` of stages ``start .. stop-2``)."""
        prefix = self.link_prefix
        return self.region_overhead_s + (prefix[stop - 1] - prefix[start])

    @property
    def n(self) -> int:
        return len(self.stages)

    @property
    def optimizer_bytes(self) -> int:
        """The old name of :attr:`optimizer_state_bytes` (read-only)."""
        return self.optimizer_state_bytes

    @property
    def input_bytes(self) -> int:
        """The old name of :attr:`inputs_bytes` (read-only)."""
        return self.inputs_bytes

    @property
    def post_chain_peak_bytes(self) -> int:
        """The larger of the post-chain's two figures (an upper bound of both its events
        for the solvers, which hold what the model's code held at the chain's end)."""
        forward = self.post_chain_bytes + self.last_input_held_bytes
        if self.post_chain_backward_bytes is None:
            return forward  # one figure for both events
        # the forward's event over the backward base: what the forward lets go of at its
        # return is still alive and no unattributed gradient is yet (Note [What the forward
        # lets go of at its return] in simulator.py)
        return max(forward + self.pre_chain_at_return_bytes - self.unattributed_grads_bytes,
                   self.post_chain_backward_bytes)

    @property
    def last_input_held_bytes(self) -> int:
        """The last stage's input where the model's code holds it at the chain's end (its
        ``held_through`` at least its own index): the simulator keeps it through the
        post-chain's forward, once with its other holders; the solvers charge it there
        (an upper bound where the plan holds it already). Note [The last stage's input at
        the chain's end] in ``remat.core.solve.simulator``."""
        last = self.stages[-1] if self.stages else None
        if last is None or last.held_through is None or last.held_through < self.n - 1:
            return 0
        return last.boundary_bytes

    @property
    def held_in_forward(self) -> tuple[int, ...]:
        """Per stage, what the model's code holds during its top-level forward
        (``held_through``, ``output_held_through``), summed: the DP's charge, an upper bound
        of the simulator's exact holding (it also lands where the plan holds a boundary
        already)."""
        change = [0] * (self.n + 1)  # each hold's start and end, summed in one pass
        for first, last, nbytes in self.model_holds():
            change[first] += nbytes
            change[last + 1] -= nbytes
        return tuple(itertools.accumulate(change[:-1]))

    @property
    def held_at_chain_end(self) -> int:
        """What the model's code still holds when the chain's forward ends, summed as in
        ``held_in_forward``: the simulator keeps it through the post-chain's events, whose
        figures are measured from the chain's end with it alive."""
        return sum(nbytes for _, last, nbytes in self.model_holds() if last == self.n - 1)

    def model_holds(self) -> list[tuple[int, int, int]]:
        """(first, last, bytes): what the model's code holds beyond the chain from stage
        ``first``'s top-level forward through stage ``last``'s (``last`` at most n - 1:
        held at the chain's end). Boundary ``x_b`` from stage ``b + 1`` (skipped where every
        plan holds it anyway: stage ``b`` keeps its input under every option and no region
        can contain it without starting at it, ``b`` being 0 or a break); an output apart
        from the next input from stage ``b + 1`` as well."""
        n = self.n
        out = []
        for b, s in enumerate(self.stages[: n - 1]):
            if s.held_through is not None and s.held_through > b:
                always = all(s.keeps_input(o) for o in self.options(b)) and (
                    b == 0 or s.break_before is not None)
                if not always:
                    out.append((b + 1, min(s.held_through, n - 1), s.boundary_bytes))
            if s.output_held_through is not None and s.output_held_through > b:
                out.append((b + 1, min(s.output_held_through, n - 1), s.output_held_bytes))
        return out

    @property
    def breaks(self) -> tuple[int, ...]:
        """The stages no region may enter from the previous one (``break_before`` set)."""
        return tuple(i for i, s in enumerate(self.stages) if s.break_before is not None)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    @property
    def output_bytes(self) -> int:
        """The chain's output ``x_n`` (what the post-chain receives)."""
        return self.stages[-1].output_bytes

    @property
    def forward_base_bytes(self) -> int:
        """Bytes alive through the whole forward whatever the plan (no gradients yet)."""
        return (self.params_bytes + self.optimizer_state_bytes + self.inputs_bytes
                + self.pre_chain_bytes)

    @property
    def unattributed_grads_bytes(self) -> int:
        """Parameter gradients no stage, pre- or post-chain claims: charged from the first
        backward event on (an upper bound; all of them in a version-1 problem)."""
        return (self.grads_bytes - sum(s.grad_bytes for s in self.stages)
                - self.pre_chain_grads_bytes - self.post_chain_grads_bytes)

    @property
    def backward_base_bytes(self) -> int:
        """Bytes alive from the first backward event to the optimizer step whatever the plan.

        The forward's base plus the unattributed gradients, less what the model's forward
        let go of at its return (``pre_chain_at_return_bytes``); the post-chain's, the
        stages' and the pre-chain's gradients come later (Note [Gradients by position] in
        :mod:`remat.core.solve.dp`).
        """
        return (self.forward_base_bytes + self.unattributed_grads_bytes
                - self.pre_chain_at_return_bytes)

    @property
    def gone_by_optimizer_step_bytes(self) -> int:
        """Of the backward base and what rides with it, what is gone by the optimizer step:
        the pre-chain's bytes left after the forward's return, and the loss's residue."""
        return (self.pre_chain_bytes - self.pre_chain_at_return_bytes
                + self.backward_residue_bytes)

    def options(self, i: int) -> tuple[Option, ...]:
        """The options stage ``i`` may take: keep, its measured selective ones, offload."""
        stage = self.stages[i]
        found = (KEEP, *stage.selective_options)
        return (*found, OFFLOAD) if self.offload_bandwidth_bytes_per_s is not None else found

    def check_option(self, i: int, option: str) -> None:
        """Raise UsageError if stage ``i`` cannot take ``option`` in this problem."""
        parsed = Option(option)
        if parsed.is_keep:  # every stage can keep; the common case, on long chains too
            return
        stage = self.stages[i]
        if option in self.options(i):
            return
        if parsed.is_offload:
            raise UsageError(
                f"stage {stage.name!r} is set to offload but the problem has no host link "
                "(offload_bandwidth_bytes_per_s is null); use keep or a selective option"
            )
        raise UsageError(
            f"stage {stage.name!r} has no measured saved bytes for option {option!r}; "
            f"profile it with that option or use one of {', '.join(self.options(i))}"
        )

    # -- building and serializing -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        if self.description:
            data["description"] = self.description
        data["stages"] = [s.to_dict() for s in self.stages]
        for name in (*_FIXED_BYTES_V1, "region_overhead_s", "outside_chain_s",
                     "offload_bandwidth_bytes_per_s", "measured_no_checkpoint_peak_bytes",
                     "early_stop", "slots", *_FIXED_BYTES[len(_FIXED_BYTES_V1):]):
            data[name] = getattr(self, name)
        if self.post_chain_backward_bytes is not None:
            data["post_chain_backward_bytes"] = self.post_chain_backward_bytes
        if self.backward_residue_bytes:
            data["backward_residue_bytes"] = self.backward_residue_bytes
        if self.pre_chain_cast_bytes:
            data["pre_chain_cast_bytes"] = self.pre_chain_cast_bytes
        if self.args_at_return_bytes:
            data["args_at_return_bytes"] = self.args_at_return_bytes
        if self.pre_chain_at_return_bytes:
            data["pre_chain_at_return_bytes"] = self.pre_chain_at_return_bytes
        if self.root_unit_bytes:
            data["root_unit_bytes"] = self.root_unit_bytes
        if self.collective_copies:
            data["collective_copies"] = True
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        """Build from ``to_dict()`` output; byte fields also accept sizes such as ``"32MiB"``."""
        if not isinstance(data, Mapping):
            raise UsageError(f"a problem must be a JSON object, got {type(data).__name__}")
        version = fields.schema_version(data, READABLE_VERSIONS, "problem",
                                        "regenerate the problem with this version of remat",
                                        default=SCHEMA_VERSION)
        data = _renamed(data)
        known = _PROBLEM_KEYS if version >= 2 else _PROBLEM_KEYS_V1
        fields.check_keys(data, ("stages",), known, f"the problem (schema version {version})")
        if not isinstance(data["stages"], list):
            raise UsageError(f"problem key 'stages' must be a list, got {data['stages']!r}")
        stages = tuple(StageCost.from_dict(s, i, version) for i, s in enumerate(data["stages"]))
        rest = {k: v for k, v in data.items() if k not in ("schema_version", "stages")}
        return cls(stages=stages, **rest)


def _renamed(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` with the old keys (:data:`_OLD_KEYS`) under their new names."""
    if not any(old in data for old in _OLD_KEYS):
        return data
    out = dict(data)
    for old, new in _OLD_KEYS.items():
        if old in out:
            if new in out:
                raise UsageError(f"the problem has both {old!r} and {new!r}, the old and the "
                                 f"new name of one field; keep only {new!r}")
            out[new] = out.pop(old)
    return out
