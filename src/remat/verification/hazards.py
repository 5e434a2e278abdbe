"""Hazard detectors: what inside a region makes a rebuild compute or do something else.

Each detector works by watching one real training step of the model with the plan
applied (``remat.verify`` runs them in its first step), not by reading the code:

* randomness torch does not restore: a stage whose forward moves Python's ``random`` or
  NumPy's global generator, or calls an op with an explicit ``torch.Generator`` (seen by
  the value check's dispatch mode), or moves torch's own generator while the runtime's
  RNG preservation is off. The rebuild then draws other numbers.
* buffers mutated inside a region: values that changed during a stage's forward; the
  runtime puts such buffers back after each rebuild (``covered``) unless the update hid
  from it (a write through ``.data`` does not bump the version counter), which shows as
  the buffer changing again during backward.
* in-place modification: a region's input, another tensor argument of a rebuilt stage, or
  a parameter it uses, changed between the forward call and the rebuild (version counter
  or values).
* data-dependent control flow: the rebuild ran another op sequence (from the value check).
* routing: a router's ``topk``/``argmax`` chose other indices in the rebuild than in the
  forward (from the value check), so the rebuilt mixture-of-experts layer sends tokens to
  other experts; a near-tie flips on any difference in the logits, within tolerance or
  not. On a stage holding an ``experts`` module the runtime keeps the forward's
  decisions itself; elsewhere ``selective:save-routing`` does.
* Python side effects repeated by a rebuild: forward hooks of modules inside the stage,
  mutating calls (``append``, ``update``, ...) on lists, dicts, sets and deques the
  forward call also mutated, and changed scalar attributes of the stage's modules; counted.
* parameters changed between forward and backward (an optimizer step, a manual edit).

Side effects are seen through ``sys.setprofile`` while a rebuilt stage's own code runs,
so item assignments (``d[k] = v``) and changes of objects other than containers and
module attributes go unnoticed.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import remat.runtime
from remat.core.plan_format import Plan, Region
from remat.runtime.install import installed_hook_ids
from remat.runtime.stage_calls import stage_submodule
from remat.verification.fingerprint import (
    Checksum,
    Fingerprint,
    checksum,
    outside_dispatch_modes,
    rebuilt_stages,
)
from remat.verification.verify_report import Hazard, ValueCheckResult

__all__ = ["HazardProbe"]

_MUTATORS = frozenset({
    "append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "popitem",
    "remove", "discard", "clear", "sort", "reverse", "add", "update", "setdefault",
    "rotate", "__setitem__", "__delitem__", "__iadd__", "__ior__",
})
_CONTAINERS = (list, dict, set, collections.deque, bytearray)
# Bookkeeping in these files is not the model's doing (torch's checkpoint machinery,
# remat's runtime and this package, the standard library's context managers).
_NOT_USER_CODE = (
    *(os.path.dirname(p) + os.sep for p in (torch.__file__, remat.runtime.__file__, __file__)),
    sysconfig.get_paths()["stdlib"] + os.sep,
)
_SCALARS = (bool, int, float, str, type(None))
_TORCH_RNG = "torch's generator (RNG preservation is off)"
_MAX_DETAILS = 8


@dataclass(frozen=True)
class _State:
    """What a tensor looked like: its version counter and its checksum."""

    version: int
    sums: Checksum | None


def _state(tensor: torch.Tensor) -> _State:
    with outside_dispatch_modes():
        return _State(tensor._version, checksum(tensor))


def _same_values(a: Checksum | None, b: Checksum | None) -> bool:
    """Equal checksums, NaN equal to NaN (a NaN in a tensor stays a NaN in its sums)."""
    if a is None or b is None:
        return a is b
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


def _same(a: _State, b: _State) -> bool:
    return a.version == b.version and _same_values(a.sums, b.sums)


def _labelled(obj: Any, label: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield label, obj
    elif isinstance(obj, (tuple, list)):
        for k, item in enumerate(obj):
            yield from _labelled(item, f"{label}[{k}]")
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _labelled(item, f"{label}[{key!r}]")


def _rng_states(torch_too: bool) -> dict[str, object]:
    """The generators torch's checkpoint does not restore (and torch's own, if asked)."""
    states: dict[str, object] = {"Python's random module": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        states["NumPy's global generator"] = (name, keys.tobytes(), pos, has_gauss, gauss)
    if torch_too:
        with outside_dispatch_modes():
            states[_TORCH_RNG] = bytes(torch.get_rng_state().numpy())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                states["torch's CUDA generator"] = tuple(
                    bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()
                )
    return states


def _attributes(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, object]:
    return {
        f"{path}.{key}" if path else key: value
        for path, module in modules
        for key, value in vars(module).items()
        if isinstance(value, _SCALARS)
    }


@dataclass(eq=False)
class _Call:
    """One stage call being watched."""

    stage: int
    rebuild: bool
    previous_profile: Any
    rng: dict[str, object] = field(default_factory=dict)
    buffers: dict[str, _State] = field(default_factory=dict)
    attributes: dict[str, object] = field(default_factory=dict)


class HazardProbe:
    """Watches one training step of ``model`` (with ``plan`` applied) for hazards.

    Drive it as the runtime's stage observer and call, in order: :meth:`begin_step`
    before the forward, :meth:`before_backward` between forward and backward,
    :meth:`after_backward`, then :meth:`hazards`. :meth:`close` removes its hooks.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, preserve_rng_state: bool = True) -> None:
        self._model = model
        self._names = plan.stages
        self._rebuilt = rebuilt_stages(plan)
        self._preserve_rng_state = preserve_rng_state
        # Stages whose first argument torch saves for the rebuild: top-level region
        # starts, and selective stages outside regions (their own frame saves it).
        self._saved_boundary: dict[int, Region | None] = {r.start: r for r in plan.children()}
        self._saved_boundary.update({i: None for i, r in self._rebuilt.items() if r is None})
        modules = {i: stage_submodule(model, plan.stages[i]) for i in self._rebuilt}
        self._modules = {
            i: tuple(m.named_modules(prefix=plan.stages[i])) for i, m in modules.items()
        }
        self._params = {
            i: tuple(m.named_parameters(prefix=plan.stages[i])) for i, m in modules.items()
        }

        self._calls: list[_Call] = []
        self._in_backward = False
        self._param_start: dict[str, _State] = {}
        self._changed_params: set[str] = set()
        self._forward_args: dict[int, list[tuple[str, torch.Tensor, _State]]] = {}
        self._reported: set[object] = set()  # ids of reported tensors, names of parameters
        self._randomness: dict[int, dict[str, None]] = {}
        self._mutated: dict[int, dict[str, None]] = {}  # stage -> buffer names, in order
        self._buffers_at_backward: dict[str, tuple[int, _State]] = {}  # name -> stage, state
        self._targets: dict[int, dict[int, object]] = {}  # stage -> containers mutated in forward
        self._repeats: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._found: list[Hazard] = []
        self._hooks: list[RemovableHandle] = []
        ours = installed_hook_ids(model)  # the plan's own stage hooks are not the model's
        for i, named in self._modules.items():
            for path, module in named:
                count = sum(
                    k not in ours for k in (*module._forward_pre_hooks, *module._forward_hooks)
                )
                if count:
                    self._hooks.append(
                        module.register_forward_pre_hook(self._hook_counter(i, path, count))
                    )

    def close(self) -> None:
        """Remove the hooks the probe added to count the model's own hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _region(self, stage: int) -> str | None:
        region = self._rebuilt.get(stage)
        return None if region is None else str(region)

    # -- step boundaries --------------------------------------------------------------

    def begin_step(self) -> None:
        """Before the forward: note every parameter."""
        self._param_start = {
            name: _state(p) for name, p in self._model.named_parameters(remove_duplicate=True)
        }

    def before_backward(self) -> None:
        """Between forward and backward: parameters and region inputs must be unchanged."""
        params = dict(self._model.named_parameters())
        changed = [n for n, s in self._param_start.items() if not _same(_state(params[n]), s)]
        self._changed_params.update(changed)
        if changed:
            readers = sorted({
                self._names[i] for i, named in self._params.items()
                for name, _ in named if name in self._changed_params
            })
            read = (
                f"; the rebuilds of {', '.join(map(repr, readers))} read the new values"
                if readers else ""
            )
            self._found.append(Hazard(
                kind="parameter-changed",
                message=(
                    f"{len(changed)} parameter(s) changed between forward and backward "
                    f"(first {changed[0]!r}), so backward works on other weights than the "
                    f"forward used{read}; step the optimizer only after backward"
                ),
                count=len(changed),
                details=tuple(changed[:_MAX_DETAILS]),
            ))
        for stage in self._saved_boundary:
            self._check_arguments(stage, "the start of backward")
        with outside_dispatch_modes():
            self._buffers_at_backward = {
                name: (i, _state(b))
                for i, named in self._modules.items()
                for name, b in named[0][1].named_buffers(prefix=self._names[i])
            }
        self._in_backward = True

    def after_backward(self) -> None:
        """After backward: buffers changed during backward were changed by a rebuild."""
        self._in_backward = False
        buffers = {
            name: b
            for i, named in self._modules.items()
            for name, b in named[0][1].named_buffers(prefix=self._names[i])
        }
        again: dict[int, list[str]] = collections.defaultdict(list)
        for name, (i, before) in self._buffers_at_backward.items():
            b = buffers.get(name)
            if b is not None and not _same_values(_state(b).sums, before.sums):
                again[i].append(name)
        for i in sorted(set(self._mutated) | set(again)):
            mutated = list(self._mutated.get(i, {}))
            repeated = again.get(i, [])
            covered = [n for n in mutated if n not in repeated]
            if covered:
                self._found.append(self._buffer_hazard(i, covered, covered=True))
            if repeated:
                self._found.append(self._buffer_hazard(i, repeated, covered=False))

    def _buffer_hazard(self, stage: int, names: list[str], *, covered: bool) -> Hazard:
        what = f"buffer(s) {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        if covered:
            message = (
                f"stage {self._names[stage]!r} updates {what} inside a region; the runtime "
                "puts them back after each rebuild, so they change once per step (covered)"
            )
        else:
            message = (
                f"the rebuild of stage {self._names[stage]!r} changed {what} again, an "
                "update the runtime did not see (no version bump, e.g. through .data); "
                "update buffers in place on the buffer itself or outside the region"
            )
        return Hazard(
            kind="buffer-mutation",
            message=message,
            stage=self._names[stage],
            stage_index=stage,
            region=self._region(stage),
            count=len(names),
            covered=covered,
            details=tuple(names[:_MAX_DETAILS]),
        )

    # -- the StageObserver protocol ---------------------------------------------------

    def stage_started(
        self, stage: int, rebuild: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        if stage not in self._rebuilt:
            return
        call = _Call(stage, rebuild, sys.getprofile())
        named = self._modules[stage]
        if rebuild:
            self._check_arguments(stage, "its rebuild")
            self._check_parameters(stage)
        else:
            call.rng = _rng_states(torch_too=not self._preserve_rng_state)
            call.buffers = {
                name: _state(b) for name, b in named[0][1].named_buffers(prefix=self._names[stage])
            }
            self._record_arguments(stage, args, kwargs)
        call.attributes = _attributes(named)
        self._calls.append(call)
        sys.setprofile(self._profile)

    def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None:
        if stage not in self._rebuilt:
            return
        call = self._calls.pop()
        sys.setprofile(call.previous_profile)
        assert call.stage == stage and call.rebuild == rebuild
        named = self._modules[stage]
        if rebuild:
            after = _attributes(named)
            for key, value in after.items():
                if key in call.attributes and call.attributes[key] != value:
                    self._repeats[stage][f"attribute {key}"] += 1
            return
        moved = [
            source for source, state in _rng_states(not self._preserve_rng_state).items()
            if call.rng.get(source) != state
        ]
        if moved:
            self._randomness.setdefault(stage, {}).update(dict.fromkeys(moved))
        for name, b in named[0][1].named_buffers(prefix=self._names[stage]):
            before = call.buffers.get(name)
            if before is not None and not _same_values(_state(b).sums, before.sums):
                self._mutated.setdefault(stage, {})[name] = None

    # -- in-place modification --------------------------------------------------------

    def _record_arguments(
        self, stage: int, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        first = 0 if stage in self._saved_boundary else 1
        labelled = [
            item for k in range(first, len(args)) for item in _labelled(args[k], f"argument {k}")
        ]
        for key, value in kwargs.items():
            labelled += _labelled(value, f"keyword {key!r}")
        self._forward_args[stage] = [(label, t, _state(t)) for label, t in labelled]

    def _check_arguments(self, stage: int, when: str) -> None:
        for label, tensor, before in self._forward_args.get(stage, ()):
            if id(tensor) in self._reported:  # one tensor passed to several stages
                continue
            now = _state(tensor)
            if _same(now, before):
                continue
            self._reported.add(id(tensor))
            what = (
                f"the input of region {self._rebuilt[stage]}"
                if label == "argument 0" and self._rebuilt[stage] is not None
                else f"{label} of stage {self._names[stage]!r}"
            )
            self._found.append(Hazard(
                kind="inplace-modification",
                message=(
                    f"{what} was modified in place between its forward call and "
                    f"{when} (version {before.version} -> {now.version}), so the rebuild "
                    "computes from other values; clone it before modifying it"
                ),
                stage=self._names[stage],
                stage_index=stage,
                region=self._region(stage),
                details=(label,),
            ))

    def _check_parameters(self, stage: int) -> None:
        for name, p in self._params[stage]:
            before = self._param_start.get(name)
            if before is None or name in self._changed_params or name in self._reported:
                continue
            now = _state(p)
            if _same(now, before):
                continue
            self._reported.add(name)
            self._found.append(Hazard(
                kind="inplace-modification",
                message=(
                    f"parameter {name!r} was modified in place during backward, before the "
                    f"rebuild of stage {self._names[stage]!r} read it (version "
                    f"{before.version} -> {now.version}); update parameters after backward"
                ),
                stage=self._names[stage],
                stage_index=stage,
                region=self._region(stage),
                details=(name,),
            ))

    # -- Python side effects ----------------------------------------------------------

    def _hook_counter(self, stage: int, path: str, count: int) -> Any:
        def counter(_module: nn.Module, _args: Any) -> None:
            if self._in_backward:
                self._repeats[stage][f"forward hooks of {path or 'the stage'}"] += count

        return counter

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_call" or getattr(arg, "__name__", None) not in _MUTATORS:
            return
        target = getattr(arg, "__self__", None)
        if not isinstance(target, _CONTAINERS) or not self._calls:
            return
        if frame.f_code.co_filename.startswith(_NOT_USER_CODE):
            return
        call = self._calls[-1]
        if not call.rebuild:
            # Kept alive until the step ends, so a new container cannot reuse the id.
            self._targets.setdefault(call.stage, {})[id(target)] = target
        elif self._targets.get(call.stage, {}).get(id(target)) is target:
            self._repeats[call.stage][f"{type(target).__name__}.{arg.__name__}"] += 1

    # -- the result -------------------------------------------------------------------

    def hazards(
        self,
        value_check: ValueCheckResult | None = None,
        forward_ops: Mapping[int, Sequence[Fingerprint]] | None = None,
    ) -> tuple[Hazard, ...]:
        """Every hazard seen, plus those the value check's records reveal."""
        found = list(self._found)
        self._note_explicit_generators(forward_ops or {})
        found += self._randomness_hazards()
        if value_check is not None:
            found += _control_flow_hazards(value_check)
            found += _routing_hazards(value_check)
        found += self._side_effect_hazards()
        return _in_report_order(found)

    def _note_explicit_generators(self, forward_ops: Mapping[int, Sequence[Fingerprint]]) -> None:
        """A rebuilt stage's forward ops that drew from an explicit torch.Generator, counted
        among the stage's sources of randomness."""
        for stage, ops in forward_ops.items():
            explicit = sorted({f.op for f in ops if f.explicit_generator})
            if explicit and stage in self._rebuilt:
                self._randomness.setdefault(stage, {})[
                    f"an explicit torch.Generator ({', '.join(explicit)})"
                ] = None

    def _randomness_hazards(self) -> list[Hazard]:
        """Each stage that draws random numbers its rebuild does not restore."""
        found = []
        for stage, sources in sorted(self._randomness.items()):
            fix = (
                "turn RNG preservation back on"
                if list(sources) == [_TORCH_RNG]
                else "draw from torch's default generator, or outside the region"
            )
            found.append(Hazard(
                kind="randomness",
                message=(
                    f"stage {self._names[stage]!r} draws from {' and '.join(sources)}, which "
                    f"the rebuild does not restore, so it draws other numbers; {fix}"
                ),
                stage=self._names[stage],
                stage_index=stage,
                region=self._region(stage),
                count=len(sources),
                details=tuple(sources),
            ))
        return found

    def _side_effect_hazards(self) -> list[Hazard]:
        """Each stage whose rebuild repeated Python side effects."""
        found = []
        for stage, counts in sorted(self._repeats.items()):
            total = sum(counts.values())
            found.append(Hazard(
                kind="python-side-effect",
                message=(
                    f"the rebuild of stage {self._names[stage]!r} repeated {total} Python side "
                    f"effect(s) ({', '.join(f'{k} x{n}' for k, n in counts.most_common(3))}); "
                    "move logging, caches and counters out of the region"
                ),
                stage=self._names[stage],
                stage_index=stage,
                region=self._region(stage),
                count=total,
                details=tuple(f"{k}: {n}" for k, n in counts.most_common(_MAX_DETAILS)),
            ))
        return found


def _control_flow_hazards(value_check: ValueCheckResult) -> list[Hazard]:
    """Each rebuild the value check saw run other ops than its forward."""
    return [
        Hazard(
            kind="control-flow",
            message=(
                f"{mismatch.message}; the stage's code depends on state that changed "
                "after its forward, so make it depend only on its inputs"
            ),
            stage=mismatch.stage,
            stage_index=mismatch.stage_index,
            region=mismatch.region,
            details=tuple(
                op for op in (mismatch.forward_op, mismatch.rebuilt_op) if op is not None
            ),
        )
        for mismatch in value_check.control_flow
    ]


def _routing_hazards(value_check: ValueCheckResult) -> list[Hazard]:
    """Each rebuild the value check saw choose other indices (experts' routing)."""
    return [
        Hazard(
            kind="routing",
            message=(
                f"the rebuild of stage {flip.stage!r} chose other indices at "
                f"{flip.forward_op} (op {flip.op_index}) than its forward did, so its "
                "experts get other tokens; save the routing decisions with "
                "selective:save-routing on the stage, or keep it out of regions"
            ),
            stage=flip.stage,
            stage_index=flip.stage_index,
            region=flip.region,
            details=(flip.forward_op or "",),
        )
        for flip in value_check.routing
    ]


def _in_report_order(found: list[Hazard]) -> tuple[Hazard, ...]:
    """Uncovered hazards first, then by stage (those of no stage first), then by kind."""
    order = {kind: k for k, kind in enumerate(
        ("parameter-changed", "inplace-modification", "randomness", "control-flow",
         "routing", "buffer-mutation", "python-side-effect")
    )}
    return tuple(sorted(
        found,
        key=lambda h: (h.covered, -1 if h.stage_index is None else h.stage_index,
                       order[h.kind]),
    ))
