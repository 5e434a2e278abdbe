"""The aten ops each stage's forward runs, recorded eagerly (for compiled stages).

The tracker reads a stage's ops off its timeline, and a compiled stage's ops run inside
its graph, out of sight. Selective options are chosen and told apart by those ops
(:mod:`.twins`: options saving the same ops in a stage are one computation), so for
compiled stages one forward runs under a recording dispatch mode, under which a compiled
stage runs eagerly (:class:`remat.measure.modes.EagerDispatchMode`): the ops its eager
forward runs, which are the ops its selective options name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from remat.measure.modes import EagerDispatchMode
from remat.profiling._tensors import buffers_restored, stage_hooks

__all__ = ["eager_stage_ops"]


class _OpNames(EagerDispatchMode):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.ops: list[set[str]] = [set() for _ in range(count)]
        self.current: list[int] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if self.current:
            self.ops[self.current[-1]].add(str(func))
        return func(*args, **(kwargs or {}))


def eager_stage_ops(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], names: Sequence[str]
) -> tuple[frozenset[str], ...]:
    """Per stage, the aten ops (``aten.mm.default``) one eager forward of it runs."""
    modules = [model.get_submodule(name) for name in names]
    recorder = _OpNames(len(modules))

    def enter(i: int, _args: Any, _kwargs: Any) -> None:
        recorder.current.append(i)

    def leave(i: int, _args: Any, _kwargs: Any, _out: Any) -> None:
        if recorder.current and recorder.current[-1] == i:
            recorder.current.pop()

    with buffers_restored(model), stage_hooks(modules, enter, leave), recorder:
        loss_fn(model, batch)  # the graph is dropped unused
    return tuple(frozenset(ops) for ops in recorder.ops)
