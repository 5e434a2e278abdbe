"""What ``remat auto`` found: :class:`AutoReport`, and the statistics it is judged by.

The report holds the predicted and measured peaks, the per-pair overheads, the prediction
with its range within the timing noise and, when the first attempt was made again (Note
[Profiling again] in :mod:`.main_job`), the first one beside it. ``problems`` lists
whatever disagrees; ``ok`` is True only when there are none.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.core.coverage import coverage
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve.uncertainty import PlanUncertainty
from remat.core.units import format_bytes

from .environment import Environment
from .findings import PEAK_TOLERANCE

__all__ = ["MEDIANS", "PAIRED", "AutoReport", "FirstAttempt", "apart", "interquartile",
           "problems"]


#: What ``AutoReport.predicted_overhead`` is (Note [Paired overhead]).
PAIRED = "median of the profile's per-round ratios"
MEDIANS = "ratio of the profile's medians"

def interquartile(values: Sequence[float]) -> tuple[float, float]:
    """The interquartile range of ``values`` (min and max below four)."""
    ordered = sorted(values)
    if len(ordered) < 4:
        return ordered[0], ordered[-1]
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return q1, q3


def apart(measured: tuple[float, float], predicted: PlanUncertainty) -> bool:
    """Whether the measured overheads' range and the prediction's range within the timing
    noise do not overlap (Note [Machine state between phases])."""
    low, high = measured
    return high < predicted.overhead_low or low > predicted.overhead_high


@dataclass(frozen=True)
class FirstAttempt:
    """The first prediction and measurement of a run that made both again (Note
    [Profiling again]): the prediction with its range within the profile's timing noise,
    and each interleaved pair's overhead."""

    prediction: PlanUncertainty
    overhead_pairs: tuple[float, ...]
    # the first profile, which the plan was made from (its made_for names its digest)
    profile: Profile = field(repr=False, compare=False)

    @property
    def overhead(self) -> float:
        return float(statistics.median(self.overhead_pairs))

    @property
    def overhead_range(self) -> tuple[float, float]:
        return interquartile(self.overhead_pairs)

    def to_dict(self) -> dict[str, Any]:
        return {"prediction": self.prediction.to_dict(), "overhead": self.overhead,
                "overhead_pairs": list(self.overhead_pairs),
                "overhead_range": list(self.overhead_range)}


@dataclass(frozen=True)
class AutoReport:
    """What ``remat auto`` found; JSON keys are the field names plus ``ok``."""

    model: str
    budget: str
    budget_bytes: int
    plan: Plan
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_peak_event: str
    peak_phase: str | None
    peak_module: str | None
    peak_by_category: Mapping[str, int] = field(hash=False)
    baseline_peak_by_category: Mapping[str, int] = field(hash=False)
    baseline_step_time_s: float = 0.0
    step_time_s: float = 0.0
    overhead: float = 0.0  # the median of the per-pair ratios, less 1
    # the median of the profile's per-round ratios (Note [Paired overhead]), less 1
    predicted_overhead: float | None = None
    verify_ok: bool = False
    grads_match: bool = False
    verify_detail: str = ""
    problems: tuple[str, ...] = ()
    environment: Environment | None = None
    timings_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    elapsed_s: float = 0.0
    profile: Profile | None = field(default=None, repr=False, compare=False)
    # each interleaved pair's ratio, less 1 (``overhead`` is their median)
    overhead_pairs: tuple[float, ...] = ()
    # the chosen plan against the profile's timing noise (None: the profile has none)
    uncertainty: PlanUncertainty | None = None
    # what predicted_overhead is: PAIRED, or the ratio of the medians
    predicted_overhead_statistic: str = MEDIANS
    # Note [Profiling again]: the first prediction and measurement, when they lay apart and
    # both were made again (``profile``, ``predicted_overhead``, ``uncertainty`` and the
    # overheads are then the second's)
    first_attempt: FirstAttempt | None = None

    @property
    def overhead_of_medians(self) -> float:
        """The median step with the plan over the median step without, less 1: another
        statistic than ``overhead`` (the median of per-pair ratios); they part when the
        machine's speed moved during the measurement."""
        return self.step_time_s / self.baseline_step_time_s - 1 if self.baseline_step_time_s \
            else 0.0

    @property
    def overhead_range(self) -> tuple[float, float]:
        """The interquartile range of the per-pair ratios, less 1 (min and max below four)."""
        return interquartile(self.overhead_pairs or [self.overhead])

    @property
    def prediction_disagrees(self) -> bool | None:
        """Whether the measured overhead's interquartile range and the prediction's range
        within the profile's timing noise do not overlap (None without that range).

        Note [Machine state between phases]: on the shared two-core machine, one ``remat
        auto`` on the built-in gpt in ten (benchmarks/noise_stability.md, 2026-12-03)
        profiled while every block's rebuild took 1.25x to 1.37x its forward, in each of
        four rounds (34.5 ms against 27.5 ms, rounds agreeing within a point: predicted
        +46.5%), and measured 11 s later at the usual 1.0x (+38.7%, five of its six pairs
        within 3.5 points). The two instruments each agreed with themselves and not with each other:
        the machine, not the sample, changed. More rounds cannot mend that; saying so
        can."""
        u = self.uncertainty
        if u is None or self.predicted_overhead is None:
            return None
        return apart(self.overhead_range, u)

    @property
    def peak_error(self) -> float:
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "peak_error": self.peak_error,
            "within_budget": self.within_budget,
            "prediction_within_5pct": abs(self.peak_error) <= PEAK_TOLERANCE,
            "predicted_peak_event": self.predicted_peak_event,
            "peak_phase": self.peak_phase,
            "peak_module": self.peak_module,
            "peak_by_category": dict(self.peak_by_category),
            "baseline_peak_by_category": dict(self.baseline_peak_by_category),
            "baseline_step_time_s": self.baseline_step_time_s,
            "step_time_s": self.step_time_s,
            "overhead": self.overhead,
            "overhead_statistic": "median of per-pair ratios",
            "overhead_pairs": list(self.overhead_pairs),
            "overhead_range": list(self.overhead_range),
            "overhead_of_medians": self.overhead_of_medians,
            "predicted_overhead": self.predicted_overhead,
            "predicted_overhead_statistic": self.predicted_overhead_statistic,
            "plan_uncertainty": None if self.uncertainty is None else self.uncertainty.to_dict(),
            "prediction_disagrees": self.prediction_disagrees,
            "first_attempt": (None if self.first_attempt is None
                              else self.first_attempt.to_dict()),
            "timing_noise": (None if self.profile is None or self.profile.timing_noise is None
                             else self.profile.timing_noise.to_dict()),
            "verify_ok": self.verify_ok,
            "grads_match": self.grads_match,
            "verify_detail": self.verify_detail,
            "problems": list(self.problems),
            "plan": self.plan.to_dict(),
            "coverage": None if self.profile is None else coverage(self.profile).to_dict(),
            "environment": None if self.environment is None else self.environment.to_dict(),
            "timings_s": dict(self.timings_s),
            "elapsed_s": self.elapsed_s,
            "error": None,
        }


def problems(budget: int, predicted: int, measured: int, verify_ok: bool,
              detail: str) -> tuple[str, ...]:
    found = []
    if measured > budget:
        found.append(
            f"the measured peak {format_bytes(measured)} is over the budget "
            f"{format_bytes(budget)} by {format_bytes(measured - budget)}"
        )
    error = measured / predicted - 1
    if abs(error) > PEAK_TOLERANCE:
        found.append(
            f"the measured peak is {error:+.1%} off the predicted {format_bytes(predicted)}, "
            "more than 5%"
        )
    if not verify_ok:
        found.append(f"verify failed: {detail}")
    return tuple(found)
