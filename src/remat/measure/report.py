"""Moved to :mod:`remat.measure.records`; these names are re-exported so that old imports
keep working."""

from remat.measure.records import (
    Category,
    CategoryBytes,
    Event,
    MemoryReport,
    Phase,
    PhasePeaks,
    StepMemory,
)

__all__ = ["Category", "CategoryBytes", "Event", "MemoryReport", "Phase", "PhasePeaks",
           "StepMemory"]
