"""The one place remat touches torch's private checkpoint API.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` is built on a
generator, ``_checkpoint_without_reentrant_generator``: advancing it once does the
pre-forward work (stash the RNG, autocast and device-context state, save the inputs,
push the saved-tensor hooks that turn everything saved into placeholders) and advancing
it again finishes the forward. ``fn`` is only called later, when backward unpacks a
placeholder, to rebuild the saved tensors. remat needs the two halves separately because
a region opens in one block's call and closes in another's, inside a loop it does not
own. :class:`CheckpointFrame` is that split, and nothing else in remat imports private
torch names, so a torch upgrade breaks here, loudly, and nowhere else.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint as _tuc

from remat.core.errors import RematError

__all__ = ["CheckpointFrame", "check_available", "noop_context_fn", "rebuilds_inside"]

_NAME = "_checkpoint_without_reentrant_generator"
# Parameter lists we know how to call (torch 2.5+ added early_stop before *args).
_WITH_EARLY_STOP = (
    "fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
    "args", "kwargs",
)
_WITHOUT_EARLY_STOP = (
    "fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "args", "kwargs",
)

noop_context_fn: Callable[[], Any] = _tuc.noop_context_fn

#: What every rebuild runs inside besides its frame's own context: a fake profile for
#: another device keeps that device's kernels in backward's rebuilds, which run where a
#: torch-function mode entered around ``backward()`` is off (remat.profiling.device_kernels).
_REBUILD_CONTEXTS: list[Callable[[], AbstractContextManager[Any]]] = []


@contextlib.contextmanager
def rebuilds_inside(factory: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Frames opened inside this block run their rebuilds inside ``factory()`` too."""
    _REBUILD_CONTEXTS.append(factory)
    try:
        yield
    finally:
        _REBUILD_CONTEXTS.remove(factory)


def _with_rebuild_contexts(context_fn: Callable[[], Any],
                           factories: tuple[Callable[[], AbstractContextManager[Any]], ...]
                           ) -> Callable[[], Any]:
    @contextlib.contextmanager
    def rebuilding(rebuild: AbstractContextManager[Any]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(rebuild)
            for factory in factories:
                stack.enter_context(factory())
            yield

    def both() -> tuple[Any, Any]:
        forward, rebuild = context_fn()
        return forward, rebuilding(rebuild)

    return both


_generator: Callable[..., Generator[None, None, None]] | None = None
_fixed_args: tuple[Any, ...] = ()


def check_available() -> None:
    """Raise RematError if this torch lacks the generator or changed its signature."""
    global _generator, _fixed_args
    if _generator is not None:
        return
    fn = getattr(_tuc, _NAME, None)
    if fn is None:
        raise RematError(
            f"torch {torch.__version__} has no torch.utils.checkpoint.{_NAME}, which remat's "
            "runtime is built on; install a torch version remat supports (2.4 to 2.13)"
        )
    params = tuple(inspect.signature(fn).parameters)
    # determinism_check="default", debug=False; early_stop=True is still overridden by
    # torch.utils.checkpoint.set_checkpoint_early_stop, exactly as for checkpoint().
    if params == _WITH_EARLY_STOP:
        _fixed_args = ("default", False, True)
    elif params == _WITHOUT_EARLY_STOP:
        _fixed_args = ("default", False)
    else:
        raise RematError(
            f"torch {torch.__version__} changed the signature of torch.utils.checkpoint.{_NAME} "
            f"to ({', '.join(params)}); remat's runtime does not support this torch version yet"
        )
    _generator = fn


class CheckpointFrame:
    """One open non-reentrant checkpoint whose forward the caller runs between calls.

    ``open(fn, *args)`` starts it (``args`` are saved, and rebuilt saved tensors will come
    from ``fn(*args)``); the caller then runs the forward itself and calls ``close()``,
    or ``abort()`` if that forward failed. Frames nest like ``checkpoint`` calls do and
    must be closed or aborted innermost first: each one pushes saved-tensor hooks.
    """

    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[None, None, None]) -> None:
        self._gen = gen

    @classmethod
    def open(
        cls,
        fn: Callable[..., Any],
        *args: Any,
        context_fn: Callable[[], Any] = noop_context_fn,
        preserve_rng_state: bool = True,
    ) -> CheckpointFrame:
        check_available()
        assert _generator is not None
        if _REBUILD_CONTEXTS:
            context_fn = _with_rebuild_contexts(context_fn, tuple(_REBUILD_CONTEXTS))
        gen = _generator(fn, preserve_rng_state, context_fn, *_fixed_args, *args)
        next(gen)  # pre-forward: stash state, save args, push hooks
        return cls(gen)

    def close(self) -> None:
        """Finish the forward (pops the hooks, marks the frame complete)."""
        try:
            next(self._gen)
        except StopIteration:
            return
        raise RematError(
            f"torch.utils.checkpoint.{_NAME} yielded twice under torch {torch.__version__}; "
            "remat's runtime does not support this torch version yet"
        )

    def abort(self) -> None:
        """Give up on the forward after an exception (pops the hooks); idempotent."""
        self._gen.close()
