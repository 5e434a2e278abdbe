"""The aten ops each stage's forward runs, recorded eagerly (for compiled stages).

The tracker reads a stage's ops off its timeline, and a compiled stage's ops run inside
its graph, out of sight. Selective options are chosen and told apart by those ops
(:mod:`.option_twins`: options saving the same ops in a stage are one computation), so for
compiled stages one forward runs under a recording dispatch mode, under which a compiled
stage runs eagerly (:class:`remat.measure.modes.EagerDispatchMode`): the ops its eager
forward runs, which are the ops its selective options name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.modes import EagerDispatchMode
from remat.profiling._tensors import buffers_restored, stage_hooks
from remat.runtime.stage_calls import stage_submodule

__all__ = ["StageOps", "eager_stage_ops"]


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers: its schema is tagged
    ``nondeterministic_seeded`` (dropout, bernoulli, rand, ...), and where it takes a
    ``dropout_p`` (attention kernels) that is above zero."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for k, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            p = kwargs.get("dropout_p", args[k] if k < len(args) else argument.default_value)
            return bool(p)
    return True


class _OpNames(EagerDispatchMode):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.ops: list[set[str]] = [set() for _ in range(count)]
        self.random = [False] * count
        self.current: list[int] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.current:
            i = self.current[-1]
            self.ops[i].add(str(func))
            self.random[i] = self.random[i] or _draws(func, args, kwargs)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class StageOps:
    """Per stage: the aten ops (``aten.mm.default``) its eager forward runs, and whether
    any of them drew random numbers."""

    ops: tuple[frozenset[str], ...]
    random: tuple[bool, ...]


def eager_stage_ops(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], names: Sequence[str]
) -> StageOps:
    """What one eager forward of each stage runs (:class:`StageOps`)."""
    modules = [stage_submodule(model, name) for name in names]
    recorder = _OpNames(len(modules))

    def enter(i: int, _args: Any, _kwargs: Any) -> None:
        recorder.current.append(i)

    def leave(i: int, _args: Any, _kwargs: Any, _out: Any) -> None:
        if recorder.current and recorder.current[-1] == i:
            recorder.current.pop()

    with buffers_restored(model), stage_hooks(modules, enter, leave), recorder:
        loss_fn(model, batch)  # the graph is dropped unused
    return StageOps(tuple(frozenset(ops) for ops in recorder.ops), tuple(recorder.random))
