"""Whether a row trains like the plain model: the verify harness, or its comparison for compile.

Rows whose plan remat applies go through :func:`remat.verification.verify` (loss, gradients,
optimizer steps, a short trajectory, rebuilt values, hazards). A compiled model cannot
(the harness applies a plan to a twin, and its value check is a dispatch mode that Dynamo
does not compile under), so a compiled row's first step is compared with the eager model
from the same weights and seed, with the harness's own tensor comparison and tolerances.
The ``hf-gc`` row (transformers' own checkpointing, no remat plan) is compared the same
way with the plain model, over the steps of a short trajectory.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.plan_format import Plan
from remat.measure.step import make_optimizer
from remat.verification.compare import check_tensors
from remat.verification.harness import verify
from remat.verification.tolerance import parse_tolerance
from remat.verification.verify_report import Check

from .runners import Factory, Runner, enable_hf_gc, is_hf_gc

__all__ = ["GradCheck", "check_compiled", "check_hf_gc", "check_plan"]

_GRADIENT_CHECKS = ("loss", "input-gradients", "parameter-gradients")


@dataclass(frozen=True)
class GradCheck:
    """``grads_match``: loss and gradients equal within tolerance; ``verify_ok``: the whole
    harness passed (None for compiled rows, which it cannot run)."""

    grads_match: bool
    verify_ok: bool | None
    max_rel_error: float | None
    detail: str
    rounding_only: bool | None = None  # compiled rows that differ: is float32 rounding all?


def _worst(checks: list[Check]) -> float | None:
    errors = [c.max_rel_error for c in checks if c.max_rel_error is not None]
    return max(errors) if errors else None


def check_plan(
    factory: Factory, plan: Plan, *, optimizer: str, steps: int, seed: int = 0
) -> GradCheck:
    """``remat.verify`` of ``plan`` on a fresh model (``hf-gc``: :func:`check_hf_gc`)."""
    if is_hf_gc(plan):
        return check_hf_gc(factory, optimizer=optimizer, steps=steps, seed=seed)
    model, batch, loss_fn = factory(None)
    report = verify(model, batch, plan, loss_fn, steps=steps, optimizer=optimizer, seed=seed)
    gradient_checks = [c for c in report.checks if c.name in _GRADIENT_CHECKS]
    grads_match = all(c.passed for c in gradient_checks)
    failing = [c for c in report.checks if not c.passed]
    if failing:
        detail = f"{failing[0].name}: {failing[0].message}"
    elif report.blocking_hazards:
        h = report.blocking_hazards[0]
        detail = f"hazard {h.kind}: {h.message}"
    else:
        detail = f"{len(report.checks)} checks over {steps} steps, no hazards"
    return GradCheck(grads_match, report.ok, _worst(gradient_checks), detail)


def _seeded_step(model: nn.Module, run: Callable[[], torch.Tensor], seed: int,
                 context: AbstractContextManager[Any] | None = None) -> torch.Tensor:
    """Forward and backward from ``seed``; both inside ``context`` (inductor may compile
    the backward lazily, at its first call, and must see the same configuration)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), context or contextlib.nullcontext():
        torch.manual_seed(seed)
        loss = run()
        loss.backward()
    return loss.detach()


def _double(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_double(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _double(v) for k, v in obj.items()}
    return obj


def _worst_vs(model: nn.Module, exact: dict[str, nn.Parameter]) -> float:
    """The largest ``max|a - b| / max|b|`` over parameters, against the float64 gradients."""
    worst = 0.0
    for name, p in model.named_parameters():
        ref = exact[name].grad
        if p.grad is None or ref is None or not ref.abs().max():
            continue
        worst = max(worst, float((p.grad.double() - ref).abs().max() / ref.abs().max()))
    return worst


def check_compiled(
    runner: Runner, *, seed: int = 0, reference: nn.Module | None = None
) -> GradCheck:
    """Step 1 of the compiled row against the eager model (call it before any other step).

    The compiled row's first call compiles; the caller times it. When the two differ, one
    eager float64 step from the same state says which of them is further from exact:
    float32 rounding on an ill-conditioned gradient can put eager itself far off, and the
    compiled kernels (another summation order) elsewhere. ``reference``: the eager model
    with the same weights (default: a copy of the row's model; a row whose stages are
    compiled gives its eager twin, since a copy of it would be compiled too).
    """
    if reference is None:
        reference = copy.deepcopy(runner.model)
    exact = copy.deepcopy(reference).double()

    compiled_loss = _seeded_step(runner.model, runner.loss, seed, runner.context())
    eager_loss = _seeded_step(reference, lambda: runner.loss_fn(reference, runner.batch), seed)
    policy = parse_tolerance("auto")
    eager = dict(reference.named_parameters())
    checks = [
        check_tensors("loss", [("loss", compiled_loss, eager_loss)], policy),
        check_tensors(
            "parameter-gradients",
            [(n, p.grad, eager[n].grad) for n, p in runner.model.named_parameters()],
            policy,
            what="parameter gradients",
        ),
    ]
    failing = [c for c in checks if not c.passed]
    detail = "loss and parameter gradients equal eager's (auto tolerance)"
    rounding = None
    if failing:
        batch = _double(runner.batch)
        _seeded_step(exact, lambda: runner.loss_fn(exact, batch), seed)
        ours, theirs = (_worst_vs(m, dict(exact.named_parameters()))
                        for m in (runner.model, reference))
        rounding = ours <= 2 * theirs
        verdict = (
            "no further off than eager's (within 2x): float32 rounding, not another "
            "computation" if rounding else "further off than eager's: another computation"
        )
        detail = (
            f"{failing[0].name}: {failing[0].message}; against an eager float64 step the "
            f"compiled gradients are {ours:.1e} off, eager float32 {theirs:.1e}: {verdict}"
        )
    runner.optimizer.zero_grad(set_to_none=True)
    return GradCheck(not failing, None, _worst(checks), detail, rounding)


def check_hf_gc(factory: Factory, *, optimizer: str, steps: int, seed: int = 0) -> GradCheck:
    """transformers' own checkpointing against the plain model from the same weights.

    Each of ``steps`` steps runs both from the same seed (the same dropout masks, as
    torch's checkpoint replays the RNG state); step 1's loss and parameter gradients and
    the parameters after the last optimizer step are compared (``auto`` tolerance).
    """
    plain, batch, loss_fn = factory(None)
    twin, _, _ = factory(None)
    twin.load_state_dict(plain.state_dict())
    enable_hf_gc(twin)
    plain.train()
    twin.train()
    policy = parse_tolerance("auto")
    optimizers = [make_optimizer(m, optimizer) for m in (plain, twin)]
    checks: list[Check] = []
    for k in range(steps):
        ref = _seeded_step(plain, lambda: loss_fn(plain, batch), seed + k)
        got = _seeded_step(twin, lambda: loss_fn(twin, batch), seed + k)
        if k == 0:
            expected = dict(plain.named_parameters())
            checks.append(check_tensors("loss", [("loss", got, ref)], policy))
            checks.append(
                check_tensors(
                    "parameter-gradients",
                    [(n, p.grad, expected[n].grad) for n, p in twin.named_parameters()],
                    policy,
                    what="parameter gradients",
                )
            )
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    expected = dict(plain.named_parameters())
    checks.append(
        check_tensors(
            "trajectory",
            [(n, p.detach(), expected[n].detach()) for n, p in twin.named_parameters()],
            policy,
            what=f"parameters after {steps} {optimizer} steps",
        )
    )
    gradient_checks = [c for c in checks if c.name in _GRADIENT_CHECKS]
    failing = [c for c in checks if not c.passed]
    detail = (
        f"{failing[0].name}: {failing[0].message}"
        if failing
        else f"loss, gradients and {steps}-step trajectory equal the plain model's"
    )
    return GradCheck(all(c.passed for c in gradient_checks), not failing, _worst(checks), detail)
