"""The records the measuring instrument hands out: categories, phases, events, peaks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Category(str, Enum):
    """What a live storage is for. Each storage is in exactly one category at a time."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"


class Phase(str, Enum):
    """Which part of a training step an op ran in."""

    FORWARD = "forward"
    REBUILD = "rebuild"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class CategoryBytes:
    """Live bytes split by category; the fields add up to ``total_bytes``.

    ``activations_bytes`` are storages autograd has saved for backward (or that a rebuild
    produced); ``temporaries_bytes`` is every other storage an op produced.
    """

    parameters_bytes: int = 0
    buffers_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_state_bytes: int = 0
    inputs_bytes: int = 0
    activations_bytes: int = 0
    temporaries_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    def get(self, category: Category) -> int:
        return int(getattr(self, f"{category.value}_bytes"))

    @classmethod
    def from_counts(cls, counts: dict[Category, int]) -> CategoryBytes:
        return cls(**{f"{c.value}_bytes": n for c, n in counts.items()})


@dataclass(frozen=True)
class PhasePeaks:
    """The highest live bytes reached while ops ran in each phase; None if none ran there."""

    forward_bytes: int | None = None
    rebuild_bytes: int | None = None
    backward_bytes: int | None = None
    optimizer_bytes: int | None = None

    def get(self, phase: Phase) -> int | None:
        value: int | None = getattr(self, f"{phase.value}_bytes")
        return value

    @classmethod
    def from_counts(cls, counts: dict[Phase, int]) -> PhasePeaks:
        return cls(**{f"{p.value}_bytes": n for p, n in counts.items()})


@dataclass(frozen=True)
class Event:
    """One step of the timeline: an op (``aten.mm.default``), a ``free``, or a ``register``.

    ``live_bytes`` is the live total right after the event.
    """

    index: int
    name: str
    live_bytes: int
    module_path: str
    phase: Phase


@dataclass(frozen=True)
class MemoryReport:
    """What a ``LiveMemoryTracker`` saw between entering and leaving its ``with`` block."""

    peak_bytes: int
    live_bytes: int
    start_bytes: int
    peak_by_category: CategoryBytes
    live_by_category: CategoryBytes
    phase_peaks: PhasePeaks
    peak_phase: Phase | None
    peak_module_path: str
    peak_event_index: int | None
    timeline: tuple[Event, ...] | None
    timeline_truncated: bool
    cuda_allocated_peak_bytes: int | None
    cuda_reserved_peak_bytes: int | None


@dataclass(frozen=True)
class StepMemory:
    """Memory of one whole training step (forward, backward, optimizer step).

    ``peak_bytes`` is the tracker's exact live-storage peak on the model's device: parameters,
    buffers, gradients, optimizer state, the batch, activations and temporaries.
    ``start_bytes`` is what was live when the step began (parameters, buffers, optimizer
    state, batch; gradients were freed by ``zero_grad(set_to_none=True)``). The CUDA figures
    are the caching allocator's own peaks (allocated; reserved also counts cached blocks),
    reset at the step's start, or None off CUDA.
    """

    peak_bytes: int
    start_bytes: int
    end_bytes: int
    peak_by_category: CategoryBytes
    phase_peaks: PhasePeaks
    peak_phase: Phase | None
    peak_module_path: str
    timeline: tuple[Event, ...] | None
    cuda_allocated_peak_bytes: int | None
    cuda_reserved_peak_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their string values)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
