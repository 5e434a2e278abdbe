"""The profile: what one model's chain of stages costs, as a torch-free JSON artifact.

``remat.profile`` measures it (torch); everything downstream (``problem_from_profile``,
solvers, the simulator, the CLI's plan command) reads it without importing torch.

Conventions (they are the simulator's, see :mod:`remat.core.solve.problem`):

* ``boundary_bytes`` is stage i's input ``x_i``, ``output_bytes`` its output ``x_{i+1}``,
  both by storage.
* ``saved_bytes[option]`` is what the stage keeps for its backward when it runs with grad
  under ``option``, counted by storage, parameters excluded, *not counting its input and
  its output* (the simulator tracks boundaries once each).
* transients are extra bytes at a peak, beyond what the simulator already counts there:
  ``fwd_transient_bytes`` above what is live right after a ``keep`` forward;
  ``nosave_transient_bytes`` above input and output for a forward that saves nothing;
  ``bwd_transient_bytes`` above what is live when its backward starts and its input's
  gradient, plus its output when it saved that (``saves_output``: the simulator no
  longer counts it there); negative where the backward lets go of what the stage saved
  before its peak. The parameter gradients the stage has created by that peak
  are part of it; the simulator adds all of them (``grad_bytes``) after the peak.
* ``extra_bwd_s[option]``: what a selective option adds to the stage's backward (its
  unsaved ops rebuilt, and its checkpoint frame); see :mod:`remat.profiling.optimes`.

Schema version 2 added ``extra_bwd_s`` and counts the gradients created before a
backward peak inside that peak's figure (``bwd_transient_bytes``, ``post_chain``);
version 1 counted none there. A version-1 profile is still read: with no
``extra_bwd_s`` (its selective options cost no time, as version 1 assumed) and with each
part's gradients added to its backward figure (all of them before the peak: the upper
bound version 1 predicted).

Quantities that grow with the batch carry a linear fit ``a + b * batch_size``
(:class:`Scaling`), fitted from profiles at two batch sizes;
:func:`remat.core.transforms.at_batch_size` evaluates them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import remat.core.fields as fields
from remat.core.artifact import JsonArtifact
from remat.core.collectives import StageComms
from remat.core.errors import UsageError
from remat.core.model_identity import StageIdentity, digest
from remat.core.plan_format import KEEP, Option
from remat.core.shapes import ShapeFit
from remat.core.stage_record import StageRecord

__all__ = [
    "COMPILED_OPTIONS",
    "OPTIMIZERS",
    "OPTIONS",
    "SCHEMA_VERSION",
    "FixedBytes",
    "LinearFit",
    "Profile",
    "Scaling",
    "StageProfile",
    "TimedRound",
    "TimingNoise",
]

SCHEMA_VERSION = 2
#: Versions this remat reads (1: stages without ``extra_bwd_s``).
READABLE_VERSIONS = (1, 2)

#: The options every profile measures for every stage.
OPTIONS = (
    KEEP,
    Option.selective("save-matmuls"),
    Option.selective("save-attention"),
    Option.selective("save-nothing"),
)
#: Measured besides on compiled stages that draw no random numbers: inductor's own
#: partitioner at half of keep's saved bytes (docs/compile.md).
COMPILED_OPTIONS = (Option.selective("budget=0.5"),)
#: The optimizers a profile (and every command that steps a model) makes by name:
#: ``adamw``, ``adamw-fused`` (AdamW's fused kernel: no temporaries in its step), ``sgd``.
OPTIMIZERS = ("adamw", "adamw-fused", "sgd")


def _int(value: object, what: str) -> int:
    return fields.byte_count(value, f"profile {what}")


def _float(value: object, what: str) -> float:
    return fields.seconds(value, f"profile {what}")


def _finite(value: object, what: str) -> float:
    return fields.finite(value, f"profile {what}")


def _range(value: object, what: str) -> tuple[float, float]:
    return fields.seconds_range(value, f"profile {what}")


def _check_keys(data: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    fields.check_keys(data, keys, keys, where, missing_hint="regenerate it with remat profile")


@dataclass(frozen=True)
class StageProfile(StageRecord):
    """One stage's measured costs: the :class:`StageRecord` fields and the measurement's
    own (see the module docstring for what each counts)."""

    record: ClassVar[str] = "profile stage"

    # The output stays referenced from outside the chain (a list of hidden states, a skip
    # connection), so a region cannot free it: checkpointing saves less than predicted.
    output_kept_outside: bool = False
    # Whether autograd keeps the stage's output into its own backward (one that ends in a
    # ReLU does).
    saves_output: bool = False
    # The last stage (by index) whose forward runs while the model's own code still
    # references this stage's input / output beyond what the chain holds (a caller's frame
    # around a nested container, a list of skip tensors); len(stages): past the chain, into
    # the post-chain (the model returns it). None: nothing beyond the chain. Measured in
    # the pass that saves nothing; written only when set (docs/cost-model.md).
    input_held_through: int | None = None
    output_held_through: int | None = None
    # Whether the stage's input is the previous stage's output itself (one tensor); False
    # where the model's code between them made a new one (a residual add, a concatenation
    # with a skip tensor, an upsampling), so the two are held apart. Written only when false.
    gets_previous_output: bool = True
    # option -> the backward transient the stage needs under that selective option (its
    # replay included) where the simulator charges keep's saved bytes; measured with the
    # option on. Written only when set.
    selective_bwd_transient_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)
    # option -> the forward transient (peak over exit) of the stage run with grad under
    # that selective option, measured with the option on: its checkpoint frame saves
    # nothing as it goes, so its ops' outputs stay alive as in a forward that saves
    # nothing, not as keep's. Written only when set.
    selective_fwd_transient_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)
    # The stage module's class, parameter shapes and dtypes (remat.core.model_identity), which
    # plans made from the profile record so apply can check the model. Written only when set.
    identity: StageIdentity | None = None
    # The index of the first stage identical to this one (same class, parameters and
    # input shapes), whose rounds were pooled with this stage's: every member of the
    # group has the median of all of them (remat.profiling.pooling). Written only when set.
    same_as: int | None = None
    # Time -> (low, high): the interquartile range of the samples its median was taken
    # over ("fwd_s", "bwd_s", "rebuild_s", "extra_bwd_s.<option>"). Written only when set.
    time_spread: Mapping[str, tuple[float, float]] = field(default_factory=dict, hash=False)
    # Under tensor parallelism: the collectives the stage's forward issues and those its
    # rebuild as a one-stage region repeats (remat.core.collectives, measured by
    # remat.parallel.tensor.stage_comms). Written only when set.
    comms: StageComms | None = None
    # What the link from this stage into the next costs when one region holds both,
    # measured link by link (Note [Each link its own cost] in remat/profiling/optimes.py;
    # 0 on the last stage and before a chain break). None: the profile's region_link_s,
    # the average link. Written only when set.
    link_s: float | None = None
    # Of link_saved_bytes, what the model's code before the stage made and merely held
    # until the forward returned (no code saved it: a vision tower's last hidden state in
    # the model's output while the text tower runs), where no region may span that code
    # (break_before); the problem lets it go at the forward's return (Note [What the code
    # between stages holds to the return] in remat.profiling.assemble). Written only when set.
    link_at_return_bytes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        where = self.where
        object.__setattr__(self, "link_at_return_bytes",
                           self.nbytes(self.link_at_return_bytes, "link_at_return_bytes"))
        if self.link_at_return_bytes > self.link_saved_bytes:
            raise UsageError(f"{where} link_at_return_bytes={self.link_at_return_bytes} is "
                             f"more than its link_saved_bytes={self.link_saved_bytes}; "
                             "regenerate it with remat profile")
        if self.link_s is not None:
            object.__setattr__(self, "link_s", fields.seconds(self.link_s, f"{where} link_s"))
        if self.comms is not None and not isinstance(self.comms, StageComms):
            raise UsageError(f"{where} comms must be a StageComms or null")
        for flag in ("output_kept_outside", "saves_output", "gets_previous_output"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"{where} {flag} must be true or false")
        for name in ("selective_bwd_transient_bytes", "selective_fwd_transient_bytes"):
            if not isinstance(getattr(self, name), Mapping):
                raise UsageError(f"{where} {name} must map options to bytes")
            by_option = {str(k): self.nbytes(v, f"{name}[{k!r}]")
                         for k, v in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(by_option))
        if self.identity is not None and not isinstance(self.identity, StageIdentity):
            raise UsageError(f"{where} identity must be a StageIdentity or null")
        if not isinstance(self.time_spread, Mapping):
            raise UsageError(f"{where} time_spread must map times to [low, high]")
        object.__setattr__(self, "time_spread", MappingProxyType({
            str(k): fields.seconds_range(v, f"{where} time_spread[{k!r}]")
            for k, v in self.time_spread.items()
        }))
        for name in ("input_held_through", "output_held_through", "same_as"):
            fields.stage_index(getattr(self, name), f"{where} {name}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "boundary_bytes": self.boundary_bytes,
            "output_bytes": self.output_bytes,
            "saved_bytes": dict(self.saved_bytes),
            "fwd_s": self.fwd_s,
            "bwd_s": self.bwd_s,
            "rebuild_s": self.rebuild_s,
            "fwd_transient_bytes": self.fwd_transient_bytes,
            "bwd_transient_bytes": self.bwd_transient_bytes,
            "nosave_transient_bytes": self.nosave_transient_bytes,
            "grad_bytes": self.grad_bytes,
            "output_kept_outside": self.output_kept_outside,
            "saves_input": self.saves_input,
            "saves_output": self.saves_output,
            "extra_bwd_s": dict(self.extra_bwd_s),
            **({"break_before": self.break_before} if self.break_before is not None else {}),
            **({"link_saved_bytes": self.link_saved_bytes} if self.link_saved_bytes else {}),
            **({"link_backward_bytes": self.link_backward_bytes} if self.link_backward_bytes
               else {}),
            **{
                name: getattr(self, name)
                for name in ("input_held_through", "output_held_through")
                if getattr(self, name) is not None
            },
            **({} if self.gets_previous_output else {"gets_previous_output": False}),
            **(
                {"selective_bwd_transient_bytes": dict(self.selective_bwd_transient_bytes)}
                if self.selective_bwd_transient_bytes
                else {}
            ),
            **(
                {"selective_fwd_transient_bytes": dict(self.selective_fwd_transient_bytes)}
                if self.selective_fwd_transient_bytes
                else {}
            ),
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
            **({"identity": self.identity.to_dict()} if self.identity is not None else {}),
            **({"same_as": self.same_as} if self.same_as is not None else {}),
            **(
                {"time_spread": {k: list(v) for k, v in self.time_spread.items()}}
                if self.time_spread
                else {}
            ),
            **({"comms": self.comms.to_dict()} if self.comms is not None else {}),
            **({"link_s": self.link_s} if self.link_s is not None else {}),
            **({"link_at_return_bytes": self.link_at_return_bytes}
               if self.link_at_return_bytes else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageProfile:
        if not isinstance(data, Mapping):
            raise UsageError(f"a profile stage must be a JSON object, got {type(data).__name__}")
        where = f"profile stage {data.get('name', '?')!r}"
        keys = (*_STAGE_KEYS, *(k for k in _OPTIONAL_STAGE_KEYS if k in data))
        _check_keys(data, keys, where or "a profile stage")
        values = {k: data[k] for k in keys}
        if values.get("identity") is not None:
            values["identity"] = StageIdentity.from_dict(values["identity"], f"{where} identity")
        if values.get("comms") is not None:
            values["comms"] = StageComms.from_dict(values["comms"], f"{where} comms")
        return cls(**values)


_STAGE_KEYS_V1 = (
    "name",
    "boundary_bytes",
    "output_bytes",
    "saved_bytes",
    "fwd_s",
    "bwd_s",
    "rebuild_s",
    "fwd_transient_bytes",
    "bwd_transient_bytes",
    "nosave_transient_bytes",
    "grad_bytes",
    "output_kept_outside",
    "saves_input",
    "saves_output",
)
_STAGE_KEYS = (*_STAGE_KEYS_V1, "extra_bwd_s")
# written only when set
_OPTIONAL_STAGE_KEYS = (
    "break_before",
    "link_saved_bytes",
    "link_backward_bytes",
    "input_held_through",
    "output_held_through",
    "gets_previous_output",
    "selective_bwd_transient_bytes",
    "selective_fwd_transient_bytes",
    "input_kept_by_option",
    "reads",
    "pending_grad_bytes",
    "rebuild_grad_bytes",
    "cast_cache_bytes",
    "cast_unsaved_bytes",
    "call_args",
    "identity",
    "same_as",
    "time_spread",
    "comms",
    "link_s",
    "link_at_return_bytes",
)


@dataclass(frozen=True)
class FixedBytes:
    """Bytes outside the chain, measured by the tracker.

    ``pre_chain_bytes``: what the part before the first stage (embeddings) keeps for
    backward, beyond the first stage's input. ``post_chain_bytes``: the larger extra peak
    of the part after the last stage (head, logits, loss) in forward and in backward,
    beyond what is live when it starts (the parameter gradients its backward has created
    by its peak included; the simulator adds all of them after it). ``*_grads_bytes``:
    parameter gradients created by the pre- and post-chain backward. ``optimizer_step_bytes``:
    the optimizer step's own temporaries above parameters, gradients and state.
    """

    params_bytes: int
    buffers_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    inputs_bytes: int
    pre_chain_bytes: int
    post_chain_bytes: int
    pre_chain_grads_bytes: int = 0
    post_chain_grads_bytes: int = 0
    optimizer_step_bytes: int = 0
    # What the step still holds outside the chain through the chain's backward (the loss,
    # which the caller holds, and what autograd keeps with it: 8 bytes for a float32
    # cross entropy).
    # Written only when set.
    backward_residue_bytes: int = 0
    # The post-chain's forward and backward peaks apart, beyond the chain's end
    # (``post_chain_bytes`` is the larger); None in profiles from before they were kept.
    post_chain_forward_bytes: int | None = None
    post_chain_backward_bytes: int | None = None
    # The bytes of the first stage's input that were alive when the step began (a
    # Sequential model fed the batch itself, a learned query parameter): counted in
    # ``inputs`` (or ``params``) already, and alive all step. Written only when set.
    first_input_at_start_bytes: int = 0
    # Of pre_chain_bytes, the casts autocast's cache keeps that autograd does not save,
    # gone at the forward's end (remat.profiling.casts). Written only when set.
    pre_chain_cast_bytes: int = 0
    # Of pre_chain_bytes, the tensors the stages' calls are passed from before the chain
    # (a padded batch's 4-D attention mask, position ids) that no stage saves under keep
    # and the model's code lets go of when its forward returns; a checkpoint frame keeps
    # them to its backward (Note [Arguments a checkpoint frame holds] in simulator.py).
    # Written only when set.
    args_at_return_bytes: int = 0
    # Of pre_chain_bytes, what the code before the chain made that no code saves and no
    # stage is passed and the model's code lets go of when its forward returns (a
    # decoder's token and position embeddings before their sum): gone through the whole
    # backward (Note [What the model's forward lets go of at its return] in
    # remat.profiling.assemble). Written only when set.
    pre_chain_at_return_bytes: int = 0

    def __post_init__(self) -> None:
        for name, _ in (*_FIXED_FIELDS, *_OPTIONAL_FIXED_FIELDS):
            value = getattr(self, name)
            if value is not None or name not in _NULLABLE_FIXED_FIELDS:
                object.__setattr__(self, name, _int(value, f"fixed_bytes {name}"))

    def to_dict(self) -> dict[str, int]:
        return {
            **{key: getattr(self, name) for name, key in _FIXED_FIELDS},
            **{key: getattr(self, name) for name, key in _OPTIONAL_FIXED_FIELDS
               if getattr(self, name) or (name in _NULLABLE_FIXED_FIELDS
                                          and getattr(self, name) is not None)},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedBytes:
        if not isinstance(data, Mapping):
            raise UsageError(
                f"profile fixed_bytes must be a JSON object, got {type(data).__name__}"
            )
        fields = (*_FIXED_FIELDS, *((n, k) for n, k in _OPTIONAL_FIXED_FIELDS if k in data))
        _check_keys(data, tuple(key for _, key in fields), "profile fixed_bytes")
        return cls(**{name: data[key] for name, key in fields})


# field name -> JSON key inside "fixed_bytes" (the object's name carries the unit)
_FIXED_FIELDS = (
    ("params_bytes", "params"),
    ("buffers_bytes", "buffers"),
    ("grads_bytes", "grads"),
    ("optimizer_state_bytes", "optimizer_state"),
    ("inputs_bytes", "inputs"),
    ("pre_chain_bytes", "pre_chain"),
    ("post_chain_bytes", "post_chain"),
    ("pre_chain_grads_bytes", "pre_chain_grads"),
    ("post_chain_grads_bytes", "post_chain_grads"),
    ("optimizer_step_bytes", "optimizer_step"),
)
_OPTIONAL_FIXED_FIELDS = (
    ("backward_residue_bytes", "backward_residue"),
    ("post_chain_forward_bytes", "post_chain_forward"),
    ("post_chain_backward_bytes", "post_chain_backward"),
    ("first_input_at_start_bytes", "first_input_at_start"),
    ("pre_chain_cast_bytes", "pre_chain_cast"),
    ("args_at_return_bytes", "args_at_return"),
    ("pre_chain_at_return_bytes", "pre_chain_at_return"),
)
_NULLABLE_FIXED_FIELDS = frozenset({"post_chain_forward_bytes", "post_chain_backward_bytes"})


@dataclass(frozen=True)
class TimingNoise:
    """How much the profile's timed rounds disagreed (remat.profiling.pooling).

    ``rounds``: timed rounds of steps (warm-up excluded), ``extra_rounds`` of them added
    because the first ones were noisy. ``step_spread``: the plain step's relative spread
    over rounds (interquartile range over median; max - min below four rounds).
    ``stage_spread``: the median over stages of the largest relative spread of their
    pooled forward, backward and rebuild samples. ``identical_spread``: how differently
    identical stages measured before pooling (the largest ``max / min - 1`` of their own
    medians; 0 with no identical stages). ``region_overhead_range_s``: the range of the
    per-round figures ``region_overhead_s`` is the median of.
    """

    rounds: int
    extra_rounds: int = 0
    step_spread: float = 0.0
    stage_spread: float = 0.0
    identical_spread: float = 0.0
    region_overhead_range_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        for name in ("rounds", "extra_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"profile timing_noise {name}={value!r} is not a count of "
                                 "rounds; give an int >= 0")
        for name in ("step_spread", "stage_spread", "identical_spread"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0
            ):
                raise UsageError(f"profile timing_noise {name}={value!r} is not a ratio >= 0")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "region_overhead_range_s", _range(
            self.region_overhead_range_s, "timing_noise region_overhead_range_s"))

    @property
    def largest(self) -> float:
        """The larger of the step's and the stages' spreads (the stages' after pooling:
        ``identical_spread`` says how noisy the machine was, not the pooled medians)."""
        return max(self.step_spread, self.stage_spread)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "extra_rounds": self.extra_rounds,
            "step_spread": self.step_spread,
            "stage_spread": self.stage_spread,
            "identical_spread": self.identical_spread,
            "region_overhead_range_s": list(self.region_overhead_range_s),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimingNoise:
        keys = ("rounds", "extra_rounds", "step_spread", "stage_spread", "identical_spread",
                "region_overhead_range_s")
        _check_keys(data, keys, "profile timing_noise")
        return cls(**{k: data[k] for k in keys})


@dataclass(frozen=True)
class TimedRound:
    """One timed profiling round's figures, in the profile's terms (Note [Paired
    overhead] in ``remat/core/solve/paired.py``): each stage's forward and backward (the plain
    step), its rebuild (the step with one region per stage) and each selective option's
    extra (its step), each the median of the stage and the stages identical to it within
    the round; one region's cost and a link's (``None``: not measured) as that round showed
    them; the time outside the chain; the plain step."""

    step_s: float
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    rebuild_s: tuple[float, ...]
    extra_bwd_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict, hash=False)
    region_overhead_s: float = 0.0
    region_link_s: float | None = None
    outside_chain_s: float = 0.0
    # per stage, the link from it into the next as this round priced it (StageProfile's
    # link_s); None where not measured link by link
    link_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("step_s", "region_overhead_s", "outside_chain_s"):
            object.__setattr__(self, name, _float(getattr(self, name), f"timed round {name}"))
        if self.region_link_s is not None:
            object.__setattr__(self, "region_link_s",
                               _float(self.region_link_s, "timed round region_link_s"))
        n = None
        for name in ("fwd_s", "bwd_s", "rebuild_s"):
            values = _seconds_list(getattr(self, name), f"timed round {name}")
            if n is not None and len(values) != n:
                raise UsageError(f"timed round {name} has {len(values)} stages, not {n}; "
                                 "profile the model again")
            n = len(values)
            object.__setattr__(self, name, values)
        if self.link_s is not None:
            links = _seconds_list(self.link_s, "timed round link_s")
            if len(links) != n:
                raise UsageError(f"timed round link_s has {len(links)} stages, not {n}; "
                                 "profile the model again")
            object.__setattr__(self, "link_s", links)
        if not isinstance(self.extra_bwd_s, Mapping):
            raise UsageError("timed round extra_bwd_s must map options to per-stage seconds")
        extras = {}
        for option, values in self.extra_bwd_s.items():
            extras[str(option)] = _seconds_list(values, f"timed round extra_bwd_s[{option!r}]")
            if len(extras[str(option)]) != n:
                raise UsageError(f"timed round extra_bwd_s[{option!r}] has "
                                 f"{len(extras[str(option)])} stages, not {n}")
        object.__setattr__(self, "extra_bwd_s", MappingProxyType(extras))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "fwd_s": list(self.fwd_s),
            "bwd_s": list(self.bwd_s),
            "rebuild_s": list(self.rebuild_s),
            "extra_bwd_s": {o: list(v) for o, v in self.extra_bwd_s.items()},
            "region_overhead_s": self.region_overhead_s,
            "region_link_s": self.region_link_s,
            "outside_chain_s": self.outside_chain_s,
            **({"link_s": list(self.link_s)} if self.link_s is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimedRound:
        keys = ("step_s", "fwd_s", "bwd_s", "rebuild_s", "extra_bwd_s", "region_overhead_s",
                "region_link_s", "outside_chain_s", *(("link_s",) if "link_s" in data else ()))
        _check_keys(data, keys, "a profile's timed round")
        return cls(**{k: data[k] for k in keys})


def _seconds_list(values: object, what: str) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        raise UsageError(f"{what} must be a list of seconds, one per stage")
    return tuple(_float(v, what) for v in values)


@dataclass(frozen=True)
class LinearFit:
    """``a + b * batch_size``: ``a`` what does not grow with the batch, ``b`` per sample."""

    a: float
    b: float

    def __call__(self, batch_size: int) -> float:
        return self.a + self.b * batch_size

    @classmethod
    def through(cls, n1: int, y1: float, n2: int, y2: float) -> LinearFit:
        """The line through ``(n1, y1)`` and ``(n2, y2)``."""
        b = (y2 - y1) / (n2 - n1)
        return cls(y1 - b * n1, b)


@dataclass(frozen=True)
class Scaling:
    """Per-quantity linear fits in the batch size, from profiles at ``batch_sizes``.

    ``fits`` maps a quantity's path in :meth:`Profile.to_dict` (``"measured_peak_bytes"``,
    ``"fixed_bytes.inputs"``, ``"stages.3.saved_bytes.keep"``, ``"stages.0.fwd_s"``) to
    its fit; quantities not listed do not depend on the batch size.
    """

    batch_sizes: tuple[int, int]
    fits: Mapping[str, LinearFit] = field(hash=False)

    def __post_init__(self) -> None:
        sizes = tuple(self.batch_sizes)
        if (
            len(sizes) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
            or sizes[0] == sizes[1]
        ):
            raise UsageError(
                f"scaling batch_sizes={self.batch_sizes!r} must be two different whole numbers >= 1"
            )
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "fits", MappingProxyType(dict(self.fits)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "fits": {path: {"a": f.a, "b": f.b} for path, f in self.fits.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scaling:
        _check_keys(data, ("batch_sizes", "fits"), "profile scaling")
        if not isinstance(data["fits"], Mapping):
            raise UsageError("profile scaling fits must be a JSON object of {'a', 'b'} fits")
        fits = {}
        for path, fit in data["fits"].items():
            _check_keys(fit, ("a", "b"), f"profile scaling fit {path!r}")
            fits[path] = LinearFit(*(_finite(fit[k], f"scaling fit {path!r} {k}") for k in "ab"))
        sizes = data["batch_sizes"]
        if not isinstance(sizes, list) or len(sizes) != 2:
            raise UsageError(f"profile scaling batch_sizes={sizes!r} must be a pair of sizes")
        return cls((sizes[0], sizes[1]), fits)


@dataclass(frozen=True)
class Profile(JsonArtifact):
    """One model's chain profiled at one batch size (module docstring: conventions)."""

    artifact: ClassVar[str] = "profile"
    written_by: ClassVar[str] = "remat profile --json"

    model: str
    batch_size: int | None
    stages: tuple[StageProfile, ...]
    fixed: FixedBytes
    region_overhead_s: float = 0.0
    region_overhead_bytes: int = 0
    outside_chain_s: float = 0.0  # pre-chain, post-chain and optimizer step
    step_s: float = 0.0  # one training step without checkpointing (median)
    measured_peak_bytes: int | None = None  # one step without checkpointing, by the tracker
    predicted_peak_bytes: int | None = None  # the simulator's figure for that step
    optimizer: str = "adamw"
    device: str = "cpu"
    torch_version: str = ""
    dtype: str = "float32"
    profile_s: float = 0.0  # wall time the profiling took
    scaling: Scaling | None = None
    # What plans made from the profile record about the model (remat.core.model_identity): how
    # many stages it had (the profiled ones and the unnamed blocks beside them) and the
    # shapes of the batch's tensors. Written only when set.
    model_stages: int | None = None
    batch_shapes: tuple[tuple[int, ...], ...] | None = None
    timing_noise: TimingNoise | None = None  # written only when set
    # what each link inside a region costs beyond its stages' single-stage figures (Note
    # [Links inside a region] in remat/profiling/optimes.py); None where no region can
    # span two stages, or from a remat before it. Written only when set.
    region_link_s: float | None = None
    # each timed round's figures, for the paired overhead (remat/core/solve/paired.py); written
    # only when set, dropped by transforms.at_batch_size at another batch size
    timed_rounds: tuple[TimedRound, ...] | None = None
    # measured on stages whose forward is compiled by torch.compile (docs/compile.md);
    # plans made from it carry the flag. Written only when set.
    compiled: bool = False
    # measured under FakeTensorMode (no weights allocated, no kernel run): its bytes are
    # the real step's, its times only the fake run's dispatch, not kernels (docs/fake.md).
    # Written only when set.
    fake: bool = False
    # a fake profile for a target device (remat.core.devices): per stage (or "outside the
    # chain"), the kernel each attention call was assumed to run -> calls per forward
    kernels: Mapping[str, Mapping[str, int]] | None = None
    # its times are the roofline's estimates for the target device, not measured
    # (remat.core.roofline); written only when true
    times_estimated: bool = False
    # the figures' fits over a range of batch shapes (Note [Shape-aware profiles] in
    # remat.core.shapes); written only when set
    shapes: ShapeFit | None = None

    def __post_init__(self) -> None:
        if self.kernels is not None:
            if not isinstance(self.kernels, Mapping) or not all(
                    isinstance(v, Mapping) for v in self.kernels.values()):
                raise UsageError("profile kernels must map stages to {kernel: calls}; "
                                 "profile the model again")
            object.__setattr__(self, "kernels", MappingProxyType({
                str(stage): MappingProxyType({str(k): _int(n, "kernels calls")
                                              for k, n in calls.items()})
                for stage, calls in self.kernels.items()}))
        for flag in ("compiled", "fake", "times_estimated"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"profile {flag}={getattr(self, flag)!r} is not a bool")
        stages = tuple(self.stages)
        if not stages or not all(isinstance(s, StageProfile) for s in stages):
            raise UsageError("a profile needs at least one stage, each a StageProfile")
        object.__setattr__(self, "stages", stages)
        if self.batch_size is not None:
            _int(self.batch_size, "batch_size")
        for name in ("region_overhead_s", "outside_chain_s", "step_s", "profile_s"):
            object.__setattr__(self, name, _float(getattr(self, name), name))
        object.__setattr__(
            self, "region_overhead_bytes", _int(self.region_overhead_bytes, "region_overhead_bytes")
        )
        for name in ("measured_peak_bytes", "predicted_peak_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int(value, name))
        if self.region_link_s is not None:
            object.__setattr__(self, "region_link_s", _float(self.region_link_s, "region_link_s"))
        if self.timed_rounds is not None:
            rounds = tuple(self.timed_rounds)
            if not all(isinstance(r, TimedRound) and len(r.fwd_s) == len(stages)
                       for r in rounds):
                raise UsageError(f"profile timed_rounds must give each of the {len(stages)} "
                                 "stages its times; profile the model again")
            object.__setattr__(self, "timed_rounds", rounds)
        if self.model_stages is not None:
            object.__setattr__(self, "model_stages", _int(self.model_stages, "model_stages"))
        if self.model_stages is not None and self.model_stages < len(stages):
            raise UsageError(
                f"profile model_stages={self.model_stages} is below its {len(stages)} stages; "
                "regenerate it with remat profile"
            )
        if self.batch_shapes is not None:
            shapes = self.batch_shapes
            if not isinstance(shapes, (list, tuple)) or not all(
                isinstance(shape, (list, tuple)) for shape in shapes
            ):
                raise UsageError(f"profile batch_shapes={shapes!r} is not a list of shapes")
            object.__setattr__(self, "batch_shapes", tuple(
                tuple(_int(n, "batch_shapes size") for n in shape) for shape in shapes
            ))

    def digest(self) -> str:
        """16 hex digits of the SHA-256 of the profile's canonical JSON (plans record it)."""
        return digest(self.to_dict())

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    @property
    def prediction_error(self) -> float | None:
        """``predicted / measured - 1`` for the step without checkpointing, if both exist."""
        if not self.measured_peak_bytes or self.predicted_peak_bytes is None:
            return None
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1

    # -- serialization ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "device": self.device,
            "torch_version": self.torch_version,
            "dtype": self.dtype,
            "stages": [s.to_dict() for s in self.stages],
            "fixed_bytes": self.fixed.to_dict(),
            "region_overhead_s": self.region_overhead_s,
            "region_overhead_bytes": self.region_overhead_bytes,
            "outside_chain_s": self.outside_chain_s,
            "step_s": self.step_s,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "profile_s": self.profile_s,
            "scaling": None if self.scaling is None else self.scaling.to_dict(),
            **({"region_link_s": self.region_link_s} if self.region_link_s is not None else {}),
            **({"timed_rounds": [r.to_dict() for r in self.timed_rounds]}
               if self.timed_rounds is not None else {}),
            **({"model_stages": self.model_stages} if self.model_stages is not None else {}),
            **(
                {"batch_shapes": [list(shape) for shape in self.batch_shapes]}
                if self.batch_shapes is not None
                else {}
            ),
            **(
                {"timing_noise": self.timing_noise.to_dict()}
                if self.timing_noise is not None
                else {}
            ),
            **({"compiled": True} if self.compiled else {}),
            **({"fake": True} if self.fake else {}),
            **({"kernels": {stage: dict(calls) for stage, calls in self.kernels.items()}}
               if self.kernels is not None else {}),
            **({"times_estimated": True} if self.times_estimated else {}),
            **({"shapes": self.shapes.to_dict()} if self.shapes is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Build a profile from ``to_dict()`` output; UsageError on a schema or key problem."""
        if not isinstance(data, Mapping):
            raise UsageError(f"a profile must be a JSON object, got {type(data).__name__}")
        version = fields.schema_version(data, READABLE_VERSIONS, "profile",
                                        "profile the model again with this remat")
        _check_keys(
            data, (*_PROFILE_KEYS, *(k for k in _OPTIONAL_PROFILE_KEYS if k in data)),
            "the profile",
        )
        if not isinstance(data["stages"], list):
            raise UsageError("profile key 'stages' must be a list of stage objects")
        if version == 1:
            data = _from_version_1(data)
        scaling = data["scaling"]
        return cls(
            model=data["model"],
            batch_size=data["batch_size"],
            stages=tuple(StageProfile.from_dict(s) for s in data["stages"]),
            fixed=FixedBytes.from_dict(data["fixed_bytes"]),
            scaling=None if scaling is None else Scaling.from_dict(scaling),
            timing_noise=(TimingNoise.from_dict(data["timing_noise"])
                          if "timing_noise" in data else None),
            timed_rounds=_timed_rounds(data.get("timed_rounds")),
            shapes=ShapeFit.from_dict(data["shapes"]) if "shapes" in data else None,
            **{k: data[k] for k in _PROFILE_SCALARS},
            **{k: data[k] for k in _OPTIONAL_PROFILE_KEYS
               if k in data and k not in ("timing_noise", "timed_rounds", "shapes")},
        )


_PROFILE_SCALARS = (
    "optimizer",
    "device",
    "torch_version",
    "dtype",
    "region_overhead_s",
    "region_overhead_bytes",
    "outside_chain_s",
    "step_s",
    "measured_peak_bytes",
    "predicted_peak_bytes",
    "profile_s",
)
_PROFILE_KEYS = (
    "schema_version",
    "model",
    "batch_size",
    "stages",
    "fixed_bytes",
    "scaling",
    *_PROFILE_SCALARS,
)
# written only when set
_OPTIONAL_PROFILE_KEYS = ("model_stages", "batch_shapes", "timing_noise", "region_link_s",
                          "timed_rounds", "compiled", "fake", "kernels", "times_estimated",
                          "shapes")


def _timed_rounds(data: object) -> tuple[TimedRound, ...] | None:
    if data is None:
        return None
    if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
        raise UsageError("profile timed_rounds must be a list of round objects")
    return tuple(TimedRound.from_dict(r) for r in data)


def _from_version_1(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 profile in version 2's terms (module docstring): no ``extra_bwd_s``,
    and each part's gradients inside its backward figure, fits shifted to match."""
    new = json.loads(json.dumps(data))
    shifts: dict[str, int] = {}
    for i, stage in enumerate(new["stages"]):
        where = f"profile stage {stage.get('name', i)!r}" if isinstance(stage, dict) else ""
        optional = (k for k in _OPTIONAL_STAGE_KEYS if isinstance(stage, dict) and k in stage)
        _check_keys(stage, (*_STAGE_KEYS_V1, *optional), where or "a profile stage")
        stage["extra_bwd_s"] = {}
        shifts[f"stages.{i}.bwd_transient_bytes"] = _int(stage["grad_bytes"], f"{where} grad_bytes")
    fixed = new["fixed_bytes"]
    if isinstance(fixed, dict) and "post_chain" in fixed:
        shifts["fixed_bytes.post_chain"] = _int(
            fixed.get("post_chain_grads", 0), "fixed_bytes post_chain_grads"
        )
    for path, nbytes in shifts.items():
        set_path(new, path, _number_at(new, path) + nbytes)
    fits = (new.get("scaling") or {}).get("fits")
    if isinstance(fits, dict):
        for path, nbytes in shifts.items():
            if isinstance(fits.get(path), dict) and "a" in fits[path]:
                fits[path]["a"] = float(fits[path]["a"]) + nbytes
    return new


def _number_at(data: Mapping[str, Any], path: str) -> float:
    node: Any = data
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise UsageError(f"profile {path}={node!r} is not a number")
    return float(node)


def set_path(data: dict[str, Any], path: str, value: float) -> None:
    """Set the number at dotted ``path`` (list indices as numbers), keeping its type."""
    *parents, last = path.split(".")
    node: Any = data
    try:
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last  # batch_shapes.0.0
        old = node[key]
    except (KeyError, IndexError, ValueError, TypeError):
        raise UsageError(
            f"profile scaling names {path!r}, which the profile does not have; "
            "regenerate the profile"
        ) from None
    if isinstance(old, bool) or not isinstance(old, (int, float)):
        raise UsageError(f"profile scaling names {path!r}, which is not a number")
    value = max(0.0, value)
    node[key] = round(value) if isinstance(old, int) else value


def numeric_paths(data: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in a ``to_dict()`` tree by dotted path (bools and the schema excluded)."""
    found: dict[str, float] = {}
    items = enumerate(data) if isinstance(data, list) else data.items()
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            found.update(numeric_paths(value, path + "."))  # type: ignore[arg-type]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[path] = value
    return found
