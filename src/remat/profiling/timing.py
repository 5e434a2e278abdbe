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

    sync = device is not None and device.type == "cuda"

    def clock() -> float:
        if sync:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    n = len(modules)
    fwd = [0.0] * n
    rebuild = [0.0] * n
    gap = [0.0] * n
    rebuild_gap = [0.0] * n
    # the last stage to return, and when: in forward, and in backward (its rebuild)
    returned = {False: (-1, 0.0), True: (-1, 0.0)}
    started: dict[int, float] = {}
    bwd_start = [0.0] * n
    bwd_end = [0.0] * n

    def grad_ready(slot: list[float], i: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            slot[i] = max(slot[i], clock())

        return hook

    def pre(i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        backward = _in_backward()
        if not backward:
            x = main_input(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(grad_ready(bwd_end, i))
        started[i] = now = clock()
        last, when = returned[backward]
        if last == i - 1 and i > 0:
            (rebuild_gap if backward else gap)[i] += now - when

    def post(i: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        now = clock()
        elapsed = now - started.pop(i)
        backward = _in_backward()
        returned[backward] = (i, now)
        if backward:
            rebuild[i] += elapsed
            return
        fwd[i] += elapsed
        y = main_output(out)
        if y is not None and y.requires_grad:
            y.register_hook(grad_ready(bwd_start, i))

    handles = []
    for i, module in enumerate(modules):
        if any(m is module for m in modules[:i]):
            continue  # Note [Backward of a call-stage ends at its input's gradient]
        for p in module.parameters():
            if p.requires_grad:
                handles.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: bwd_end.__setitem__(i, max(bwd_end[i], clock()))
                    )
                )
    applied = apply(model, plan) if plan is not None else None
    results = []
    try:
        with stage_hooks(modules, pre, post):
            for _ in range(steps):
                for slot in (fwd, rebuild, bwd_start, bwd_end, gap, rebuild_gap):
                    slot[:] = [0.0] * n
                returned[False] = returned[True] = (-1, 0.0)
                t0 = clock()
                loss = loss_fn(model, batch)
                loss.backward()
                del loss
                optimizer.step()
                step_s = clock() - t0
                if on_step is not None:
                    on_step()  # gradients and optimizer state exist right now
                optimizer.zero_grad(set_to_none=True)
                results.append(
                    StepTimes(
                        step_s=step_s,
                        fwd_s=tuple(fwd),
                        bwd_s=tuple(
                            max(0.0, e - s) if s else 0.0
                            for s, e in zip(bwd_start, bwd_end, strict=True)
                        ),
                        rebuild_s=tuple(rebuild),
                        gap_s=tuple(gap),
                        rebuild_gap_s=tuple(rebuild_gap),
                    )
                )
    finally:
        if applied is not None:
            applied.remove()
        for handle in handles:
            handle.remove()
    return results


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

