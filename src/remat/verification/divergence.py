"""Where two twins first part ways: per-stage records and the search through them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from remat.runtime.engine import main_output
from remat.runtime.stage_calls import hook_stages, stage_submodule
from remat.verification.compare import Diff, diff
from remat.verification.tolerance import TolerancePolicy
from remat.verification.verify_report import Divergence, ValueCheckResult

__all__ = ["StageRecords", "first_divergence"]


@dataclass(eq=False)
class StageRecords:
    """Each stage's forward output, its first rebuilt output, the gradient it received and
    the one it passed back (stage hooks: a region's rebuild calls the stage modules)."""

    names: tuple[str, ...]
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    rebuilt: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)

    @classmethod
    def install(cls, model: nn.Module, names: tuple[str, ...]) -> StageRecords:
        capture = cls(names)
        pres = [capture._pre(i) for i in range(len(names))]
        posts = [capture._post(i) for i in range(len(names))]
        modules = [stage_submodule(model, name) for name in names]
        # one pair of hooks per module, also for a module that is several stages (its calls)
        capture.handles += hook_stages(
            modules, lambda i, args, _kwargs: pres[i](modules[i], args),
            lambda i, args, _kwargs, out: posts[i](modules[i], args, out))
        return capture

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, i: int) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, args: Any) -> None:
            x = args[0] if args else None
            if i in self.outputs or not isinstance(x, torch.Tensor) or not x.requires_grad:
                return  # only the forward call (a rebuild calls the stage again)
            x.register_hook(self._keep(self.input_grads, i))

        return hook

    def _post(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            y = main_output(out)
            if y is None or i in self.rebuilt:
                return
            if i in self.outputs:
                self.rebuilt[i] = y.detach().clone()
                return
            self.outputs[i] = y.detach().clone()
            if y.requires_grad:
                y.register_hook(self._keep(self.output_grads, i))

        return hook

    @staticmethod
    def _keep(store: dict[int, torch.Tensor], i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            store[i] = grad.detach().clone()

        return hook


def first_divergence(
    ours: StageRecords,
    plain: StageRecords,
    grads: tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]],
    stage_params: list[list[str]],
    policy: TolerancePolicy,
    values: ValueCheckResult | None,
) -> Divergence | None:
    """Where step 1 of the twins first parts ways (see :class:`Divergence`): the forward's
    outputs, then the rebuilds, then backward from the last stage, then the gradients of
    parameters outside every stage."""
    if (found := _in_forward(ours, plain, policy)) is not None:
        return found
    if (found := _in_rebuilt_values(values)) is not None:
        return found
    if (found := _in_rebuilt_outputs(ours, plain, policy)) is not None:
        return found
    if (found := _in_backward(ours, plain, grads, stage_params, policy)) is not None:
        return found
    return _outside_stages(ours.names, grads, policy)


def _at(names: tuple[str, ...], i: int | None, quantity: str, tensor: str, d: Diff,
        message: str) -> Divergence:
    """The divergence ``d`` of ``tensor`` at stage ``i`` (None: no one stage)."""
    return Divergence(
        stage=None if i is None else names[i],
        stage_index=i,
        quantity=quantity,
        tensor=tensor,
        max_abs_error=d.max_abs_error,
        max_rel_error=d.max_rel_error,
        message=message,
    )


def _in_forward(ours: StageRecords, plain: StageRecords,
                policy: TolerancePolicy) -> Divergence | None:
    """The first stage whose forward output differs."""
    names = ours.names
    for i in range(len(names)):
        d = diff(ours.outputs.get(i), plain.outputs.get(i), policy)
        if not d.ok:
            return _at(names, i, "output", f"{names[i]} output", d,
                       f"stage {names[i]!r} computes another output in forward")
    return None


def _in_rebuilt_values(values: ValueCheckResult | None) -> Divergence | None:
    """The value check's first op that a rebuild computed otherwise."""
    # Rebuilds: the value check sees every op a rebuild ran, even when early stop ends it
    # before the stage returns (then the stage hooks below see no rebuilt output).
    first = values.first if values is not None else None
    if first is None:
        return None
    return Divergence(
        stage=first.stage,
        stage_index=first.stage_index,
        quantity="rebuilt-value",
        tensor=f"{first.stage} op {first.op_index} {first.rebuilt_op}",
        max_abs_error=math.inf if first.max_abs_error is None else first.max_abs_error,
        max_rel_error=math.inf if first.max_rel_error is None else first.max_rel_error,
        message=first.message,
        op=first.rebuilt_op,
    )


def _in_rebuilt_outputs(ours: StageRecords, plain: StageRecords,
                        policy: TolerancePolicy) -> Divergence | None:
    """The first stage whose rebuilt output differs from the plain forward's."""
    names = ours.names
    for i in range(len(names)):
        if i not in ours.rebuilt:
            continue
        d = diff(ours.rebuilt[i], plain.outputs.get(i), policy)
        if not d.ok:
            return _at(names, i, "rebuilt-output", f"{names[i]} rebuilt output", d,
                       f"the rebuild of stage {names[i]!r} computes another output than the "
                       "forward did")
    return None


def _in_backward(
    ours: StageRecords,
    plain: StageRecords,
    grads: tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]],
    stage_params: list[list[str]],
    policy: TolerancePolicy,
) -> Divergence | None:
    """From the last stage back: the first gradient reaching a stage that differs (the code
    after it), or the first stage that got the same gradient and passed back another."""
    names = ours.names
    for i in reversed(range(len(names))):
        d = diff(ours.output_grads.get(i), plain.output_grads.get(i), policy)
        if not d.ok:
            where = (
                "after the last stage" if i == len(names) - 1
                else f"between stages {names[i]!r} and {names[i + 1]!r}"
            )
            return _at(names, None, "output-gradient", f"{names[i]} output gradient", d,
                       f"the gradient reaching stage {names[i]!r} already differs: the "
                       f"divergence lies in the code {where}")
        produced = [
            (f"{names[i]} input gradient", "input-gradient",
             ours.input_grads.get(i), plain.input_grads.get(i)),
            *((p, "parameter-gradient", grads[0].get(p), grads[1].get(p))
              for p in stage_params[i]),
        ]
        worst = None
        for label, quantity, a, b in produced:
            d = diff(a, b, policy)
            if not d.ok and (worst is None or d.max_rel_error > worst[2].max_rel_error):
                worst = (label, quantity, d)
        if worst is not None:
            label, quantity, d = worst
            return _at(names, i, quantity, label, d,
                       f"stage {names[i]!r} received the same gradient but passed back "
                       f"another one: its backward (and rebuild) differ, worst {label!r}")
    return None


def _outside_stages(
    names: tuple[str, ...],
    grads: tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]],
    policy: TolerancePolicy,
) -> Divergence | None:
    """The parameter outside every stage whose gradient differs most, if any does."""
    failing = [
        (name, d) for name in grads[1]
        if not (d := diff(grads[0].get(name), grads[1].get(name), policy)).ok
    ]
    if failing:
        name, d = max(failing, key=lambda item: item[1].max_rel_error)
        return _at(names, None, "parameter-gradient", name, d,
                   f"every stage agrees, but the gradient of {name!r} outside them differs")
    return None
