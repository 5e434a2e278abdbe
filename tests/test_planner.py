"""remat.core.planner.plan and `remat plan`: budgets, solvers, errors, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan
from remat.core.planner import plan, to_problem
from remat.core.solve import Problem, minimum_budget, simulate

FIXTURES = Path(__file__).parent / "fixtures"
PLAN_KEYS = {
    "solver",
    "budget_bytes",
    "predicted_peak_bytes",
    "predicted_step_time_s",
    "baseline_step_time_s",
    "solve_time_s",
    "stages",
    "regions",
    "options",
}


@pytest.fixture(scope="module")
def hetero() -> Problem:
    return Problem.load(FIXTURES / "chain_hetero_6.json")


def test_optimal_fits_the_budget_and_its_prediction_is_the_simulators(hetero: Problem) -> None:
    result = plan(hetero, "60%")
    assert isinstance(result, Plan)
    assert result.solver == "optimal"
    assert result.budget_bytes is not None
    assert result.predicted_peak_bytes is not None
    assert result.predicted_peak_bytes <= result.budget_bytes
    sim = simulate(result, hetero)
    assert (sim.peak_bytes, sim.step_time_s) == (
        result.predicted_peak_bytes,
        result.predicted_step_time_s,
    )


def test_every_solver_name_and_params(hetero: Problem) -> None:
    assert plan(hetero, None, "none").regions == ()
    assert len(plan(hetero, None, "per-stage").regions) == 6
    assert [(r.start, r.stop) for r in plan(hetero, None, "every-k", k=3).regions] == [
        (0, 1),
        (3, 4),
    ]
    assert len(plan(hetero, None, "segments-k", k=2).regions) == 2
    with pytest.raises(UsageError, match="not known"):
        plan(hetero, "50%", "fastest")
    with pytest.raises(UsageError, match="does not take"):
        plan(hetero, None, "none", k=2)


def test_infeasible_budget_names_the_minimum(hetero: Problem) -> None:
    least = minimum_budget(hetero)
    with pytest.raises(CheckFailed, match="at least that") as info:
        plan(hetero, least - 1)
    assert str(least) in str(info.value)
    assert plan(hetero, least).predicted_peak_bytes == least


def test_slots_override_and_bad_source(hetero: Problem) -> None:
    assert to_problem(hetero, slots=50).slots == 50
    assert to_problem(hetero) is hetero
    with pytest.raises(UsageError, match="expected a remat Profile"):
        to_problem({"stages": []})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "gpt.json"
    args = ["profile", "--set", "n_layer=3", "--set", "n_embd=32", "--set", "seq_len=32"]
    assert main([*args, "--json", str(path)]) == 0
    return path


def test_cli_plan_from_a_profile_writes_the_documented_keys(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--profile", str(profile_path), "--budget", "70%", "--json", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    assert set(data) >= PLAN_KEYS
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]
    assert Plan.from_dict(data).stages == ("blocks.0", "blocks.1", "blocks.2")
    text = capsys.readouterr().out
    assert "predicted peak" in text and "against a budget of" in text


def test_cli_plan_infeasible_exits_1_with_the_minimum(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(profile_path), "--budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert "give a budget of at least" in err and err[-1] == "\n" and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "lots"], "not a size"),
        ([], "needs --budget"),
        (["--solver", "none", "--k", "2"], "--k only applies"),
        (["--budget", "50%", "--model", "gpt"], "--profile already fixes the model"),
    ],
)
def test_cli_plan_usage_errors_exit_2(
    profile_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(profile_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_json_dash_keeps_stdout_pure(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", "--profile", str(profile_path), "--solver", "per-stage", "--json", "-"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["solver"] == "per-stage"


def test_remat_plan_is_the_documented_call_and_stays_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import remat\n"
        "from remat.core.solve import Problem\n"
        f"p = Problem.load({str(FIXTURES / 'chain_hetero_6.json')!r})\n"
        "result = remat.plan(p, '60%')\n"
        "from remat.core.plan_format import Plan\n"
        "assert isinstance(result, Plan) and result.solver == 'optimal'\n"
        "print(remat.plan(p, None, 'per-stage').solver)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "per-stage"
