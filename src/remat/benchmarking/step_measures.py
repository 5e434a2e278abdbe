"""The two measurements of a row: its peak memory (by one of two instruments) and its time.

Memory. Eager rows are measured by remat's live-storage tracker
(:func:`remat.measure.measure_step`), which counts each storage once and splits the peak by
category. The tracker is a dispatch mode, and Dynamo does not compile a frame under one:
a compiled model would silently run eagerly and show the eager model's memory. Compiled
rows are therefore measured from the allocator events of
``torch.profiler.profile(profile_memory=True)``: the bytes alive when the step starts
(parameters, buffers, optimizer state, batch) plus the running sum of every allocation
and free during the step. Eager rows get that figure too, as a cross-check.

Time. All rows step in one process after a warm-up, interleaved: each round runs every
row once, in an order rotated by one per round, so a slow spell of the shared machine
falls on every row alike. Figures are medians; overheads are medians of per-round ratios.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat.measure import measure_step
from remat.measure.allocator_events import AllocatorEvents
from remat.measure.rounds import interleaved
from remat.measure.tracker import iter_tensors

from .runners import Runner

__all__ = [
    "MemoryMeasure",
    "TimeStats",
    "by_profiler",
    "by_tracker",
    "interleaved",
    "paired",
    "time_stats",
]

#: Timelines are kept at most this many points (the maximum of each bin, so peaks stay).
TIMELINE_POINTS = 1500


@dataclass(frozen=True)
class MemoryMeasure:
    """The peak of one whole training step, which instrument saw it, and its timeline.

    ``timeline`` is ``(fraction of the step, live bytes)`` pairs; ``by_category`` is the
    tracker's split of the peak (None from the profiler, which sees only sizes).
    """

    peak_bytes: int
    instrument: str
    start_bytes: int
    timeline: tuple[tuple[float, int], ...]
    by_category: Mapping[str, int] | None = None
    cuda_allocated_peak_bytes: int | None = None
    cuda_reserved_peak_bytes: int | None = None
    peak_phase: str | None = None  # tracker only: forward, rebuild, backward or optimizer
    peak_module: str | None = None  # tracker only: the module running at the peak


@dataclass(frozen=True)
class TimeStats:
    median_s: float
    min_s: float
    max_s: float
    samples: int


def time_stats(samples: Sequence[float]) -> TimeStats:
    return TimeStats(statistics.median(samples), min(samples), max(samples), len(samples))


def _downsample(points: Sequence[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    if len(points) <= TIMELINE_POINTS:
        return tuple(points)
    size = len(points) / TIMELINE_POINTS
    return tuple(
        max(points[int(k * size): max(int((k + 1) * size), int(k * size) + 1)],
            key=lambda p: p[1])
        for k in range(TIMELINE_POINTS)
    )


def _device(runner: Runner) -> torch.device:
    first = next(runner.model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def by_tracker(runner: Runner) -> MemoryMeasure:
    """The row's step measured by the live-storage tracker (eager rows only)."""
    with runner.context():
        step = measure_step(
            runner.model, runner.batch, runner.loss_fn, runner.optimizer, timeline=True
        )
    events = step.timeline or ()
    last = max(1, len(events) - 1)
    timeline = _downsample([(k / last, e.live_bytes) for k, e in enumerate(events)])
    return MemoryMeasure(
        peak_bytes=step.peak_bytes,
        instrument="tracker",
        start_bytes=step.start_bytes,
        timeline=timeline,
        by_category={
            name.removesuffix("_bytes"): int(value)
            for name, value in dataclasses.asdict(step.peak_by_category).items()
        },
        cuda_allocated_peak_bytes=step.cuda_allocated_peak_bytes,
        cuda_reserved_peak_bytes=step.cuda_reserved_peak_bytes,
        peak_phase=None if step.peak_phase is None else step.peak_phase.value,
        peak_module=step.peak_module_path or None,
    )


def _alive_bytes(device: torch.device, *objects: Any) -> int:
    """Bytes of the distinct storages on ``device`` that the objects' tensors hold."""
    seen: dict[int, int] = {}
    for obj in objects:
        for t in iter_tensors(obj):
            if t.device == device:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def by_profiler(runner: Runner, *, warmup: bool = True) -> MemoryMeasure:
    """The row's step measured by torch.profiler's allocator events (any row)."""
    device = _device(runner)
    if warmup:  # so optimizer state exists, as in measure_step
        runner.step()
    runner.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    state = [t for s in runner.optimizer.state.values() for t in iter_tensors(s)]
    start = _alive_bytes(
        device, list(runner.model.parameters()), list(runner.model.buffers()), state, runner.batch
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    recording = AllocatorEvents(torch.device("cuda", device.index or 0) if cuda else device)
    try:
        with recording:
            with runner.context():
                loss = runner.loss()
                loss.backward()
                del loss
                runner.optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
    finally:
        runner.optimizer.zero_grad(set_to_none=True)
    events = recording.events
    live, peak, points = start, start, [(0.0, start)]
    t0 = events[0][0] if events else 0
    span = max(1, events[-1][0] - t0) if events else 1
    for t, nbytes in events:
        live += nbytes
        peak = max(peak, live)
        points.append(((t - t0) / span, live))
    return MemoryMeasure(
        peak_bytes=peak,
        instrument="torch.profiler",
        start_bytes=start,
        timeline=_downsample(points),
        cuda_allocated_peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        cuda_reserved_peak_bytes=torch.cuda.max_memory_reserved(device) if cuda else None,
    )


def paired(ours: Sequence[float], base: Sequence[float]) -> tuple[float, float]:
    """Median of per-round ratios ``ours / base`` and of differences ``ours - base``."""
    ratios = [a / b for a, b in zip(ours, base, strict=True) if b > 0]
    diffs = [a - b for a, b in zip(ours, base, strict=True)]
    return statistics.median(ratios), statistics.median(diffs)
