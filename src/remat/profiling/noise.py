"""The profile's times from its timed rounds: pooled over identical stages, with their noise.

See :mod:`.pooling` for why identical stages are pooled. A profile whose first rounds
disagree by more than :data:`NOISY` times one more set of rounds (at most
:data:`MAX_EXTRA_ROUNDS`), once: more samples move the medians less; then rounds are
added one at a time while the per-round overhead is uncertain (:func:`paired_se`), up to
:data:`MAX_ADDED_ROUNDS` in all. The rounds added are recorded
(``timing_noise.extra_rounds``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from remat.core.profile_format import TimingNoise
from remat.core.solve.uncertainty import NOISY
from remat.profiling.pooling import Pooled, pool, relative_spread, spread_among
from remat.profiling.timing import StepTimes

__all__ = [
    "MAX_ADDED_ROUNDS",
    "MAX_EXTRA_ROUNDS",
    "NOISY",
    "extra_rounds",
    "median_se",
    "option_diffs",
    "option_extras",
    "paired_se",
    "pooled_extras",
    "samples",
    "stage_times",
    "timing_noise",
]

#: At most this many rounds are added at once to a noisy profile.
MAX_EXTRA_ROUNDS = 4

#: At most this many rounds are added in all (Note [Rounds for the paired overhead]).
MAX_ADDED_ROUNDS = 8

#: Rounds are added one at a time while the standard error of the median per-round
#: overhead of one region per stage is above this (Note [Rounds for the paired overhead]).
PAIRED_SE = 0.025

_TIMES = ("fwd_s", "bwd_s")


def samples(steps: Sequence[StepTimes], what: str) -> list[list[float]]:
    """Per stage, its ``what`` (``fwd_s``, ``bwd_s``, ``rebuild_s``) in each round."""
    n = len(steps[0].fwd_s) if steps else 0
    return [[getattr(s, what)[i] for s in steps] for i in range(n)]


def stage_times(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                group_of: Sequence[int]) -> dict[str, list[Pooled]]:
    """``fwd_s`` and ``bwd_s`` from the plain steps, ``rebuild_s`` from the steps with one
    region per stage, each pooled over identical stages."""
    return {
        "fwd_s": pool(samples(plain, "fwd_s"), group_of),
        "bwd_s": pool(samples(plain, "bwd_s"), group_of),
        "rebuild_s": pool(samples(per_stage, "rebuild_s"), group_of),
    }


def option_diffs(plain: Sequence[StepTimes], with_option: Sequence[StepTimes]
                 ) -> list[list[float]]:
    """Per stage, what its forward and backward took under an option beyond the plain step
    of the same round, round by round."""
    if not plain or len(plain) != len(with_option):
        raise ValueError(f"need paired rounds, got {len(plain)} plain and {len(with_option)}")
    n = len(plain[0].fwd_s)
    return [
        [(o.fwd_s[i] + o.bwd_s[i]) - (p.fwd_s[i] + p.bwd_s[i])
         for p, o in zip(plain, with_option, strict=True)]
        for i in range(n)
    ]


def option_extras(plain: Sequence[StepTimes], with_option: Sequence[StepTimes],
                  group_of: Sequence[int], floor_s: float = 0.0) -> list[Pooled]:
    """Per stage: what its forward and backward took under an option beyond the plain step
    of the same round, pooled over identical stages; never below ``floor_s`` (one
    checkpoint frame, see :func:`remat.profiling.optimes.option_extra_s`)."""
    return pooled_extras(option_diffs(plain, with_option), group_of, floor_s)


def pooled_extras(diffs: Sequence[Sequence[float]], group_of: Sequence[int],
                  floor_s: float = 0.0) -> list[Pooled]:
    """Per stage: its rounds' extra times ``diffs`` pooled over identical stages, never
    below ``floor_s``."""
    return [
        Pooled(max(floor_s, x.median), max(floor_s, x.low), max(floor_s, x.high), x.samples)
        for x in pool(diffs, group_of)
    ]


def _median_of_largest(times: Sequence[Sequence[Pooled]]) -> float:
    """The median over stages of each stage's largest relative spread among ``times``."""
    largest = [max(x.relative for x in stage) for stage in zip(*times, strict=True)]
    return float(statistics.median(largest)) if largest else 0.0


def _stage_spread(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                  group_of: Sequence[int]) -> float:
    """``TimingNoise.stage_spread``: rebuild times (from ``per_stage``) included."""
    if not per_stage:
        return _median_of_largest([pool(samples(plain, what), group_of) for what in _TIMES])
    return _median_of_largest(list(stage_times(plain, per_stage, group_of).values()))


def extra_rounds(plain: Sequence[StepTimes], group_of: Sequence[int], repeats: int,
                 others: Sequence[Sequence[StepTimes]] = (),
                 per_stage: Sequence[StepTimes] = ()) -> int:
    """Rounds to add after the first ``repeats``: as many again (at most
    :data:`MAX_EXTRA_ROUNDS`) when the plain steps, the stages' pooled times (their
    rebuilds from ``per_stage``, the steps with one region per stage, included: the
    spread the profile records) or the ``others`` steps (with regions, with an option:
    what a checkpoint's cost is read from) spread more than :data:`NOISY`, else none."""
    step = max(relative_spread([s.step_s for s in steps]) for steps in (plain, *others))
    if max(step, _stage_spread(plain, per_stage, group_of)) <= NOISY:
        return 0
    return min(repeats, MAX_EXTRA_ROUNDS)


def paired_se(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes]) -> float:
    """The standard error of the median over rounds of the step with one region per stage
    over the plain step of the same round (0 below two rounds).

    Note [Rounds for the paired overhead]: the predicted overhead is a median of per-round
    ratios (``remat/core/solve/paired.py``), and its error shrinks with the rounds: on the
    built-in gpt, from a standard deviation of 3.0 points over four rounds to 2.3 over
    eight and 1.5 over twelve. A profile adds rounds, one at a time, while this error of
    the ratio that rebuilds most (one region per stage) is above :data:`PAIRED_SE`, up to
    :data:`MAX_ADDED_ROUNDS` in all and at most as many as it had timed (its timed steps
    at most double: a large model's rounds take minutes). The spread is the interquartile
    range over 1.349 (a normal's sigma; the standard deviation below four rounds), the
    standard error of a median 1.2533 sigma over the root of the rounds (:func:`median_se`).
    """
    return median_se([r.step_s / p.step_s - 1 for p, r in zip(plain, per_stage, strict=True)
                      if p.step_s > 0])


def median_se(ratios: Sequence[float]) -> float:
    """The standard error of the median of ``ratios`` (0 below two): 1.2533 sigma over the
    root of their count, sigma the interquartile range over 1.349 (a normal's; the
    standard deviation below four)."""
    if len(ratios) < 2:
        return 0.0
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        sigma = (q3 - q1) / 1.349
    else:
        sigma = statistics.stdev(ratios)
    return 1.2533 * sigma / len(ratios) ** 0.5


def timing_noise(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                 group_of: Sequence[int], *, extra: int,
                 region_overhead_range_s: tuple[float, float]) -> TimingNoise:
    """What the profile records of its noise (:class:`~remat.core.profile_format.TimingNoise`)."""
    among = max(
        spread_among(samples(steps, what), group_of)
        for steps, what in ((plain, "fwd_s"), (plain, "bwd_s"), (per_stage, "rebuild_s"))
    )
    return TimingNoise(
        rounds=len(plain),
        extra_rounds=extra,
        step_spread=relative_spread([s.step_s for s in plain]),
        stage_spread=_stage_spread(plain, per_stage, group_of),
        identical_spread=among,
        region_overhead_range_s=region_overhead_range_s,
    )
