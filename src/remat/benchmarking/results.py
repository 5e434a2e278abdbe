"""The records a benchmark hands out: rows, findings, the micro-batch comparison, the report.

Every record is a frozen dataclass with ``to_dict()``; the JSON keys are the field names
(documented in ``docs/bench.md``). Bytes are ints, times seconds, ratios plain floats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .environment import Environment

__all__ = ["BenchReport", "Finding", "MicrobatchReport", "MicrobatchRow", "Row"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Row:
    """One strategy at one budget, predicted and measured.

    ``status``: ``ok`` (measured), ``infeasible`` (no plan fits the budget), ``failed``
    (it raised; ``reason`` says what) or ``skipped`` (``reason`` says why).
    """

    strategy: str
    budget: str | None = None
    budget_bytes: int | None = None
    budget_fraction: float | None = None
    matched_to: str | None = None
    status: str = "ok"
    reason: str | None = None
    solver: str | None = None
    regions: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    predicted_overhead: float | None = None
    predicted_rebuild_time_s: float | None = None  # predicted step - predicted plain step
    measured_peak_bytes: int | None = None
    instrument: str | None = None
    profiler_peak_bytes: int | None = None
    peak_by_category: Mapping[str, int] | None = field(default=None, hash=False)
    cuda_allocated_peak_bytes: int | None = None
    cuda_reserved_peak_bytes: int | None = None
    step_time_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    step_times_s: tuple[float, ...] = ()
    overhead: float | None = None
    rebuild_time_s: float | None = None
    grads_match: bool | None = None
    verify_ok: bool | None = None
    grads_max_rel_error: float | None = None
    grads_detail: str | None = None
    grads_rounding_only: bool | None = None  # compile rows that differ: float32 rounding only?
    compile_time_s: float | None = None

    @property
    def key(self) -> str:
        if self.matched_to is not None:
            return f"{self.strategy}@{self.matched_to}"
        return self.strategy if self.budget is None else f"{self.strategy}@{self.budget}"

    @property
    def peak_error(self) -> float | None:
        """``measured / predicted - 1`` of the peak, when both exist."""
        if not self.predicted_peak_bytes or self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1

    @property
    def within_budget(self) -> bool | None:
        if self.budget_bytes is None or self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_by_category"] = (
            None if self.peak_by_category is None else dict(self.peak_by_category)
        )
        data["regions"], data["options"] = list(self.regions), list(self.options)
        data["step_times_s"] = list(self.step_times_s)
        return {
            "key": self.key, **data,
            "peak_error": self.peak_error, "within_budget": self.within_budget,
        }


@dataclass(frozen=True)
class Finding:
    """One figure against its target: ``met`` is None where there is nothing to judge."""

    name: str
    target: str
    statement: str
    met: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MicrobatchRow:
    """A strategy under the comparison's budget: its micro-batch, peak and throughput.

    ``predicted_microbatch`` is the largest micro-batch whose predicted peak fits (for
    ``remat`` its plan is solved again per size; ``remat-best`` is remat at the micro-batch
    with the best predicted samples per second, when that is another one);
    ``microbatch`` the one measurement confirmed (stepped down until the measured peak of a
    whole accumulation step fits).
    """

    strategy: str
    status: str = "ok"
    reason: str | None = None
    predicted_microbatch: int | None = None
    microbatch: int | None = None
    tried: tuple[int, ...] = ()  # the micro-batches measured, in order
    accumulation_steps: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    predicted_samples_per_s: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    regions: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["regions"], data["options"] = list(self.regions), list(self.options)
        data["tried"] = list(self.tried)
        return data


@dataclass(frozen=True)
class MicrobatchReport:
    budget: str
    budget_bytes: int
    global_batch: int
    profiled_batch_sizes: tuple[int, int]
    rows: tuple[MicrobatchRow, ...]
    fastest: str | None
    statement: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "global_batch": self.global_batch,
            "profiled_batch_sizes": list(self.profiled_batch_sizes),
            "rows": [r.to_dict() for r in self.rows],
            "fastest": self.fastest,
            "statement": self.statement,
        }


@dataclass(frozen=True)
class BenchReport:
    """Everything one ``remat bench`` run measured; ``timelines`` are for the plots only."""

    model: str
    environment: Environment
    optimizer: str
    batch_size: int | None
    budgets: tuple[str, ...]
    strategies: tuple[str, ...]
    repeats: int
    warmup: int
    no_checkpoint_peak_bytes: int | None
    rows: tuple[Row, ...]
    findings: tuple[Finding, ...]
    microbatch: MicrobatchReport | None
    compile_status: str
    elapsed_s: float
    command: str | None = None
    timelines: Mapping[str, tuple[tuple[float, int], ...]] = field(
        default_factory=dict, hash=False, repr=False
    )

    def row(self, key: str) -> Row:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "command": self.command,
            "environment": self.environment.to_dict(),
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "budgets": list(self.budgets),
            "strategies": list(self.strategies),
            "repeats": self.repeats,
            "warmup": self.warmup,
            "no_checkpoint_peak_bytes": self.no_checkpoint_peak_bytes,
            "compile_status": self.compile_status,
            "rows": [r.to_dict() for r in self.rows],
            "findings": [f.to_dict() for f in self.findings],
            "microbatch": None if self.microbatch is None else self.microbatch.to_dict(),
            "elapsed_s": self.elapsed_s,
        }
