"""The paired overhead: each profiling round's figures kept, a plan's overhead predicted as the
median of per-round ratios (remat/core/solve/paired.py), and rounds added while it is uncertain."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.core.profile_format import Profile, TimedRound
from remat.core.solve import simulate
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.paired import at_round, paired_overhead, round_overheads
from remat.core.transforms import at_batch_size
from remat.profiling.noise import PAIRED_SE, paired_se
from remat.profiling.profiler import profile
from remat.profiling.timing import StepTimes

N = 4


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


@pytest.fixture(scope="module")
def chain_profile() -> Profile:
    return profile(_Chain(), torch.randn(8, 16), repeats=2)


def _round(fwd: float, bwd: float, rebuild: float, step: float, *, region: float = 0.0,
           outside: float = 0.0) -> TimedRound:
    return TimedRound(step_s=step, fwd_s=(fwd,) * N, bwd_s=(bwd,) * N, rebuild_s=(rebuild,) * N,
                      region_overhead_s=region, outside_chain_s=outside)


def _uneven_rounds() -> tuple[TimedRound, ...]:
    """Round 2 ran twice as slow as round 1 throughout; round 3's rebuilds alone were slow.
    Per round, one region per stage: 4 ms of rebuilds over 12 ms, 8 over 24, 12 over 12."""
    return (_round(0.001, 0.002, 0.001, 0.012), _round(0.002, 0.004, 0.002, 0.024),
            _round(0.001, 0.002, 0.003, 0.012))


def test_the_profile_keeps_each_timed_round_pooled_within_it(chain_profile: Profile) -> None:
    rounds = chain_profile.timed_rounds
    noise = chain_profile.timing_noise
    assert sum(s.same_as is not None for s in chain_profile.stages) >= 2
    assert rounds is not None and noise is not None and len(rounds) == noise.rounds
    for timed in rounds:
        assert len(timed.fwd_s) == N and all(t > 0 for t in timed.fwd_s + timed.rebuild_s)
        # identical blocks: one figure per round for all of them
        for i, stage in enumerate(chain_profile.stages):
            first = i if stage.same_as is None else stage.same_as
            assert (timed.fwd_s[i], timed.rebuild_s[i]) == (timed.fwd_s[first],
                                                            timed.rebuild_s[first])
        assert set(timed.extra_bwd_s) == {o for o in chain_profile.stages[0].extra_bwd_s}
        assert timed.region_link_s is not None  # the residual adds can be spanned
        assert 0 <= timed.region_link_s <= timed.region_overhead_s
    # a stage identical to no other: the profile's median is the median of its rounds
    lone = next(i for i, s in enumerate(chain_profile.stages)
                if s.same_as is None and all(t.same_as != i for t in chain_profile.stages))
    assert chain_profile.stages[lone].fwd_s == pytest.approx(
        statistics.median(r.fwd_s[lone] for r in rounds))
    assert Profile.from_dict(chain_profile.to_dict()).timed_rounds == rounds
    # the step without checkpointing is the one timed without hooks, round by round
    assert chain_profile.step_s == pytest.approx(statistics.median(r.step_s for r in rounds))


def test_a_rounds_figures_price_the_plan_alone(chain_profile: Profile) -> None:
    timed = _round(0.001, 0.002, 0.001, 0.013, region=0.0005, outside=0.001)
    problem = problem_from_profile(at_round(chain_profile, timed))
    assert [s.fwd_s for s in problem.stages] == [0.001] * N
    names = chain_profile.stage_names
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(N)))
    # the step: 4 x (1 + 2) ms + 1 ms outside; per stage: 4 x (1 ms rebuild + 0.5 ms)
    assert simulate(per_stage, problem).step_time_s == pytest.approx(0.013 + 0.006)


def test_the_predicted_overhead_is_the_median_of_per_round_ratios(
    chain_profile: Profile,
) -> None:
    names = chain_profile.stage_names
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(N)))
    paired = replace(chain_profile, timed_rounds=_uneven_rounds())
    assert round_overheads(per_stage, paired) == pytest.approx([1 / 3, 1 / 3, 1.0])
    assert paired_overhead(per_stage, paired) == pytest.approx(1 / 3)
    # the ratio of medians sets round 2's rebuilds (2 ms) against round 1's step: 2/3
    assert paired_overhead(per_stage, replace(chain_profile, timed_rounds=None)) is None
    assert paired_overhead(Plan(names), paired) == 0.0


def test_scaling_to_another_batch_size_drops_the_rounds(chain_profile: Profile) -> None:
    from remat.core.profile_format import LinearFit, Scaling

    scaled = replace(chain_profile, scaling=Scaling((8, 16), {"stages.0.fwd_s": LinearFit(0, 1)}))
    assert at_batch_size(scaled, 8).timed_rounds == chain_profile.timed_rounds
    assert at_batch_size(scaled, 16).timed_rounds is None


def test_a_round_with_the_wrong_number_of_stages_is_refused(chain_profile: Profile) -> None:
    short = TimedRound(step_s=1.0, fwd_s=(1.0,), bwd_s=(1.0,), rebuild_s=(1.0,))
    with pytest.raises(UsageError, match="timed_rounds"):
        replace(chain_profile, timed_rounds=(short,))
    with pytest.raises(UsageError, match="has 2 stages, not 1"):
        TimedRound(step_s=1.0, fwd_s=(1.0,), bwd_s=(1.0, 1.0), rebuild_s=(1.0,))
    data = chain_profile.to_dict()
    data["timed_rounds"] = {"step_s": 1}
    with pytest.raises(UsageError, match="list of round objects"):
        Profile.from_dict(data)


def _steps(step: float) -> StepTimes:
    return StepTimes(step_s=step, fwd_s=(0.0,), bwd_s=(0.0,), rebuild_s=(0.0,))


def test_the_paired_error_shrinks_with_rounds_and_needs_two() -> None:
    plain = [_steps(1.0)] * 8
    assert paired_se(plain[:1], [_steps(1.5)]) == 0.0
    spread = [_steps(x) for x in (1.4, 1.6, 1.5, 1.3, 1.7, 1.5, 1.45, 1.55)]
    four, eight = paired_se(plain[:4], spread[:4]), paired_se(plain, spread)
    assert eight < four
    # eight rounds: quartiles 1.4375 and 1.5625 -> sigma 0.125 / 1.349, over sqrt(8)
    assert eight == pytest.approx(1.2533 * 0.125 / 1.349 / 8 ** 0.5)
    steady = [_steps(1.5)] * 8
    assert paired_se(plain, steady) == 0.0 < PAIRED_SE


def test_bench_rows_predict_their_overhead_as_the_median_of_per_round_ratios(
    chain_profile: Profile,
) -> None:
    from remat.benchmarking.bench_job import _paired_predictions
    from remat.benchmarking.results import Row
    from remat.benchmarking.strategies import RowSpec

    names = chain_profile.stage_names
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(N)))
    rounds = _uneven_rounds()
    rows = {"per-stage": Row("per-stage", predicted_overhead=0.5),
            "none": Row("none", predicted_overhead=0.0), "compile": Row("compile")}
    specs = [RowSpec("per-stage", plan=per_stage), RowSpec("none", plan=Plan(names)),
             RowSpec("compile")]
    _paired_predictions(rows, specs, replace(chain_profile, timed_rounds=rounds))
    assert rows["per-stage"].predicted_overhead == pytest.approx(1 / 3)
    assert rows["none"].predicted_overhead == 0.0
    assert rows["compile"].predicted_overhead is None  # compiled rows are not predicted
    kept = {"per-stage": Row("per-stage", predicted_overhead=0.5)}
    _paired_predictions(kept, specs[:1], replace(chain_profile, timed_rounds=None))
    assert kept["per-stage"].predicted_overhead == 0.5  # no rounds: the medians' ratio
