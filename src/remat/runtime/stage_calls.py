"""Stage names to modules, and which stage a call of a module that is several stages is.

A stage name is a module path, or ``path#k`` for the k-th call of the module at ``path``
in one training forward (Note [Stages that are calls of one module] in
remat.core.stage_names). :func:`stage_submodule` is the one way a stage name becomes a
module; :class:`CallStages` tells hooks on stage modules which stage each call is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from remat.core.stage_names import module_path
from remat.runtime.engine import Phase, StageForward

__all__ = ["CallStages", "PostHook", "PreHook", "call_names", "hook_stages", "stage_submodule"]


def stage_submodule(model: nn.Module, name: str) -> nn.Module:
    """The module of stage ``name`` (``path`` or ``path#k``); AttributeError like
    ``model.get_submodule`` when the model has none at that path."""
    return model.get_submodule(module_path(name))


class CallStages:
    """The stages over ``modules`` (one per stage, in chain order) grouped by module, and
    which stage each call of a module is, for hooks on the modules.

    A module that is one stage: that stage. A module that is several (its calls): in a
    rebuild of an applied plan's region, the stage whose recorded call is replayed; in a
    training forward with a plan over the same stages applied, the stage the engine
    expects next; otherwise (no plan applied: every call is a forward call) its calls in
    turn, the k-th call since the hooks went on (modulo their number) being its k-th stage.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        found: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, module in enumerate(modules):
            found.setdefault(id(module), (module, []))[1].append(i)
        self.groups = [(module, tuple(indices)) for module, indices in found.values()]
        self._count = {id(module): 0 for module, _ in self.groups}

    def stage(self, module: nn.Module, indices: tuple[int, ...]) -> int:
        """The stage of the call of ``module`` (whose stages are ``indices``) starting now."""
        if len(indices) == 1:
            return indices[0]
        forward = module.__dict__.get("forward")
        engine = forward.engine if isinstance(forward, StageForward) else None
        if engine is not None and engine.phase is Phase.REBUILD:  # no forward call: not counted
            return engine.stage_called(indices)
        key = id(module)
        if engine is not None and engine.phase is Phase.FORWARD and engine.next_stage in indices:
            self._count[key] = indices.index(engine.next_stage) + 1
            return engine.next_stage
        k = self._count[key] % len(indices)
        self._count[key] = k + 1
        return indices[k]


def call_names(model: nn.Module, names: Sequence[str]) -> dict[nn.Module, Callable[[], str]]:
    """For the tracker's timeline (``LiveMemoryTracker.watch(call_names=)``): each module
    that is several of the stages ``names``, and what names the stage of its call starting
    now (``layer#2``)."""
    modules = [stage_submodule(model, name) for name in names]
    calls = CallStages(modules)
    return {module: functools.partial(_call_name, calls, module, indices, tuple(names))
            for module, indices in calls.groups if len(indices) > 1}


def _call_name(calls: CallStages, module: nn.Module, indices: tuple[int, ...],
               names: tuple[str, ...]) -> str:
    return names[calls.stage(module, indices)]


PreHook = Callable[[int, tuple[Any, ...], dict[str, Any]], None]
PostHook = Callable[[int, tuple[Any, ...], dict[str, Any], Any], None]


def hook_stages(modules: Sequence[nn.Module], pre: PreHook | None = None,
                post: PostHook | None = None) -> list[RemovableHandle]:
    """Hooks calling ``pre(i, args, kwargs)`` before and ``post(i, args, kwargs, out)`` after
    each call of stage i (``modules``: one per stage); the post hook also runs when the
    stage raises, with ``out`` None. A module that is several stages gets one pair, which
    tells its calls' stages apart (:class:`CallStages`). Returns the handles to remove."""
    calls = CallStages(modules)
    handles = []
    for module, indices in calls.groups:
        running: list[int] = []  # the stages of this module's calls now running

        def pre_hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     indices: tuple[int, ...] = indices, running: list[int] = running) -> None:
            i = calls.stage(m, indices)
            running.append(i)
            if pre is not None:
                pre(i, args, kwargs)

        def post_hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                      indices: tuple[int, ...] = indices, running: list[int] = running
                      ) -> None:
            i = running.pop() if running else indices[0]
            if post is not None:
                post(i, args, kwargs, out)

        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(
            module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
    return handles
