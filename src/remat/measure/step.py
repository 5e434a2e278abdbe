"""measure_step: the memory of one whole training step, after a warm-up step."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.profile_format import OPTIMIZERS
from remat.measure.records import Phase, StepMemory
from remat.measure.tracker import LiveMemoryTracker, iter_tensors

__all__ = ["measure_step"]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad; UsageError where there are none (no training
    step to measure)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError("the model has no parameters that require grad, so there is no "
                         "training step to measure; unfreeze the parameters you train")
    return params


def make_optimizer(
    model: nn.Module, optimizer: str | torch.optim.Optimizer, *, lr: float = 1e-3,
    foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """``optimizer`` itself, or a new one by name: ``adamw`` (AdamW), ``adamw-fused``
    (AdamW's fused kernel: no temporaries in the step), ``sgd`` (momentum 0.9).

    ``foreach``: torch's multi-tensor implementation (None: torch's default, which takes
    it where every parameter is on an accelerator and the loop on the CPU).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    params = trainable_parameters(model)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    raise UsageError(
        f"optimizer {optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)} "
        "or pass a torch.optim.Optimizer"
    )


def checked_loss(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]
) -> torch.Tensor:
    """``loss_fn(model, batch)``, checked to be a scalar loss that requires grad."""
    loss = loss_fn(model, batch)
    check_loss(loss)
    if not loss.requires_grad:
        raise UsageError(NO_GRAD)
    return loss


NO_GRAD = ("loss_fn returned a loss that does not require grad (detached, computed under "
            "torch.no_grad(), or from no parameter that requires grad); return the loss "
            "tensor the forward computed, with trainable parameters")


def check_loss(loss: Any) -> None:
    """UsageError unless ``loss`` is a one-element tensor (and, with grad enabled, one
    that requires grad): the boundary where a wrong ``loss_fn`` is named, before
    ``backward`` raises torch's own error deep inside a measurement."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"loss_fn returned {type(loss).__name__}; it must run the forward "
                         "and return the scalar loss tensor")
    if loss.numel() != 1:
        raise UsageError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must "
                         "return the scalar loss (reduce it, e.g. with .mean())")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise UsageError(NO_GRAD)


def checking_loss(loss_fn: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
    """``loss_fn`` whose every result goes through :func:`check_loss`."""
    @functools.wraps(loss_fn)
    def checked(model: nn.Module, batch: Any) -> Any:
        loss = loss_fn(model, batch)
        check_loss(loss)
        return loss

    return checked


def measure_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: str | torch.optim.Optimizer = "adamw",
    *,
    warmup_steps: int = 1,
    lr: float = 1e-3,
    timeline: bool = False,
    max_events: int = 1_000_000,
    call_names: Mapping[nn.Module, Callable[[], str]] | None = None,
) -> StepMemory:
    """Measure one training step: ``loss_fn(model, batch)``, backward, ``optimizer.step()``.

    ``warmup_steps`` full steps run first so optimizer state exists; then gradients are
    freed with ``zero_grad(set_to_none=True)`` and one step is measured with parameters,
    buffers, optimizer state and the batch counted from the start. The model's parameters
    are updated by every step; no hooks are left behind, and gradients are freed at the end.
    ``call_names`` tells the calls of modules the forward calls several times apart in the
    timeline (``LiveMemoryTracker.watch``).
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UsageError(f"warmup_steps={warmup_steps!r} is invalid; give a whole number >= 0")
    opt = make_optimizer(model, optimizer, lr=lr)
    first = next(model.parameters(), None)
    device = first.device if first is not None else None

    for _ in range(warmup_steps):
        checked_loss(model, batch, loss_fn).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    gc.collect()  # garbage from the warm-up must not be freed, uncounted, mid-measurement

    tracker = LiveMemoryTracker(device=device, timeline=timeline, max_events=max_events)
    tracker.register_existing(model)
    tracker.register_existing(opt)
    tracker.register_existing(list(iter_tensors(batch)))
    tracker.watch(model, call_names=call_names)
    tracker.watch(opt)
    try:
        with tracker:
            with tracker.phase(Phase.FORWARD):
                loss = checked_loss(model, batch, loss_fn)
            with tracker.phase(Phase.BACKWARD):
                loss.backward()
            del loss
            with tracker.phase(Phase.OPTIMIZER):
                opt.step()
        report = tracker.report()
    finally:
        opt.zero_grad(set_to_none=True)
    return StepMemory(
        peak_bytes=report.peak_bytes,
        start_bytes=report.start_bytes,
        end_bytes=report.live_bytes,
        peak_by_category=report.peak_by_category,
        phase_peaks=report.phase_peaks,
        peak_phase=report.peak_phase,
        peak_module_path=report.peak_module_path,
        timeline=report.timeline,
        cuda_allocated_peak_bytes=report.cuda_allocated_peak_bytes,
        cuda_reserved_peak_bytes=report.cuda_reserved_peak_bytes,
    )
