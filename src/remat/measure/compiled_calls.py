"""Compiled calls under the live-storage tracker: run compiled, count what they leave.

Note [Compiled calls under the tracker]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The tracker counts storages as ops return them at the dispatcher. A graph compiled by
inductor allocates its buffers below the dispatcher and frees most of them before it
returns, and Dynamo does not run compiled code under a dispatch mode at all (the tracker
runs it eagerly, :mod:`remat.measure.modes`). So a call of a compiled function made
through :func:`call_compiled` under an active tracker is a *window*:

- every dispatch and torch-function mode is taken off the stack for the call and Dynamo's
  stance is ``default``, so the compiled graph runs exactly as it does untracked;
- what the graph leaves behind is counted when it comes out: its outputs, and every
  tensor it saves for backward (a saved-tensors hook wraps whatever hook is on top: the
  tracker's own, or a checkpoint region's, which keeps or drops the tensor as it would);
- what it held only inside (its own buffers) is read from the allocator's events
  (:mod:`remat.measure.allocator_events`) over the call, merged with the frees of storages
  the tracker counted before the events began (the profiler reports no free of a block
  it did not see allocated): the highest point of the running sum, over the live bytes
  at the call's start, is recorded as a moment of temporaries (``LiveMemoryTracker._transient``);
- the backward of the compiled graph (an autograd node ``CompiledFunctionBackward``) is
  a window too, opened and closed by hooks on that node: its buffers come from the
  allocator's events, its gradients are counted as they come out. The tracker's modes stay
  on there (a rebuild of a checkpoint region that the node's saved tensors trigger must be
  counted as usual; a compiled graph's backward is not a Dynamo frame, so the mode does
  not make it eager).

Windows nest (a rebuild inside a compiled backward runs compiled forwards); only the
outermost reads the allocator, and its highest point covers those inside it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.measure.allocator_events import AllocatorEvents, running_peak
from remat.measure.modes import dynamo_stance
from remat.measure.tracker import (
    _MODULE_KEY,
    LiveMemoryTracker,
    _DispatchCounter,
    active_tracker,
    iter_tensors,
)

__all__ = ["call_compiled"]


@dataclass
class _Window:
    first_serial: int  # tracker records made from here on are in the allocator's events
    before: int  # the tracker's live bytes when the window opened
    frees: list[tuple[int, int]] = field(default_factory=list)  # (time_ns, -bytes)
    events: AllocatorEvents | None = None
    depth: int = 1


def _serving(tracker: LiveMemoryTracker | None) -> bool:
    """Whether ``tracker`` is the only mode watching the dispatcher: another mode of
    remat's (a value check, an op recorder) wants the ops, so compiled code runs eagerly
    for it, as before."""
    if tracker is None or tracker._exit_stack is None:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = _get_current_dispatch_mode_stack()
    return (
        len(modes) == 1 and isinstance(modes[0], _DispatchCounter) and modes[0].tracker is tracker
    )


@contextlib.contextmanager
def _modes_off() -> Iterator[None]:
    """Every dispatch and torch-function mode off the stack, Dynamo's stance default."""
    dispatch = []
    while torch._C._len_torch_dispatch_stack() > 0:
        dispatch.append(torch._C._pop_torch_dispatch_stack(None))
    functions = []
    while torch._C._len_torch_function_stack() > 0:
        functions.append(torch._C._pop_torch_function_stack())
    try:
        with dynamo_stance("default"):
            yield
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)
        for mode in reversed(dispatch):
            torch._C._push_on_torch_dispatch_stack(mode)


def _device_of(tracker: LiveMemoryTracker, values: Any) -> torch.device:
    if tracker._device is not None:
        return tracker._device
    for t in iter_tensors(values):
        return t.device
    return torch.device("cpu")


def _open(tracker: LiveMemoryTracker, stack: ExitStack, values: Any) -> _Window:
    """Open a window, or go one deeper into the one open."""
    window: _Window | None = tracker._window
    if window is not None:
        window.depth += 1
        return window
    with tracker._lock:
        window = _Window(first_serial=tracker._serial, before=tracker._live_total)
    # Under another running profiler (they do not nest) no events are read, and the
    # call's own buffers go unseen (documented in docs/compile.md).
    if not torch.autograd.profiler._is_profiler_enabled:
        window.events = stack.enter_context(AllocatorEvents(_device_of(tracker, values)))
    tracker._window = window
    return window


def _close(tracker: LiveMemoryTracker, window: _Window, name: str) -> None:
    """Leave one level; at the outermost, record the window's highest point."""
    window.depth -= 1
    if window.depth:
        return
    tracker._window = None
    events = window.events.events if window.events is not None else []
    merged = sorted([*events, *window.frees])
    highest = window.before + running_peak(0, merged)
    with tracker._lock:
        tracker._transient(highest - tracker._live_total, name)


def call_compiled(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; under an active tracker, run it compiled and count its memory
    (Note [Compiled calls under the tracker]). Untracked, it is a plain call."""
    tracker = active_tracker()
    if tracker is None or not _serving(tracker):
        return fn(*args, **kwargs)
    path = tracker._current_module_path()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)

    def pack(t: torch.Tensor) -> Any:
        tracker._adopt(t)
        return hooks[0](t) if hooks is not None else t.detach()

    def unpack(packed: Any) -> torch.Tensor:
        return hooks[1](packed) if hooks is not None else packed

    with ExitStack() as stack:
        window = _open(tracker, stack, (args, kwargs))
        try:
            with _modes_off(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = fn(*args, **kwargs)
            tracker._adopt(out)
        finally:
            if window.depth == 1:
                stack.close()  # the allocator's events are read before the window closes
            _close(tracker, window, "compiled forward")
    _watch_backward(tracker, out, path)
    return out


def _compiled_nodes(out: Any) -> list[Any]:
    """The compiled graphs' autograd nodes behind ``out`` (through a view node or two)."""
    found: dict[int, Any] = {}
    for t in iter_tensors(out):
        todo = [(t.grad_fn, 0)]
        while todo:
            node, depth = todo.pop()
            if node is None or depth > 2:
                continue
            if "CompiledFunction" in type(node).__name__:
                found.setdefault(id(node), node)
            else:
                todo.extend((n, depth + 1) for n, _ in node.next_functions)
    return list(found.values())


def _watch_backward(tracker: LiveMemoryTracker, out: Any, path: str) -> None:
    ref = weakref.ref(tracker)
    for node in _compiled_nodes(out):
        node.metadata.setdefault(_MODULE_KEY, path)
        state: dict[str, Any] = {}
        node.register_prehook(_backward_enter(ref, state))
        node.register_hook(_backward_exit(ref, state))


def _backward_enter(
    ref: weakref.ref[LiveMemoryTracker], state: dict[str, Any]
) -> Callable[[Any], None]:
    def enter(grad_outputs: Any) -> None:
        tracker = ref()
        if tracker is None or not _serving(tracker):
            return
        stack = ExitStack()
        state["window"] = _open(tracker, stack, grad_outputs)
        state["stack"] = stack
        if tracker._backward_events is None:
            tracker._backward_events = stack

    return enter


def _backward_exit(
    ref: weakref.ref[LiveMemoryTracker], state: dict[str, Any]
) -> Callable[[Any, Any], None]:
    def exit_(grad_inputs: Any, grad_outputs: Any) -> None:
        tracker = ref()
        window = state.pop("window", None)
        stack = state.pop("stack", None)
        if tracker is None or window is None or stack is None:
            return
        if tracker._backward_events is stack:
            tracker._backward_events = None
        if window.depth == 1:
            stack.close()
        tracker._adopt(grad_inputs)
        _close(tracker, window, "compiled backward")

    return exit_
