"""Compiled stages: each stage's ``forward`` compiled by ``torch.compile``, regionally.

``compile_stages(model)`` sets each stage's ``forward`` (an instance attribute, as the
docs' recipe does by hand) to a :class:`CompiledForward`: the stage's own forward compiled
with ``torch.compile`` and called through :func:`remat.measure.compiled_calls.call_compiled`,
so the live-storage tracker counts what the compiled graph saves and holds instead of
running it eagerly (Note [Compiled calls under the tracker]). Identical stages share one
compiled graph: Dynamo caches by the code of ``forward`` and treats each module's
parameters as inputs, so a chain of blocks of one class compiles once (a stage whose
shapes differ compiles again, up to Dynamo's recompile limit).

A stage whose ``forward`` the user already compiled (``torch.compile(stage.forward)``)
is wrapped as it is, not compiled again. ``uncompile_stages`` undoes ``compile_stages``.
``remat.apply`` wraps whatever ``forward`` a stage has, so compile first, then apply.
"""

from __future__ import annotations

import copy
import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from remat.core.errors import UsageError
from remat.measure.compiled_calls import call_compiled
from remat.measure.modes import is_compiled_forward, runs_compiled
from remat.runtime.stage_calls import stage_submodule
from remat.runtime.stages import resolve_stages

__all__ = [
    "CompiledForward",
    "code_copy",
    "compile_stages",
    "compiled_flags",
    "compiled_forward",
    "stages_compiled",
    "uncompile_stages",
]


_MISSING = object()


class CompiledForward:
    """A stage's ``forward`` compiled by ``torch.compile`` (``compiled``), with the eager
    one it was made from (``eager``), called so the tracker can measure it."""

    runs_compiled = True  # remat.measure.modes.runs_compiled: hooks stay off its insides

    def __init__(
        self, eager: Any, compiled: Any, previous: Any, options: dict[str, Any] | None = None
    ) -> None:
        self.eager = eager
        self.compiled = compiled
        self.previous = previous  # the stage's instance-level forward before, if any
        self.options = dict(options or {})  # what torch.compile was given

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_compiled(self.compiled, *args, **kwargs)

    def selective(self, ops: tuple[Any, ...]) -> CompiledForward:
        """The stage under a selective option, compiled: torch's selective checkpoint of
        the eager forward traced into one graph (Note [Selective options on compiled
        stages]); saves the outputs of ``ops`` and recomputes the rest in its backward."""
        variants = self.__dict__.setdefault("_selective", {})
        key = tuple(str(op) for op in ops)
        if key not in variants:
            graph = _selective_graph(self.eager, key, self.options)
            contexts = functools.partial(create_selective_checkpoint_contexts, list(ops))
            variants[key] = CompiledForward(
                self.eager, functools.partial(graph, self.eager, contexts), _MISSING,
                self.options,
            )
        return cast("CompiledForward", variants[key])

    def partitioned(self, budget: float) -> CompiledForward:
        """The stage compiled with inductor's min-cut partitioner under
        ``activation_memory_budget=budget`` (Note [Partitioned options on compiled stages])."""
        variants = self.__dict__.setdefault("_partitioned", {})
        if budget not in variants:
            options = {**self.options, _BUDGET_KEY: budget}  # a graph of its own
            graph = compiled_forward(self.eager, options)
            variants[budget] = CompiledForward(
                self.eager, functools.partial(_under_budget, budget, graph), _MISSING,
                self.options,
            )
        return cast("CompiledForward", variants[budget])

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledForward:
        # A compiled function deep-copies as itself (functions are atomic to deepcopy) and
        # would run the original module: compile the copy's own forward instead (Dynamo's
        # cache is keyed by the code, so nothing is compiled again).
        eager = copy.deepcopy(self.eager, memo)
        previous = self.previous
        if previous is not _MISSING:
            previous = torch.compile(copy.deepcopy(previous._torchdynamo_orig_callable, memo))
        compiled = previous if previous is not _MISSING else compiled_forward(
            eager, self.options)
        return CompiledForward(eager, compiled, previous, self.options)


def code_copy(fn: Callable[..., Any], name: str) -> types.FunctionType:
    """``fn`` with a code object of its own, named ``name``. Dynamo keeps compiled code
    and its guards on the code object, and its guards ignore settings such as inductor's
    ``fallback_random`` or functorch's ``activation_memory_budget``: functions sharing a
    code object compiled under other settings would run each other's graphs."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"code_copy needs a Python function, got {type(fn).__name__}")
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _settings() -> tuple[Any, ...]:
    """Inductor settings that change a compiled graph and that Dynamo does not guard on."""
    import torch._inductor.config as inductor_config

    return (bool(inductor_config.fallback_random),)


_FORWARDS: dict[tuple[Any, ...], types.FunctionType] = {}


def compiled_forward(eager: Any, options: dict[str, Any]) -> Any:
    """``torch.compile`` of a stage's bound ``forward``, through a copy of its code per
    class, compile options and inductor settings (:func:`code_copy`): identical stages
    share one graph, and a model compiled under other settings gets graphs of its own.
    An ``_BUDGET_KEY`` entry in ``options`` keys the copy and is not passed on."""
    func = getattr(eager, "__func__", None)
    given = {k: v for k, v in options.items() if k != _BUDGET_KEY}
    if not isinstance(func, types.FunctionType):
        return torch.compile(eager, **given)
    key = (func.__code__, repr(sorted(options.items())), _settings())
    if key not in _FORWARDS:
        _FORWARDS[key] = code_copy(func, f"{func.__name__}_compiled_{len(_FORWARDS)}")
    return torch.compile(types.MethodType(_FORWARDS[key], eager.__self__), **given)


# Note [Partitioned options on compiled stages]
# selective:budget=<f> compiles the stage's own forward (a code copy of its own, so Dynamo
# caches it apart from keep's graph) and calls it with functorch's activation_memory_budget
# set to f: AOTAutograd partitions the joint graph when the first call compiles it (and
# on any recompile), so the setting must hold around every call, not only the first.
# Inductor's min-cut partitioner then saves what fits the fraction of keep's saved bytes
# at the least recompute, and the compiled backward recomputes the rest. Measured on the
# built-in gpt's block (8.78 MiB saved at 1.0): 4.75 MiB at 0.5, 1.76 at 0.1. With dropout
# its gradients are wrong (pytorch#190758: the recomputed dropout draws new masks; gpt's
# block with dropout 0.1 under fallback_random: gradients 3 apart at 0.5 against 2.5e-5
# at 1.0), so the profile offers it only on stages without random ops.
_BUDGET_KEY = "remat.activation_memory_budget"


def _under_budget(budget: float, graph: Any, *args: Any, **kwargs: Any) -> Any:
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        return graph(*args, **kwargs)  # inside the CompiledForward's call_compiled window


# Note [Selective options on compiled stages]
# remat's selective options pick ops by a dispatch mode, which a compiled graph never
# reaches. On a compiled stage the option is instead compiled into the stage: torch's
# selective checkpoint (non-reentrant, with the policy's contexts) around the stage's
# eager forward, traced by Dynamo whole; the partitioner saves what the policy must save
# and recomputes the rest inside the compiled backward. remat.apply calls that graph in
# place of the stage's forward and runs the stage as keep (inside a region it is then
# rebuilt by it). Each (forward, policy) pair gets a function with its own code object,
# so Dynamo caches it apart: one shared code object would collect a recompile per
# stage class and policy and fall back to eager past Dynamo's recompile limit.
_SELECTIVE_GRAPHS: dict[tuple[Any, ...], Callable[..., Any]] = {}


class _QuietContextFnNote(logging.Filter):
    """torch logs, once, that a checkpoint with ``context_fn`` under compile must not hold
    in-place ops; docs/compile.md says it, and ``remat verify`` compares the gradients."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QuietContextFnNote())


def _checkpointed(eager: Any, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(eager, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _selective_graph(
    eager: Any, ops: tuple[str, ...], options: dict[str, Any]
) -> Callable[..., Any]:
    code = getattr(getattr(eager, "__func__", eager), "__code__", None)
    key = (code, ops, repr(sorted(options.items())), _settings())
    if key not in _SELECTIVE_GRAPHS:
        fresh = code_copy(_checkpointed, f"_checkpointed_{len(_SELECTIVE_GRAPHS)}")
        _SELECTIVE_GRAPHS[key] = torch.compile(fresh, **options)
    return _SELECTIVE_GRAPHS[key]


def compiled_flags(model: nn.Module, stages: Sequence[str]) -> tuple[bool, ...]:
    """Per stage: whether its ``forward`` is compiled (by :func:`compile_stages` or by
    ``torch.compile`` on the stage's forward), looking through a plan's wrapper."""
    return tuple(runs_compiled(stage_submodule(model, path)) for path in stages)


def stages_compiled(model: nn.Module, stages: Sequence[str]) -> bool:
    """Whether every stage is compiled; UsageError if some are and some are not."""
    flags = compiled_flags(model, stages)
    if any(flags) and not all(flags):
        eager = next(p for p, f in zip(stages, flags, strict=True) if not f)
        raise UsageError(
            f"some stages are compiled and stage {eager!r} is not; compile all of them "
            "(remat.compile_stages(model)) or none"
        )
    return bool(flags) and all(flags)


def compile_stages(
    model: nn.Module, stages: Sequence[str] | None = None, **compile_options: Any
) -> tuple[str, ...]:
    """Compile each stage's ``forward`` in place (``compile_options`` go to
    ``torch.compile``); return the stage paths. Stages already compiled are wrapped as
    they are. Call it before ``remat.apply``."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    paths = resolve_stages(model, stages)
    modules = [stage_submodule(model, p) for p in paths]
    for path, module in zip(paths, modules, strict=True):
        own = module.__dict__.get("forward", _MISSING)
        if own is not _MISSING and not is_compiled_forward(own):
            raise UsageError(
                f"stage {path!r} has a forward of its own ({type(own).__name__}): call "
                "remat.remove(model) first if a plan is applied, else del stage.forward"
            )
    for module in modules:
        own = module.__dict__.get("forward", _MISSING)
        if isinstance(own, CompiledForward):
            continue
        if own is not _MISSING:  # compiled by the user: keep their compilation
            module.forward = CompiledForward(own._torchdynamo_orig_callable, own, own)
        else:
            eager = module.forward
            module.forward = CompiledForward(
                eager, compiled_forward(eager, compile_options), _MISSING, compile_options
            )
    return tuple(paths)


def uncompile_stages(model: nn.Module) -> int:
    """Undo :func:`compile_stages` on every module of ``model``; return how many.
    Call ``remat.remove(model)`` first if a plan is applied."""
    owned = [(path, module, module.__dict__.get("forward", _MISSING))
             for path, module in model.named_modules()]
    for path, _, own in owned:
        if not isinstance(own, CompiledForward) and isinstance(
            getattr(own, "__wrapped__", None), CompiledForward
        ):
            raise UsageError(
                f"a plan is applied over stage {path!r}; call remat.remove(model) first"
            )
    count = 0
    for _, module, own in owned:
        if isinstance(own, CompiledForward):
            if own.previous is _MISSING:
                del module.forward
            else:
                module.forward = own.previous
            count += 1
    return count
