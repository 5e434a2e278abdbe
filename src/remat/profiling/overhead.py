"""The fixed cost of one checkpoint region, measured on a chain of tiny stages.

Stages that do almost nothing leave mostly the region's own cost: opening and closing
torch's non-reentrant checkpoint frame, stashing the RNG state, the runtime's
bookkeeping, and the rebuild's call. The chain runs interleaved with and without one
region per stage; the difference per region, less the tiny stage's own rebuild, is the
overhead. Its bytes are what a region keeps in forward beyond its input.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

import remat.plans as plans
from remat.measure import LiveMemoryTracker

__all__ = ["RegionOverhead", "region_overhead"]

_STAGES = 8
_WIDTH = 8


@dataclass(frozen=True)
class RegionOverhead:
    time_s: float
    memory_bytes: int


class _Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones((), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale  # saves its input, like most stages


def _chain(dtype: torch.dtype, device: torch.device | None) -> nn.Sequential:
    return nn.Sequential(*(_Tiny(dtype, device) for _ in range(_STAGES)))


def region_overhead(
    *, dtype: torch.dtype = torch.float32, device: torch.device | None = None, repeats: int = 15
) -> RegionOverhead:
    """Seconds and bytes one single-stage region adds to a training step."""
    from remat.runtime import apply

    model = _chain(dtype, device)
    x = torch.randn(2, _WIDTH, dtype=dtype, device=device, requires_grad=True)
    sync = device is not None and device.type == "cuda"

    def step() -> float:
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        model(x).sum().backward()
        if sync:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def forward_s() -> float:
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        if sync:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    plan = plans.per_stage(model)
    plain, regions, fwd = [], [], []
    base_bytes = _live_after_forward(model, x, device)
    for k in range(repeats + 1):
        t_plain = step()
        handle = apply(model, plan)
        try:
            t_regions = step()
            if k == 0:
                region_bytes = _live_after_forward(model, x, device)
        finally:
            handle.remove()
        t_fwd = forward_s()
        if k:  # the first round warms up both paths
            plain.append(t_plain)
            regions.append(t_regions)
            fwd.append(t_fwd)
    per_region = (statistics.median(regions) - statistics.median(plain)) / _STAGES
    rebuild = statistics.median(fwd) / _STAGES
    return RegionOverhead(
        time_s=max(0.0, per_region - rebuild),
        memory_bytes=max(0, (region_bytes - base_bytes) // _STAGES),
    )


def _live_after_forward(model: nn.Module, x: torch.Tensor, device: torch.device | None) -> int:
    """Bytes a training forward of ``model`` leaves alive beyond the model and ``x``."""
    tracker = LiveMemoryTracker(device=device, track_saved=False, cuda_stats=False)
    tracker.register_existing(model)
    tracker.register_existing(x)
    start = tracker.live_bytes
    with tracker:
        out = model(x)
        kept = tracker.live_bytes - start
        del out
    return kept
