"""Dispatch modes that leave ``torch.compile``'d code as they found it.

Note [Compiled code under the tracker]: remat measures and checks steps under
``TorchDispatchMode``s (the live-storage tracker, the value check of ``remat verify``,
the attention-kernel probe of ``remat bench``). Dynamo skips a frame that starts under a
dispatch mode and marks its code skipped for the rest of the process, so one measurement
of a compiled model would leave it eager for good. Every such mode of remat's is an
:class:`EagerDispatchMode`: compiled code runs eagerly inside it and compiled again after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EagerDispatchMode", "compiled_code_runs_eagerly", "dynamo_stance",
           "is_compiled_forward", "runs_compiled", "without_compiled_insides"]


def dynamo_stance(stance: str) -> contextlib.AbstractContextManager[Any]:
    """Dynamo's ``stance`` for the with-block; a null context on torch before 2.6, which
    has no stances."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    return cast(contextlib.AbstractContextManager[Any], set_stance(stance))


def compiled_code_runs_eagerly() -> contextlib.AbstractContextManager[Any]:
    """Dynamo's ``force_eager`` stance: compiled code runs eagerly inside, and keeps its
    compiled graphs for afterwards. Measured with torch 2.13: a block compiled by
    ``block.forward = torch.compile(block.forward)`` ran its graph in no later step after
    one tracked forward without it (0 calls), and in every one with it."""
    return dynamo_stance("force_eager")


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode under which compiled code runs eagerly for its with-block only."""

    def __enter__(self) -> Any:
        stances = self.__dict__.setdefault("_stances", [])
        stance = compiled_code_runs_eagerly()
        stance.__enter__()
        stances.append(stance)
        try:
            return super().__enter__()
        except BaseException:
            stances.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.__dict__["_stances"].pop().__exit__(None, None, None)


def is_compiled_forward(fn: Any) -> bool:
    """Whether ``fn`` is a compiled forward: a compiled stage's (``remat.compile_stages``)
    or one a user made with ``torch.compile``."""
    return bool(getattr(fn, "runs_compiled", False)) or hasattr(fn, "_torchdynamo_orig_callable")


def runs_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` is compiled (:func:`is_compiled_forward`),
    looking through wrappers such as a plan's (``functools.wraps``: ``__wrapped__``)."""
    forward = module.__dict__.get("forward")
    while forward is not None:
        if is_compiled_forward(forward):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def without_compiled_insides(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` less the modules inside a compiled stage.

    Dynamo traces a submodule's hooks into the compiled graph and guards on how many
    there are: one hook added there recompiles the stage into another program (with the
    hook's Python inside), and a few such changes pass Dynamo's recompile limit, after
    which the stage runs eagerly for good. So whoever hooks every module for a
    measurement leaves those alone; the stage's own hooks run outside its graph.
    """
    inside: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        yield name, module
        if runs_compiled(module):
            inside.append(f"{name}." if name else "")
