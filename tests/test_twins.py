"""Selective options that are one computation on a stage get one set of figures
(remat.profiling.option_twins): the planner cannot choose between them on noise."""

from __future__ import annotations

import torch

import remat
from remat.core.solve import solvers
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.uncertainty import steadiest
from remat.models.mlp_hetero import mlp_hetero
from remat.profiling.optimes import policy_op_names
from remat.profiling.option_twins import twin_groups

OPTIONS = ("selective:save-matmuls", "selective:save-attention", "selective:save-nothing")


def test_options_saving_the_same_ops_in_a_stage_are_twins_led_by_the_fewest_ops() -> None:
    mlp = frozenset({"aten.addmm.default", "aten.mm.default", "aten.gelu.default"})
    assert "aten.addmm.default" in policy_op_names("selective:save-matmuls", "b")
    # no attention op in an MLP: save-attention saves what save-nothing saves
    assert twin_groups(mlp, "b", OPTIONS) == [
        ["selective:save-matmuls"], ["selective:save-nothing", "selective:save-attention"]]
    # nothing any option saves: all three are one computation
    assert twin_groups(frozenset({"aten.relu.default"}), "b", OPTIONS) == [
        ["selective:save-nothing", "selective:save-attention", "selective:save-matmuls"]]


def test_twin_options_get_one_set_of_figures_and_the_plan_names_the_first() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, batch, loss_fn = mlp_hetero(n_blocks=4, d_model=32, expansion=4, depth=2,
                                       batch_size=8)
    prof = remat.profile(model, batch, loss_fn, repeats=2, options=("keep", *OPTIONS))
    twinned = 0
    for s in prof.stages:
        nothing, attention = "selective:save-nothing", "selective:save-attention"
        assert s.saved_bytes[attention] == s.saved_bytes[nothing]
        assert s.extra_bwd_s[attention] == s.extra_bwd_s[nothing]
        assert s.time_spread.get(f"extra_bwd_s.{attention}") == s.time_spread.get(
            f"extra_bwd_s.{nothing}")
        order = list(s.saved_bytes)
        assert order.index(nothing) < order.index(attention)
        twinned += 1
    assert twinned == len(prof.stages)
    # a budget that needs selective stages: the plan never names save-attention, which
    # is save-nothing under another name on every stage of an MLP
    problem = problem_from_profile(prof)
    least = solvers.minimum_budget(problem)
    budget = (least + prof.measured_peak_bytes) // 2
    plan = steadiest(prof, solvers.optimal(problem, budget))
    assert "selective:save-attention" not in plan.options, plan.options


def test_twin_options_take_one_draw_of_their_times_and_other_options_their_own() -> None:
    """A draw that priced save-attention below save-nothing on the same stages let the
    steadiest-plan rule name save-attention x3 on mlp-hetero (noise_stability, 14:50)."""
    import random

    from remat.core.profile_format import FixedBytes, Profile, StageProfile
    from remat.core.solve.uncertainty import _random, with_times

    nothing, attention, matmuls = ("selective:save-nothing", "selective:save-attention",
                                   "selective:save-matmuls")
    stage = StageProfile(
        "b", 1, 1, {"keep": 8, nothing: 0, attention: 0, matmuls: 4}, fwd_s=0.02, bwd_s=0.04,
        rebuild_s=0.02, extra_bwd_s={nothing: 0.02, attention: 0.02, matmuls: 0.025},
        time_spread={f"extra_bwd_s.{nothing}": (0.010, 0.030),
                     f"extra_bwd_s.{attention}": (0.010, 0.030),
                     f"extra_bwd_s.{matmuls}": (0.015, 0.035)})
    prof = Profile(model="m", batch_size=1, stages=(stage,),
                   fixed=FixedBytes(0, 0, 0, 0, 0, 0, 0))
    rng = random.Random(0)
    drawn = [with_times(prof, _random(rng)).stages[0] for _ in range(20)]
    for s in drawn:  # the twins: one draw
        assert s.extra_bwd_s[nothing] == s.extra_bwd_s[attention]
        assert 0.010 <= s.extra_bwd_s[nothing] <= 0.030
    # save-matmuls, with figures of its own, is drawn on its own
    assert len({round(s.extra_bwd_s[matmuls] - s.extra_bwd_s[nothing], 9) for s in drawn}) > 1
