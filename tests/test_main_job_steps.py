"""The main job as steps: a strategy object runs them, a Budget is read once, and the
commands that share its steps do not load it (issue 50, items 2 and 3)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remat.benchmarking.auto_strategy import AutoStrategy, OneProcess, PerRank
from remat.core.errors import UsageError
from remat.core.planner import to_problem
from remat.core.solve import Problem
from remat.core.solve.budget import Budget

TINY = {"n_layer": 3, "n_embd": 32, "n_head": 2, "block_size": 32, "vocab_size": 64,
        "batch_size": 4}


def _calls(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def test_one_process_and_a_rank_take_the_same_calls() -> None:
    protocol = _calls(AutoStrategy)  # type: ignore[type-abstract]
    assert protocol  # shard, shared, problem, choose, runner, measure, ...
    assert _calls(OneProcess) == protocol
    assert _calls(PerRank) == protocol
    for cls in (OneProcess, PerRank):
        for name in protocol:
            assert (inspect.signature(getattr(cls, name)).parameters.keys()
                    == inspect.signature(getattr(AutoStrategy, name)).parameters.keys()), name


def test_the_commands_that_share_the_jobs_steps_load_no_job() -> None:
    """remat profile, plan and verify stop at named steps and show a bar as auto does,
    without importing the main job or bench."""
    code = (
        "import sys\n"
        "import remat.cli, remat.cli.common, remat.cli.plan, remat.cli.profile\n"
        "import remat.cli.auto, remat.cli.output, remat.benchmarking.stopping\n"
        "jobs = [m for m in ('remat.benchmarking.main_job', 'remat.benchmarking.bench_job')"
        " if m in sys.modules]\n"
        "print(jobs)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_budget_is_read_before_the_model_is_loaded() -> None:
    import remat

    built: list[int] = []

    def factory(**_: Any) -> Any:
        built.append(1)
        raise AssertionError("the model was built before the budget was read")

    with pytest.raises(UsageError, match="budget '-5%' must be above zero"):
        remat.auto(factory, budget="-5%")
    assert built == []
    with pytest.raises(UsageError, match="budget 'lots' is not a size"):
        remat.bench(factory, budgets="50%", microbatch_budget="lots")
    assert built == []


def test_auto_over_a_range_reads_its_budget_before_the_model_is_loaded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from remat.cli import main

    loaded: list[int] = []
    monkeypatch.setattr("remat.cli.common.load", lambda *_: loaded.append(1))
    assert main(["auto", "--shapes", "seq=16..32:8", "--budget", "lots"]) == 2
    assert "budget 'lots' is not a size" in capsys.readouterr().err
    assert loaded == []


def test_bench_rows_take_a_budget_value_as_its_text() -> None:
    from remat.benchmarking.strategies import parse_budgets, plan_rows

    problem = Problem.load(Path(__file__).parent / "fixtures" / "chain_hetero_6.json")
    given = parse_budgets("75%,1GiB")
    read = [Budget.parse(b) for b in given]
    rows, again = (plan_rows(problem, ("remat",), b) for b in (given, read))
    def seen(r: Any) -> tuple[Any, ...]:
        plan = r.plan and (r.plan.regions, r.plan.options, r.plan.predicted_peak_bytes)
        return r.strategy, r.budget, r.budget_bytes, plan

    assert [seen(r) for r in rows] == [seen(r) for r in again]
    assert [r.budget for r in rows if r.strategy == "remat"] == ["75%", "1GiB"]


class _Recording(OneProcess):
    """The one-process strategy, noting each call the job makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if callable(found) and not name.startswith("_") and name in _calls(OneProcess):
            super().__getattribute__("calls").append(name)
        return found


def test_the_job_runs_its_steps_through_the_strategy_passed_in() -> None:
    from remat.benchmarking.main_job import ModelSpec, Rounds, run_auto

    strategy = _Recording()
    report = run_auto(ModelSpec("gpt", TINY), Budget.parse("80%"),
                      Rounds(repeats=2, profile_repeats=2), strategy)
    calls = strategy.calls
    assert calls[:6] == ["shard", "shared", "rank", "problem", "choose", "runner"]
    assert calls.count("runner") == 2 and calls.count("measure") == 2
    assert calls[-1] == "done"
    planned_from = report.profile if report.first_attempt is None \
        else report.first_attempt.profile
    assert planned_from is not None and report.budget == "80%"
    assert report.budget_bytes == Budget.parse("80%").bytes(to_problem(planned_from))
    assert report.verify_ok and report.measured_peak_bytes <= report.budget_bytes


def test_a_budget_read_once_is_written_as_given_to_a_stopped_runs_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--budget becomes a Budget where the command reads it; the error document that a
    run stopping early writes still gives the budget as the user wrote it."""
    import json

    from remat.cli import main

    out = tmp_path / "out.json"
    profile = Path(__file__).parent / "fixtures" / "profile_mlp_tiny.json"
    code = main(["plan", "--profile", str(profile), "--budget", "1%", "--json", str(out)])
    assert code == 1, capsys.readouterr().err  # no plan fits 1%
    document = json.loads(out.read_text())
    assert document["budget"] == "1%" and document["ok"] is False
    assert document["error"]["minimum_budget_bytes"] > 0
