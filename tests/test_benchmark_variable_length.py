"""benchmarks/variable_length.py --quick end to end: a tiny hf:llama fine-tuned on dynamically
padded batches under per-layer checkpointing, remat's plan for the longest shape and
remat's plan set, at one budget; its JSON and Markdown carry every figure the recorded
run reports, every step within the budget and the losses equal to the plain model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "variable_length.py"
CONFIGS = ("p", "a", "s")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("variable_length") / "vl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def test_every_configuration_stays_within_the_one_budget_and_trains_as_the_plain_model(
        quick: tuple[dict, str]) -> None:
    res, _ = quick
    budget = res["budget_bytes"]
    assert budget > 0 and res["plain_peak_at_max_bytes"] > budget  # the budget binds
    assert res["memory"]["plain"]["steps_over_budget"] > 0
    for name in CONFIGS:
        mem = res["memory"][name]
        assert mem["steps_over_budget"] == 0, (name, mem)
        assert 0 < mem["worst_peak_bytes"] <= budget, name
        assert mem["losses_equal_plain"] is True, name
        assert mem["final_weights_equal_plain"] is True, name
    assert res["s_steps_over_budget"] == []
    assert res["s_plan_choice_mismatches"] == []
    steps = res["settings"]["steps"]
    assert sum(res["plan_set"]["steps_per_plan"].values()) == steps
    lines = res["plan_set"]["describe"]
    # one line per plan, and one more where the set runs the lengths between its steps
    assert len([x for x in lines if x.startswith("plan ")]) == res["plan_set"]["plans"] >= 1


def test_the_timed_runs_and_one_off_costs_are_reported(quick: tuple[dict, str]) -> None:
    res, _ = quick
    tm = res["timing"]
    assert len(tm["runs"]) == res["settings"]["runs"] >= 1
    for run in tm["runs"]:
        assert sorted(run["order"]) == sorted(CONFIGS)
        assert all(run["total_s"][n] > 0 for n in CONFIGS)
        assert run["s_over_a"] == pytest.approx(run["total_s"]["s"] / run["total_s"]["a"])
        assert run["s_over_p"] == pytest.approx(run["total_s"]["s"] / run["total_s"]["p"])
        assert all(run["losses_equal_plain"][n] is True for n in CONFIGS)
    assert 0 <= tm["runs_meeting_target"] <= len(tm["runs"])
    assert tm["target_s_over_a"] == 0.85
    for name in ("a", "s"):
        assert res["one_off"][name]["profile_s"] > 0 and res["one_off"][name]["plan_s"] > 0
    assert sum(b["steps"] for b in res["time_by_length"]) == res["settings"]["steps"]
    for key in ("command", "machine", "torch", "date", "distribution"):
        assert res[key], key
    assert res["command"].startswith("PYTHONPATH=src .venv/bin/python "
                                      "benchmarks/variable_length.py --quick")


def test_the_markdown_says_what_the_json_holds(quick: tuple[dict, str]) -> None:
    res, md = quick
    assert res["command"] in md
    assert res["torch"] in md and res["date"] in md
    for heading in ("## Memory", "## Time", "## One-off costs and plans", "Where the time goes"):
        assert heading in md, heading
    for line in res["plan_set"]["describe"]:
        assert line in md
    assert f"met in **{res['timing']['runs_meeting_target']} of" in md
    assert f"{res['timing']['median_s_over_a']:.3f}" in md
