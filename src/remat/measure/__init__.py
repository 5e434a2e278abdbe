"""The measuring instrument: exact live-storage memory of a training step, by category."""

from __future__ import annotations

from remat.measure.report import (
    Category,
    CategoryBytes,
    Event,
    MemoryReport,
    Phase,
    PhasePeaks,
    StepMemory,
)
from remat.measure.step import measure_step
from remat.measure.tracker import LiveMemoryTracker

__all__ = [
    "Category",
    "CategoryBytes",
    "Event",
    "LiveMemoryTracker",
    "MemoryReport",
    "Phase",
    "PhasePeaks",
    "StepMemory",
    "measure_step",
]
