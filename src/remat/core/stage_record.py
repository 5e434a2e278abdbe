"""What one stage costs, declared once for the profile and the problem (torch-free).

A profiled stage (:class:`~remat.core.profile_format.StageProfile`) and a problem's stage
(:class:`~remat.core.solve.problem.StageCost`) share the fields below, with the same
meaning and the same checks: both are a :class:`StageRecord`. Each adds only what is its
own (the profile its measurement records: identity, spreads, pooling; the problem the
figures the simulator derives: holds outside the chain, FSDP2 units).
:func:`remat.core.solve.from_profile.problem_from_profile` is the one function that makes
the second from the first. ``docs/cost-model.md`` says what each field counts.

Two names appear in both subclasses with meanings of their own, each declared where it
belongs: ``output_held_through`` (the profile's measured reference, the problem's hold
derived from it by ``held_outside``) and the problem's ``held_through`` (from the
profile's ``input_held_through``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

import remat.core.fields as check
from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, Option

__all__ = ["CallArg", "HeldRead", "StageRecord", "call_args_from", "reads_from", "shared_fields"]


@dataclass(frozen=True)
class HeldRead:
    """A tensor made before a stage that the stage's call, or the model's code just
    before it, reads (a skip connection, a position bias passed on): a region holding
    that stage but opening after the tensor was made keeps it from its forward to its
    backward (docs/cost-model.md, "Tensors a region reads from before it").

    ``tensor`` names the tensor (its reads share it); ``made_after``: the stages called
    before it was made, so ``x_q`` (the boundary stage ``q`` receives) has ``made_after``
    ``q``; ``boundary``: it is that boundary; ``by_call``: the stage's call reads it (else
    the code before the stage); ``saved``: that code saves the boundary for backward
    (``x * sigmoid(block(x))`` saves the block's input ``x``), so it stays alive wherever
    that code runs with grad, to the stage's backward (docs/cost-model.md).
    """

    tensor: int
    made_after: int
    nbytes: int
    boundary: bool = False
    by_call: bool = False
    saved: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor", "made_after", "nbytes"):
            object.__setattr__(self, name,
                               check.byte_count(getattr(self, name), f"profile read {name}"))
        for name in ("boundary", "by_call", "saved"):
            check.flag(getattr(self, name), f"profile read {name}")
        if self.saved and not (self.boundary and not self.by_call):
            raise UsageError("a profile read marked saved must be a boundary read by the "
                             "code before the stage; regenerate it with remat profile")

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "made_after": self.made_after, "bytes": self.nbytes,
                "boundary": self.boundary, "by": "call" if self.by_call else "code",
                **({"saved": True} if self.saved else {})}

    @classmethod
    def from_dict(cls, data: Any) -> HeldRead:
        keys = ("tensor", "made_after", "bytes", "boundary", "by")
        check.check_keys(data, keys, (*keys, "saved"), "a stage read",
                         missing_hint="regenerate it with remat profile")
        if data["by"] not in ("call", "code"):
            raise UsageError(f"profile read by={data['by']!r} must be 'call' or 'code'")
        return cls(data["tensor"], data["made_after"], data["bytes"], data["boundary"],
                   data["by"] == "call", data.get("saved", False))


def reads_from(value: Any, where: str) -> tuple[HeldRead, ...]:
    """``value`` as a tuple of reads: HeldRead objects or their JSON dicts."""
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"{where} reads must be a list of reads, got {type(value).__name__}")
    return tuple(r if isinstance(r, HeldRead) else HeldRead.from_dict(r) for r in value)


@dataclass(frozen=True)
class CallArg:
    """A tensor the stage's call is passed from before the chain besides its input (a 4-D
    attention mask, position ids) that no stage saves and that the model lets go of when
    its forward returns: a checkpoint frame over the stage holds it to its backward
    (Note [Arguments a checkpoint frame holds] in ``remat.core.solve.simulator``).

    ``tensor`` names it among the stages' arguments (stages passed one tensor share it);
    the total of the distinct ones is ``args_at_return_bytes``.
    """

    tensor: int
    nbytes: int

    def __post_init__(self) -> None:
        for name in ("tensor", "nbytes"):
            object.__setattr__(self, name,
                               check.byte_count(getattr(self, name), f"profile call arg {name}"))

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "bytes": self.nbytes}

    @classmethod
    def from_dict(cls, data: Any) -> CallArg:
        keys = ("tensor", "bytes")
        check.check_keys(data, keys, keys, "a stage call argument",
                         missing_hint="regenerate it with remat profile")
        return cls(data["tensor"], data["bytes"])


def call_args_from(value: Any, where: str) -> tuple[CallArg, ...]:
    """``value`` as a tuple of call arguments: CallArg objects or their JSON dicts."""
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"{where} call_args must be a list of arguments, got "
                         f"{type(value).__name__}")
    return tuple(a if isinstance(a, CallArg) else CallArg.from_dict(a) for a in value)


@dataclass(frozen=True)
class StageRecord:
    """The fields every stage record has; checked on construction.

    Bytes and seconds are in the simulator's conventions (docs/cost-model.md): saved
    bytes exclude the stage's input and output, transients are beyond what the simulator
    counts at that event.
    """

    #: how the record's errors name it ("profile stage 'h.0'" or "stage 'h.0'")
    record: ClassVar[str] = "stage"
    #: whether byte fields also take sizes such as "32MiB" (hand-written problem files)
    takes_sizes: ClassVar[bool] = False

    name: str
    boundary_bytes: int  # the stage's input
    output_bytes: int
    # option -> what autograd keeps for backward under it (keys parsed into Option)
    saved_bytes: Mapping[str, int] = field(hash=False)
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    rebuild_s: float = 0.0
    # option -> seconds a selective option adds to the backward (its ops rebuilt)
    extra_bwd_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    fwd_transient_bytes: int = 0
    # May be negative: a backward that frees what its stage saved, or the gradient it was
    # handed, before its peak (Note [A backward that frees before its peak] in
    # remat/core/solve/simulator.py); never below minus keep's saved bytes and the two
    # boundaries' gradients (the backward event would hold less than nothing).
    bwd_transient_bytes: int = 0
    # Peak extra bytes of a forward that saves nothing (inside a region), beyond input and
    # output; None: not measured (a hand-written problem), charged like a keep forward.
    nosave_transient_bytes: int | None = None
    # parameter gradients this stage's backward creates first (alive until the optimizer)
    grad_bytes: int = 0
    # Whether autograd keeps the stage's input when it runs under keep (False: a stage
    # whose first op saves only what it computes, so the input can go after its forward).
    # Selective stages always keep it: torch's checkpoint frame holds the input.
    saves_input: bool = True
    # option -> whether the stage holds its input under that option where it was measured
    # apart: a compiled stage runs a selective option as its own graph, which saves what
    # inductor chooses (often a copy of the input in another layout, not the input).
    input_kept_by_option: Mapping[str, bool] = field(default_factory=dict, hash=False)
    # Why no region may span the link from the previous stage into this one (the model's
    # code there cannot be replayed, Note [Glue between stages]); None: regions may.
    break_before: str | None = None
    # Tensors made before this stage that its call or the code before it reads: a region
    # containing the read but opening after the tensor was made holds it to its backward.
    reads: tuple[HeldRead, ...] = field(default=(), hash=False)
    # Gradients the model's code made for tensors it passed on to later stages (a skip
    # connection's), alive from this stage's backward until backward passes the stage that
    # made them: they depend on where backward is, not on the plan.
    pending_grad_bytes: int = 0
    # What this stage's backward holds when its first node asks a region ending here for
    # its rebuild, beyond the gradient of the stage's output: under autocast, that gradient
    # cast to the lower dtype for the stage's last op (a residual add of a bf16 branch).
    # Alive through the rebuild of a region ending at this stage, gone by its backward's
    # own peak (keep's backward transient has it). Note [What a rebuild starts with] in
    # remat.core.solve.simulator.
    rebuild_grad_bytes: int = 0
    # Under autocast: the parameters' casts this stage's forward makes, which autocast's
    # cache keeps until the autocast region exits (the end of the forward, or of a
    # rebuild), whether autograd saves them or not; and of those, what a forward under
    # keep does not save (a Linear's bias: its backward needs no bias). Note [Autocast's
    # cast cache] in remat.core.solve.simulator.
    cast_cache_bytes: int = 0
    cast_unsaved_bytes: int = 0
    # Of saved_bytes, what the model's code between the previous stage and this one keeps
    # for backward (a block the chain does not list: a module between two stages the user named).
    link_saved_bytes: int = 0
    # The backward of the model's code between the previous stage and this one (an in-place
    # ReLU between two convolutions): its peak above what is live when it is done and the
    # previous stage's backward begins (what that code saved, the gradient it was handed,
    # the one it makes). An event of its own in the simulator, after this stage's backward
    # (Note [The backward of the code between stages] in remat.core.solve.simulator).
    link_backward_bytes: int = 0
    # What the stage's call is passed from before the chain that a checkpoint frame over
    # it holds (empty in profiles from before it was measured per stage: every frame is
    # then taken to hold all of ``args_at_return_bytes``).
    call_args: tuple[CallArg, ...] = field(default=(), hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"{self.record} name {self.name!r} is not a module path; "
                             "give a string")
        where = self.where
        for name in ("boundary_bytes", "output_bytes", "fwd_transient_bytes",
                     "grad_bytes", "pending_grad_bytes",
                     "rebuild_grad_bytes", "cast_cache_bytes", "cast_unsaved_bytes",
                     "link_saved_bytes", "link_backward_bytes"):
            object.__setattr__(self, name, self.nbytes(getattr(self, name), name))
        if self.nosave_transient_bytes is not None:
            object.__setattr__(self, "nosave_transient_bytes", self.nbytes(
                self.nosave_transient_bytes, "nosave_transient_bytes"))
        for name in ("fwd_s", "bwd_s", "rebuild_s"):
            object.__setattr__(self, name, check.seconds(getattr(self, name), f"{where} {name}"))
        check.flag(self.saves_input, f"{where} saves_input")
        if self.break_before is not None and not isinstance(self.break_before, str):
            raise UsageError(f"{where} break_before={self.break_before!r} must be a reason "
                             "or null")
        if not isinstance(self.saved_bytes, Mapping) or KEEP not in self.saved_bytes:
            raise UsageError(f"{where} saved_bytes={self.saved_bytes!r} has no 'keep' entry; "
                             "give at least {'keep': <bytes>}")
        saved = {self.option(k, "saved_bytes"): self.nbytes(v, f"saved_bytes[{k!r}]")
                 for k, v in self.saved_bytes.items()}
        object.__setattr__(self, "saved_bytes", MappingProxyType(saved))
        freed = self.bwd_transient_bytes
        if isinstance(freed, int) and not isinstance(freed, bool) and freed < 0:
            least = saved[KEEP] + self.boundary_bytes + self.output_bytes
            if -freed > least:
                raise UsageError(
                    f"{where} bwd_transient_bytes={freed} frees more than its backward "
                    f"holds ({least} bytes: keep's saved bytes and the two gradients); "
                    f"give -{least} or more")
        else:
            object.__setattr__(self, "bwd_transient_bytes",
                               self.nbytes(freed, "bwd_transient_bytes"))
        if not isinstance(self.extra_bwd_s, Mapping):
            raise UsageError(f"{where} extra_bwd_s={self.extra_bwd_s!r} must map options to "
                             "seconds")
        extra = {self.option(k, "extra_bwd_s"): check.seconds(v, f"{where} extra_bwd_s[{k!r}]")
                 for k, v in self.extra_bwd_s.items()}
        object.__setattr__(self, "extra_bwd_s", MappingProxyType(extra))
        if not isinstance(self.input_kept_by_option, Mapping):
            raise UsageError(f"{where} input_kept_by_option={self.input_kept_by_option!r} "
                             "must map options to true or false")
        for k, v in self.input_kept_by_option.items():
            check.flag(v, f"{where} input_kept_by_option[{k!r}]")
        object.__setattr__(self, "input_kept_by_option", MappingProxyType({
            self.option(k, "input_kept_by_option"): v
            for k, v in self.input_kept_by_option.items()}))
        object.__setattr__(self, "reads", reads_from(self.reads, where))
        object.__setattr__(self, "call_args", call_args_from(self.call_args, where))

    @property
    def where(self) -> str:
        return f"{self.record} {self.name!r}"

    def option(self, text: object, name: str) -> Option:
        """``text`` parsed as an option keyed in this record's field ``name``."""
        try:
            return Option(text)
        except UsageError as err:
            raise UsageError(f"{self.where} {name}: {err}") from None

    def nbytes(self, value: object, name: str) -> int:
        """``value`` checked as this record's field ``name`` in bytes."""
        return check.byte_count(value, f"{self.where} {name}", sizes=self.takes_sizes)


def shared_fields(record: StageRecord) -> dict[str, Any]:
    """The :class:`StageRecord` fields of ``record``, by name (to build another kind)."""
    return {f.name: getattr(record, f.name) for f in fields(StageRecord)}
