"""Timings that know their noise: identical stages pooled, the noise recorded, and a plan
checked against it (uncertain when the noise would choose another plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from remat.core.plan_format import Plan, Region
from remat.core.planner import plan as make_plan
from remat.core.profile_format import FixedBytes, Profile, StageProfile, TimingNoise
from remat.core.solve.uncertainty import noise_lines, plan_uncertainty, steadiest, with_times
from remat.profiling.identical import stage_signature
from remat.profiling.noise import MAX_EXTRA_ROUNDS, extra_rounds, option_extras, timing_noise
from remat.profiling.pooling import identical_groups, pool, spread_among
from remat.profiling.profiler import profile
from remat.profiling.timing import StepTimes

pytestmark = pytest.mark.usefixtures("one_thread")
D = 8


class Block(nn.Module):
    def __init__(self, hidden: int = 16, kind: str = "a", layer_idx: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx  # names the layer; does not change its work
        self.lin1 = nn.Linear(D, hidden)
        self.lin2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Chain(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _x(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, D, requires_grad=True)


# -- which stages are identical --------------------------------------------------------------


def test_identical_blocks_share_a_signature_and_different_ones_do_not() -> None:
    x = _x()
    base = stage_signature(Block(), (x,), {})
    assert stage_signature(Block(layer_idx=5), (x,), {}) == base  # its position only
    assert stage_signature(Block(hidden=32), (x,), {}) != base  # other parameter shapes
    assert stage_signature(Block(kind="b"), (x,), {}) != base  # another setting
    assert stage_signature(Block(), (_x(rows=6),), {}) != base  # another input shape
    assert stage_signature(Block(), (x.detach(),), {}) != base  # no input gradient
    assert stage_signature(Block().double(), (x.double(),), {}) != base  # other dtypes


def test_groups_name_the_first_identical_stage() -> None:
    assert identical_groups(["a", "b", "a", None, "b", None]) == [0, 1, 0, 3, 1, 5]


# -- pooling -----------------------------------------------------------------------------------


def test_identical_stages_get_one_median_and_different_ones_keep_theirs() -> None:
    samples = [[1.0, 9.0], [2.0, 3.0], [50.0, 60.0], [4.0, 5.0]]
    pooled = pool(samples, [0, 0, 2, 0])
    # stages 0, 1, 3 pool 1, 9, 2, 3, 4, 5: median 3.5; stage 2 alone: 55
    assert [p.median for p in pooled] == [3.5, 3.5, 55.0, 3.5]
    assert pooled[0].samples == 6 and pooled[2].samples == 2
    assert (pooled[2].low, pooled[2].high) == (50.0, 60.0)  # min and max below four
    assert pool(samples, [0, 1, 2, 3])[0].median == 5.0  # unpooled: its own rounds
    # before pooling, stage 0's own median (5) is 2x stage 1's (2.5)
    assert spread_among(samples, [0, 0, 2, 0]) == pytest.approx(1.0)
    assert spread_among(samples, [0, 1, 2, 3]) == 0.0


def _steps(fwd: list[float], bwd: list[float], step: float = 1.0) -> StepTimes:
    return StepTimes(step_s=step, fwd_s=tuple(fwd), bwd_s=tuple(bwd),
                     rebuild_s=(0.0,) * len(fwd))


def test_an_options_extra_time_is_pooled_over_identical_stages() -> None:
    plain = [_steps([1.0, 1.0], [1.0, 1.0]), _steps([1.0, 1.0], [1.0, 1.0])]
    option = [_steps([1.5, 1.1], [1.0, 1.0]), _steps([1.5, 1.3], [1.0, 1.0])]
    pooled = option_extras(plain, option, [0, 0])
    assert [round(p.median, 6) for p in pooled] == [0.4, 0.4]  # of 0.5, 0.1, 0.5, 0.3
    alone = option_extras(plain, option, [0, 1])
    assert [round(p.median, 6) for p in alone] == [0.5, 0.2]


# -- recording the noise -----------------------------------------------------------------------


def test_a_noisy_first_set_of_rounds_gets_more_and_a_quiet_one_none() -> None:
    quiet = [_steps([1.0, 1.0], [2.0, 2.0], step=5.0) for _ in range(3)]
    assert extra_rounds(quiet, [0, 0], repeats=3) == 0
    noisy = [_steps([1.0, 1.0], [2.0, 2.0], step=s) for s in (5.0, 9.0, 5.5)]
    assert extra_rounds(noisy, [0, 0], repeats=3) == 3
    assert extra_rounds(noisy, [0, 0], repeats=50) == MAX_EXTRA_ROUNDS
    # the stages alone noisy (one of two identical stages slow in one round)
    stages = [_steps([1.0, 4.0], [2.0, 2.0], step=5.0), _steps([1.0, 1.0], [2.0, 2.0], step=5.0)]
    assert extra_rounds(stages, [0, 0], repeats=2) == 2
    # the plain steps quiet, the steps a checkpoint's cost is read from noisy
    rebuilt = [_steps([1.0, 1.0], [2.0, 2.0], step=s) for s in (6.0, 11.0, 6.5)]
    assert extra_rounds(quiet, [0, 0], repeats=3, others=[rebuilt]) == 3
    assert extra_rounds(quiet, [0, 0], repeats=3, others=[quiet]) == 0
    # the stages' rebuilds noisy with their steps quiet (what a region's cost is read from;
    # a gpt run predicted +38.9% against +32.8% measured on 2 rounds 29% apart)
    def rebuilt_in(r: float) -> StepTimes:
        return StepTimes(step_s=6.0, fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), rebuild_s=(r, r))

    noisy_rebuilds = [rebuilt_in(r) for r in (1.0, 1.6, 1.05)]
    quiet_rebuilds = [rebuilt_in(r) for r in (1.0, 1.02, 1.01)]
    assert extra_rounds(quiet, [0, 0], repeats=3, per_stage=noisy_rebuilds) == 3
    assert extra_rounds(quiet, [0, 0], repeats=3, per_stage=quiet_rebuilds) == 0


def test_timing_noise_records_rounds_spreads_and_identical_stages() -> None:
    plain = [_steps([1.0, 3.0], [2.0, 2.0], step=10.0), _steps([1.0, 3.0], [2.0, 2.0], step=12.0)]
    noise = timing_noise(plain, plain, [0, 0], extra=1, region_overhead_range_s=(0.1, 0.2))
    assert noise.rounds == 2 and noise.extra_rounds == 1
    assert noise.step_spread == pytest.approx(2 / 11)
    assert noise.identical_spread == pytest.approx(2.0)  # stage 1 timed 3x stage 0
    assert noise.stage_spread > 0  # 1 and 3 pooled
    unpooled = timing_noise(plain, plain, [0, 1], extra=0, region_overhead_range_s=(0.1, 0.2))
    assert unpooled.identical_spread == 0.0 and unpooled.stage_spread == 0.0


@pytest.fixture(scope="module")
def mixed_profile() -> Profile:
    """Three identical blocks and a wider one."""
    model = Chain([Block(layer_idx=0), Block(layer_idx=1), Block(layer_idx=2), Block(hidden=64)])
    return profile(model, _x(), repeats=2, options=("keep", "selective:save-nothing"))


def test_a_profile_pools_identical_stages_and_records_its_noise(mixed_profile: Profile) -> None:
    stages = mixed_profile.stages
    assert [s.same_as for s in stages] == [None, 0, 0, None]
    for what in ("fwd_s", "bwd_s", "rebuild_s"):
        assert getattr(stages[1], what) == getattr(stages[0], what) == getattr(stages[2], what)
    assert stages[1].extra_bwd_s == stages[0].extra_bwd_s
    assert stages[3].fwd_s != stages[0].fwd_s  # not pooled with the others
    for s in stages:
        for what in ("fwd_s", "bwd_s", "rebuild_s"):
            low, high = s.time_spread[what]
            assert low <= getattr(s, what) <= high
        assert "extra_bwd_s.selective:save-nothing" in s.time_spread
    noise = mixed_profile.timing_noise
    assert noise is not None
    assert noise.rounds == 2 + noise.extra_rounds
    assert noise.region_overhead_range_s[0] <= mixed_profile.region_overhead_s
    assert noise.region_overhead_range_s[1] >= mixed_profile.region_overhead_s
    data = json.loads(mixed_profile.to_json())
    assert data["stages"][1]["same_as"] == 0 and "same_as" not in data["stages"][0]
    assert Profile.from_dict(data) == mixed_profile
    assert noise_lines(mixed_profile)[0].startswith(f"timing noise: {noise.rounds} rounds")
    assert "3 identical stages in 1 group(s)" in noise_lines(mixed_profile)[0]


def test_the_noisy_timing_warning_suggests_one_thread_only_where_more_ran(
    mixed_profile: Profile,
) -> None:
    import dataclasses

    assert mixed_profile.timing_noise is not None
    noisy = dataclasses.replace(mixed_profile, timing_noise=dataclasses.replace(
        mixed_profile.timing_noise, step_spread=0.5))
    many, one = noise_lines(noisy)[-1], noise_lines(noisy, one_thread=True)[-1]
    assert many.startswith("warning: the timings are noisy") and "--threads 1" in many
    assert one.startswith("warning: the timings are noisy") and "--threads 1" not in one
    assert "torch ran on one thread already" in one


def test_a_profile_without_the_noise_fields_still_loads(mixed_profile: Profile) -> None:
    data = json.loads(mixed_profile.to_json())
    del data["timing_noise"]
    for stage in data["stages"]:
        stage.pop("same_as", None)
        del stage["time_spread"]
    old = Profile.from_dict(data)
    assert old.timing_noise is None and all(s.same_as is None for s in old.stages)
    assert noise_lines(old) == []
    plan = make_plan(old, None, "per-stage")
    assert plan_uncertainty(old, plan) is None  # nothing to check it against


def test_bad_noise_fields_are_refused_in_one_sentence(mixed_profile: Profile) -> None:
    from remat.core.errors import UsageError

    data = json.loads(mixed_profile.to_json())
    data["stages"][0]["time_spread"]["fwd_s"] = [2.0, 1.0]
    with pytest.raises(UsageError, match="low above high"):
        Profile.from_dict(data)
    with pytest.raises(UsageError, match="rounds"):
        TimingNoise(rounds=-1)


# -- the plan against the noise ----------------------------------------------------------------


def _two_way(rebuild_spread: float, first: float = 1.0, second: float = 1.1) -> Profile:
    """Four stages of which one must be checkpointed: stage 0 rebuilds in ``first`` s,
    stage 1 in ``second`` s, stages 2 and 3 in 5 s; each rebuild known to
    +-``rebuild_spread``."""
    rebuild = [first, second, 5.0, 5.0]
    stages = tuple(
        StageProfile(
            name=f"s{i}", boundary_bytes=100, output_bytes=100, saved_bytes={"keep": 1000},
            fwd_s=1.0, bwd_s=1.0, rebuild_s=r,
            time_spread={"fwd_s": (0.99, 1.01), "bwd_s": (0.99, 1.01),
                         "rebuild_s": (r - rebuild_spread, r + rebuild_spread)},
        )
        for i, r in enumerate(rebuild)
    )
    fixed = FixedBytes(params_bytes=0, buffers_bytes=0, grads_bytes=0, optimizer_state_bytes=0,
                       inputs_bytes=0, pre_chain_bytes=0, post_chain_bytes=0)
    return Profile(model="two-way", batch_size=1, stages=stages, fixed=fixed,
                   timing_noise=TimingNoise(rounds=5, stage_spread=rebuild_spread))


def _budget(profile: Profile) -> int:
    """A budget one single-stage region over stage 0 or 1 fits and no checkpointing does not."""
    from remat.core.solve import simulate
    from remat.core.solve.from_profile import problem_from_profile

    problem = problem_from_profile(profile)
    peaks = [simulate(Plan(profile.stage_names, (Region(i, i + 1),)), problem).peak_bytes
             for i in (0, 1)]
    assert peaks[0] == peaks[1]
    none = simulate(Plan(profile.stage_names), problem).peak_bytes
    assert none > peaks[0]  # something must be checkpointed
    return (peaks[0] + none) // 2  # one single-stage region fits, no checkpointing does not


def test_a_plan_the_noise_would_flip_is_reported_uncertain() -> None:
    noisy = _two_way(rebuild_spread=0.5)
    chosen = make_plan(noisy, _budget(noisy))
    assert chosen.regions == (Region(0, 1),)  # on the medians, stage 0 is cheaper
    found = plan_uncertainty(noisy, chosen)
    assert found is not None and found.uncertain
    assert 0 < found.changed <= found.trials
    assert found.regret > 0.01
    assert found.overhead_low < found.overhead < found.overhead_high
    assert found.sentence().startswith("plan uncertain:")
    assert f"{found.overhead_low:+.1%} and {found.overhead_high:+.1%}" in found.sentence()


def test_a_plan_the_noise_cannot_flip_is_not_uncertain() -> None:
    quiet = _two_way(rebuild_spread=0.02)
    chosen = make_plan(quiet, _budget(quiet))
    found = plan_uncertainty(quiet, chosen)
    assert found is not None and not found.uncertain and found.changed == 0
    assert found.trials == 10
    assert found.sentence().startswith("plan stable within the timing noise")
    assert found.overhead_high - found.overhead_low < 0.02


@pytest.mark.parametrize("first, second", [(1.0, 1.03), (1.03, 1.0)])
def test_of_plans_tied_within_the_noise_the_same_one_is_chosen_whichever_the_medians_favour(
    first: float, second: float,
) -> None:
    # 0.03 s apart, against a tie of 1% of the 8 s plain step: one plan as far as the
    # timings can tell; the medians favour either, the choice is the same.
    tied = _two_way(rebuild_spread=0.1, first=first, second=second)
    chosen = make_plan(tied, _budget(tied))
    assert chosen.regions == ((Region(0, 1),) if first < second else (Region(1, 2),))
    steady = steadiest(tied, chosen)
    assert steady.regions == (Region(0, 1),)
    assert steady.budget_bytes == chosen.budget_bytes
    assert steady.predicted_peak_bytes is not None and steady.budget_bytes is not None
    assert steady.predicted_peak_bytes <= steady.budget_bytes


def test_near_neighbours_of_the_chosen_plan_compete_in_the_tie() -> None:
    # A stage may take save-matmuls or save-attention, 0.01 s apart either way on a 4 s
    # plain step: one plan as far as the timings can tell. The re-solves need not find
    # the other (its ranges cover only the rebuild), its neighbour does.
    def tied(matmuls: float, attention: float) -> Profile:
        stages = tuple(
            StageProfile(
                name=f"s{i}", boundary_bytes=100, output_bytes=100,
                saved_bytes={"keep": 1000, "selective:save-matmuls": 100,
                             "selective:save-attention": 100},
                fwd_s=1.0, bwd_s=1.0, rebuild_s=5.0,  # a region costs far more
                extra_bwd_s={"selective:save-matmuls": matmuls,
                             "selective:save-attention": attention},
                time_spread={"rebuild_s": (4.9, 5.1)},
            )
            for i in range(2)
        )
        fixed = FixedBytes(0, 0, 0, 0, 0, 0, 0)
        return Profile(model="tied", batch_size=1, stages=stages, fixed=fixed,
                       timing_noise=TimingNoise(rounds=5, stage_spread=0.1))

    choices = set()
    for matmuls, attention in ((0.10, 0.11), (0.11, 0.10)):
        profile = tied(matmuls, attention)
        from remat.core.solve.from_profile import problem_from_profile

        problem = problem_from_profile(profile)
        both = simulate_peak(profile, ("selective:save-matmuls",) * 2)
        chosen = make_plan(profile, both + 100)  # the first stage selective, the second keeps
        cheaper = "selective:save-matmuls" if matmuls < attention else "selective:save-attention"
        assert chosen.options == (cheaper, "keep")
        choices.add(steadiest(profile, chosen).options)
        assert problem.n == 2
    # one choice, by the fixed rule: the option listed first for the stage
    assert choices == {("selective:save-matmuls", "keep")}


def _region_or_nothing(region_s: float, nothing_s: float, spread: float) -> Profile:
    """Three stages of which one must be rebuilt: by a region over it alone (its rebuild,
    ``region_s``) or by selective save-nothing (``nothing_s`` more backward), each known
    to +-``spread``; stages 1 and 2 cost far more to rebuild either way."""
    stages = tuple(
        StageProfile(
            name=f"s{i}", boundary_bytes=100, output_bytes=100,
            saved_bytes={"keep": 1000, "selective:save-nothing": 0},
            fwd_s=1.0, bwd_s=1.0, rebuild_s=region_s if i == 0 else 5.0,
            extra_bwd_s={"selective:save-nothing": nothing_s if i == 0 else 5.0},
            time_spread={"rebuild_s": (region_s - spread, region_s + spread),
                         "extra_bwd_s.selective:save-nothing": (nothing_s - spread,
                                                                nothing_s + spread)}
            if i == 0 else {},
        )
        for i in range(3)
    )
    fixed = FixedBytes(0, 0, 0, 0, 0, 0, 0)
    return Profile(model="region-or-nothing", batch_size=1, stages=stages, fixed=fixed,
                   timing_noise=TimingNoise(rounds=5, stage_spread=spread))


@pytest.mark.parametrize("region_s, nothing_s, spread", [
    (1.0, 1.02, 0.005),  # within the tie on the medians; no draw re-solves to the option
    (1.02, 1.0, 0.15),
    (1.0, 1.08, 0.15),  # beyond the tie on the medians; some draws favour the option
])
def test_a_region_over_one_stage_and_a_selective_option_on_it_tie_within_the_noise(
    region_s: float, nothing_s: float, spread: float,
) -> None:
    # Both rebuild stage 0 in its backward; 0.02 to 0.08 s apart on a 6 s plain step: one
    # plan as far as the timings can tell. Whichever the medians favour, the choice is the
    # same: the one without a region.
    from remat.core.solve import simulate
    from remat.core.solve.from_profile import problem_from_profile

    profile = _region_or_nothing(region_s, nothing_s, spread=spread)
    problem = problem_from_profile(profile)
    none = simulate(Plan(profile.stage_names), problem).peak_bytes
    by_region = simulate(Plan(profile.stage_names, (Region(0, 1),)), problem).peak_bytes
    by_option = simulate(Plan(profile.stage_names, (), ("selective:save-nothing", "keep", "keep")),
                         problem).peak_bytes
    budget = max(by_region, by_option)
    assert budget < none
    chosen = make_plan(profile, budget)
    assert (chosen.regions == (Region(0, 1),)) == (region_s < nothing_s)
    steady = steadiest(profile, chosen)
    assert steady.regions == ()
    assert steady.options == ("selective:save-nothing", "keep", "keep")


def test_a_region_clearly_cheaper_than_the_option_is_kept() -> None:
    # 0.6 s cheaper (10% of the plain step), beyond anything the +-0.15 s noise can do
    from remat.core.solve import simulate
    from remat.core.solve.from_profile import problem_from_profile

    profile = _region_or_nothing(1.0, 1.6, spread=0.15)
    problem = problem_from_profile(profile)
    budget = max(simulate(Plan(profile.stage_names, (Region(0, 1),)), problem).peak_bytes,
                 simulate(Plan(profile.stage_names, (), ("selective:save-nothing", "keep",
                                                         "keep")), problem).peak_bytes)
    chosen = make_plan(profile, budget)
    assert chosen.regions == (Region(0, 1),)
    assert steadiest(profile, chosen).regions == (Region(0, 1),)


def _regions_or_nothing(region_s: float, nothing_s: float) -> Profile:
    """Four stages of which two must be rebuilt: stages 0 and 2 cheaply, each by a region
    over it alone (``region_s``) or by selective save-nothing (``nothing_s`` more
    backward), known to +-0.005 s; stages 1 and 3 cost far more to rebuild either way."""
    stages = tuple(
        StageProfile(
            name=f"s{i}", boundary_bytes=100, output_bytes=100,
            saved_bytes={"keep": 1000, "selective:save-nothing": 0,
                         "selective:save-attention": 0},  # a twin of save-nothing
            fwd_s=1.0, bwd_s=1.0, rebuild_s=region_s if i % 2 == 0 else 5.0,
            extra_bwd_s={o: nothing_s if i % 2 == 0 else 5.0
                         for o in ("selective:save-nothing", "selective:save-attention")},
            time_spread={"rebuild_s": (region_s - 0.005, region_s + 0.005),
                         **{f"extra_bwd_s.{o}": (nothing_s - 0.005, nothing_s + 0.005)
                            for o in ("selective:save-nothing", "selective:save-attention")}}
            if i % 2 == 0 else {},
        )
        for i in range(4)
    )
    fixed = FixedBytes(0, 0, 0, 0, 0, 0, 0)
    return Profile(model="regions-or-nothing", batch_size=1, stages=stages, fixed=fixed,
                   timing_noise=TimingNoise(rounds=5, stage_spread=0.005))


@pytest.mark.parametrize("nothing_s, steady_regions", [
    (1.06, ()),  # 0.75 points a stage, 1.5 for both: beyond the tie, within 1 a stage
    (1.1, (Region(0, 1), Region(2, 3))),  # 1.25 points a stage: the regions are cheaper
    (1.2, (Region(0, 1), Region(2, 3))),  # 2.5 points a stage: trading one is not a tie
])
def test_regions_over_single_stages_are_one_computation_with_save_nothing_on_them(
    nothing_s: float, steady_regions: tuple[Region, ...],
) -> None:
    # Two single-stage regions against save-nothing on both stages: the same ops rebuilt
    # in the same backwards, priced by two instruments whose gap moves from one profile
    # to the next (mlp-hetero: -1.1 to +1.3 points over 20 profiles). The draws are too
    # narrow to favour either, and trading one region at a time never reaches the other
    # plan: both are traded at once and tie up to a point a stage traded, not beyond
    # (save-nothing runs under the selective-checkpoint dispatch mode; a region does not).
    from remat.core.solve import simulate
    from remat.core.solve.from_profile import problem_from_profile
    from remat.core.solve.uncertainty import TIE, _one_computation

    profile = _regions_or_nothing(1.0, nothing_s)
    problem = problem_from_profile(profile)
    names = profile.stage_names
    by_regions = Plan(names, (Region(0, 1), Region(2, 3)))
    by_options = Plan(names, (), ("selective:save-nothing", "keep") * 2)
    by_twins = Plan(names, (), ("selective:save-attention", "keep") * 2)
    assert (_one_computation(by_regions, problem) == _one_computation(by_options, problem)
            == _one_computation(by_twins, problem))
    assert _one_computation(Plan(names, (Region(0, 3),)), problem) != _one_computation(
        by_options, problem)
    peaks = [simulate(p, problem).peak_bytes for p in (by_regions, by_options)]
    budget = max(peaks)
    one_fewer = Plan(names, (Region(0, 1),))
    assert simulate(one_fewer, problem).peak_bytes > budget  # both stages must be rebuilt
    chosen = make_plan(profile, budget)
    assert chosen.regions == (Region(0, 1), Region(2, 3))  # cheaper on the medians
    base = simulate(Plan(names), problem).step_time_s
    apart = (simulate(by_options, problem).step_time_s
             - simulate(by_regions, problem).step_time_s) / base
    assert apart > TIE
    assert apart <= 2 * TIE if not steady_regions else apart > 2 * TIE
    steady = steadiest(profile, chosen)
    assert steady.regions == steady_regions
    traded = {r.start for r in chosen.regions} - {r.start for r in steady_regions}
    assert steady.options == tuple("selective:save-nothing" if i in traded else "keep"
                                   for i in range(4))
    # the noise check agrees with the rule: what it traded for is no change
    found = plan_uncertainty(profile, steady)
    assert found is not None and not found.uncertain


def simulate_peak(profile: Profile, options: tuple[str, ...]) -> int:
    from remat.core.solve import simulate
    from remat.core.solve.from_profile import problem_from_profile

    return simulate(Plan(profile.stage_names, (), options),
                    problem_from_profile(profile)).peak_bytes


def test_a_plan_faster_beyond_the_tie_is_kept_over_a_simpler_one() -> None:
    # stage 1's rebuild is 0.5 s cheaper (6% of the plain step): not a tie
    clear = _two_way(rebuild_spread=0.1, first=1.5, second=1.0)
    chosen = make_plan(clear, _budget(clear))
    assert chosen.regions == (Region(1, 2),)
    assert steadiest(clear, chosen).regions == (Region(1, 2),)


def test_identical_stages_draw_their_times_together() -> None:
    base = _two_way(rebuild_spread=0.5)
    stages = list(base.stages)
    stages[1] = StageProfile(**{**stages[1].__dict__, "rebuild_s": 1.0, "same_as": 0,
                                "time_spread": stages[0].time_spread})
    grouped = Profile(**{**base.__dict__, "stages": tuple(stages)})
    calls = iter(range(1, 100))
    drawn = with_times(grouped, lambda _what, _low, _mid, _high: float(next(calls)))
    assert drawn.stages[0].rebuild_s == drawn.stages[1].rebuild_s
    assert drawn.stages[2].rebuild_s != drawn.stages[3].rebuild_s


def test_the_uncertainty_check_imports_no_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import remat.core.solve.uncertainty\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules"
        " if sys.modules[m] is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
