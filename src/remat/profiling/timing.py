"""Timed training steps: each stage's forward, backward and rebuild, by hooks.

A stage's forward is timed from its forward pre-hook to its forward hook. Its backward
runs from the moment its output's gradient is ready (a tensor hook on the output) to the
moment its input's gradient is ready or, for a stage whose input needs no gradient, its
last parameter gradient is accumulated. With a plan applied whose regions each hold one
stage, backward calls the stage's forward again to rebuild it: the forward hooks then
time the rebuild, which torch may stop early once backward has what it needs. The time
from one stage's return to the next one's call (the model's code between them) is timed
too, in forward and in a rebuild that runs both (Note [Each link its own cost] in
:mod:`.optimes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.plan_format import Plan
from remat.profiling._tensors import main_input, main_output, stage_hooks

__all__ = ["StepTimes", "bare_step_s", "timed_steps"]


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one timed step, in total and per stage."""

    step_s: float
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]  # includes the rebuild when the stage was checkpointed
    rebuild_s: tuple[float, ...]
    # per stage: the model's code before it, from the previous stage's return to its call,
    # in forward and in a rebuild that ran the previous stage right before it (0: none)
    gap_s: tuple[float, ...] = ()
    rebuild_gap_s: tuple[float, ...] = ()


# Note [Backward of a call-stage ends at its input's gradient]
# A module the forward calls several times is several stages, one per call (Note [Stages
# that are calls of one module] in remat.core.stage_names). Its parameters are one set of
# tensors: autograd sums their gradient over all the calls and accumulates it once, after
# the backward of the first call, which backward reaches last. A parameter's
# post-accumulate hook therefore marks the end of the first call-stage's backward only;
# the later call-stages' backward ends when their input's gradient is ready (their input
# is the previous call's output, or made from it, so it needs one), and their parameters
# get no hook here.
def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class _StageClock:
    """The per-stage times of the step running, written by the stage hooks and the
    gradient hooks they register; :meth:`reset` before each step."""

    def __init__(self, n: int, device: torch.device | None) -> None:
        self.n = n
        self.device = device
        self.sync = device is not None and device.type == "cuda"
        self.fwd = [0.0] * n
        self.rebuild = [0.0] * n
        self.gap = [0.0] * n
        self.rebuild_gap = [0.0] * n
        self.bwd_start = [0.0] * n
        self.bwd_end = [0.0] * n
        # the last stage to return, and when: in forward, and in backward (its rebuild)
        self.returned = {False: (-1, 0.0), True: (-1, 0.0)}
        self.started: dict[int, float] = {}

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        for slot in (self.fwd, self.rebuild, self.bwd_start, self.bwd_end, self.gap,
                     self.rebuild_gap):
            slot[:] = [0.0] * self.n
        self.returned[False] = self.returned[True] = (-1, 0.0)

    def grad_ready(self, slot: list[float], i: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            slot[i] = max(slot[i], self.now())

        return hook

    def backward_ended(self, i: int) -> None:
        self.bwd_end[i] = max(self.bwd_end[i], self.now())

    def pre(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        backward = _in_backward()
        if not backward:
            x = main_input(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(self.grad_ready(self.bwd_end, i))
        self.started[i] = now = self.now()
        last, when = self.returned[backward]
        if last == i - 1 and i > 0:
            (self.rebuild_gap if backward else self.gap)[i] += now - when

    def post(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        now = self.now()
        elapsed = now - self.started.pop(i)
        backward = _in_backward()
        self.returned[backward] = (i, now)
        if backward:
            self.rebuild[i] += elapsed
            return
        self.fwd[i] += elapsed
        y = main_output(out)
        if y is not None and y.requires_grad:
            y.register_hook(self.grad_ready(self.bwd_start, i))

    def times(self, step_s: float) -> StepTimes:
        return StepTimes(
            step_s=step_s,
            fwd_s=tuple(self.fwd),
            bwd_s=tuple(
                max(0.0, e - s) if s else 0.0
                for s, e in zip(self.bwd_start, self.bwd_end, strict=True)
            ),
            rebuild_s=tuple(self.rebuild),
            gap_s=tuple(self.gap),
            rebuild_gap_s=tuple(self.rebuild_gap),
        )


def _parameter_hooks(modules: Sequence[nn.Module], clock: _StageClock) -> list[Any]:
    """Hooks that end a stage's backward when its parameters' gradients accumulate."""
    handles = []
    for i, module in enumerate(modules):
        if any(m is module for m in modules[:i]):
            continue  # Note [Backward of a call-stage ends at its input's gradient]
        for p in module.parameters():
            if p.requires_grad:
                handles.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: clock.backward_ended(i)
                    )
                )
    return handles


def _timed_step(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                optimizer: torch.optim.Optimizer, clock: _StageClock,
                on_step: Callable[[], None] | None) -> StepTimes:
    clock.reset()
    t0 = clock.now()
    loss = loss_fn(model, batch)
    loss.backward()
    del loss
    optimizer.step()
    step_s = clock.now() - t0
    if on_step is not None:
        on_step()  # gradients and optimizer state exist right now
    optimizer.zero_grad(set_to_none=True)
    return clock.times(step_s)


def timed_steps(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: torch.optim.Optimizer,
    modules: Sequence[nn.Module],
    *,
    steps: int,
    plan: Plan | None = None,
    device: torch.device | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[StepTimes]:
    """Run ``steps`` training steps (forward, backward, optimizer) and time each.

    ``on_step()`` runs after each step while gradients and optimizer state exist.
    """
    from remat.runtime import apply

    clock = _StageClock(len(modules), device)
    handles = _parameter_hooks(modules, clock)
    applied = apply(model, plan) if plan is not None else None
    try:
        with stage_hooks(modules, clock.pre, clock.post):
            return [_timed_step(model, batch, loss_fn, optimizer, clock, on_step)
                    for _ in range(steps)]
    finally:
        if applied is not None:
            applied.remove()
        for handle in handles:
            handle.remove()


def bare_step_s(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                optimizer: torch.optim.Optimizer, *, device: torch.device | None = None
                ) -> float:
    """Seconds of one plain training step with no hook of remat's: the step a user runs.

    The hooks that time each stage cost the plain step about 1% of its time on the built-in
    gpt (2.4 ms of 221 ms, 30 interleaved rounds) and a checkpointed step nothing
    measurable, which made every plan's overhead look 1.4 points smaller than it runs
    (Note [Paired overhead] in remat/core/solve/paired.py); the step without checkpointing is
    therefore timed bare.
    """
    sync = device is not None and device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss = loss_fn(model, batch)
    loss.backward()
    del loss
    optimizer.step()
    if sync:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    optimizer.zero_grad(set_to_none=True)
    return elapsed

