"""The measuring instruments: exact live-storage memory of a training step, by category.

Where the live-storage tracker cannot look (compiled steps, FSDP2 ranks), the allocator's
events are read instead (:mod:`remat.measure.allocator_events`).
"""

from __future__ import annotations

from remat.measure.records import (
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
