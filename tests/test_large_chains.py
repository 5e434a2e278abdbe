"""Bounded work on long chains (issue 47, item 6): the nested DP's size is checked before
anything is allocated (Note [The nested DP's bounds] in remat.core.solve.solvers)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import remat
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve import dp, solvers
from remat.core.solve.from_profile import predict_no_checkpoint_peak, problem_from_profile

FIXTURES = Path(__file__).parent / "fixtures"


def repeated(n: int) -> Profile:
    """profile_mlp_tiny's four stages repeated to ``n`` (benchmarks/large_chains.py)."""
    data = json.loads((FIXTURES / "profile_mlp_tiny.json").read_text())
    base = data["stages"]
    stages = []
    for i in range(n):
        stage = {k: v for k, v in base[i % len(base)].items() if k != "input_held_through"}
        stage["name"] = f"blocks.{i}"
        # activations 16 times the measured (batch size 64): they, not the parameter
        # gradients, decide the peak, so 50% needs checkpointing
        stage["boundary_bytes"] = stage["output_bytes"] = base[0]["boundary_bytes"] * 16
        stage["saved_bytes"] = {o: b * 16 for o, b in stage["saved_bytes"].items()}
        stage["selective_bwd_transient_bytes"] = {
            o: b * 16 for o, b in stage["selective_bwd_transient_bytes"].items()}
        for key in ("fwd_transient_bytes", "bwd_transient_bytes", "nosave_transient_bytes"):
            stage[key] *= 16
        stages.append(stage)
    data["stages"] = stages
    profile = Profile.from_dict(data)
    data["measured_peak_bytes"] = data["predicted_peak_bytes"] = \
        predict_no_checkpoint_peak(profile)
    return Profile.from_dict(data)


@pytest.mark.parametrize("n, slots, early_stop", [(3, 10, True), (12, 37, False), (20, 500, True)])
def test_nested_bytes_bounds_the_tables(n: int, slots: int, early_stop: bool) -> None:
    problem = problem_from_profile(repeated(n), slots=slots)
    if not early_stop:
        problem = type(problem).from_dict({**problem.to_dict(), "early_stop": False})
    tables = dp.Tables(dp.Model(problem, 1), slots)
    estimate = dp.nested_bytes(n, slots, early_stop)
    assert tables.nbytes <= estimate <= tables.nbytes + dp.PAIR_SIDE_BYTES * (n + 1) ** 2


def test_nested_bytes_at_thousands_of_stages() -> None:
    # the figures the docs give: 6.2 GB at 1,000 stages, 25 GB at 2,000, 56 GB at 3,000
    assert [round(dp.nested_bytes(n, 500) / 1e9) for n in (1000, 2000, 3000)] == [6, 25, 56]


def test_a_3000_stage_problem_is_refused_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = problem_from_profile(repeated(3000))

    def no_tables(*_: object) -> None:
        raise AssertionError("the tables were allocated")

    monkeypatch.setattr(dp.Tables, "__init__", no_tables)
    monkeypatch.setattr(dp.Model, "__init__", no_tables)
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as err:
        solvers.optimal(problem, "50%", scalable=False)
    assert time.perf_counter() - t0 < 10
    message = str(err.value)
    assert "3,000 stages at 500 slots" in message
    assert "over the limit of" in message
    assert "--slots" in message and "segments-optimal" in message
    assert message.count(".") <= 1 + message.count("GiB") + message.count("e+")  # one sentence


def test_a_3000_stage_problem_plans_with_the_one_level_solver_quickly() -> None:
    profile = repeated(3000)
    t0 = time.perf_counter()
    plan = remat.plan(profile, "50%")
    assert time.perf_counter() - t0 < 20
    assert plan.solver == "segments-optimal"
    assert plan.notes and "3,000 stages" in plan.notes[0]
    assert "segments-optimal planned it" in plan.notes[0]
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).notes == plan.notes


def test_a_2000_stage_problem_plans() -> None:
    profile = repeated(2000)
    t0 = time.perf_counter()
    plan = remat.plan(profile, "50%")
    assert time.perf_counter() - t0 < 20
    assert plan.predicted_peak_bytes is not None and plan.budget_bytes is not None
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.regions  # 50% needs checkpointing


def test_the_memory_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = problem_from_profile(repeated(40))
    assert solvers.nested_check(problem) is None
    assert solvers.optimal(problem, "50%").solver == "optimal"
    monkeypatch.setenv("REMAT_SOLVER_MEMORY", "1MiB")
    assert solvers.solver_memory_limit() == 1 << 20
    too_large = solvers.nested_check(problem)
    assert too_large is not None and "over the limit of 1 MiB" in too_large.sentence()
    plan = solvers.optimal(problem, "50%")
    assert plan.solver == "segments-optimal" and plan.notes
    with pytest.raises(UsageError, match="40 stages at 500 slots"):
        solvers.optimal(problem, "50%", scalable=False)
    # the slots it names fit
    most = int(too_large.fewer.split("--slots ")[1].split()[0])
    assert dp.nested_bytes(40, most) <= 1 << 20 < dp.nested_bytes(40, most + 1)


def test_the_smallest_budget_search_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = problem_from_profile(repeated(3000))
    t0 = time.perf_counter()
    with pytest.raises(UsageError, match="3,000 stages"):
        solvers.minimum_budget(problem)
    assert time.perf_counter() - t0 < 10
