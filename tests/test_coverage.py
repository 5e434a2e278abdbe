"""The covered share: how much of the no-checkpoint activation memory the stages hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli import main
from remat.core.coverage import HINT_BELOW, coverage, coverage_hint, coverage_line, coverage_lines
from remat.core.profile_format import FixedBytes, Profile, StageProfile


def _profile(pre: int, post: int, *, saves_input: bool = True) -> Profile:
    stages = tuple(
        StageProfile(
            name=f"blocks.{i}", boundary_bytes=100, output_bytes=100,
            saved_bytes={"keep": 300}, saves_input=saves_input,
        )
        for i in range(4)
    )  # fmt: skip
    fixed = FixedBytes(
        params_bytes=10_000, buffers_bytes=0, grads_bytes=10_000, optimizer_state_bytes=20_000,
        inputs_bytes=50, pre_chain_bytes=pre, post_chain_bytes=post,
    )  # fmt: skip
    return Profile(model="m", batch_size=2, stages=stages, fixed=fixed)


def test_share_counts_saved_bytes_inputs_and_the_last_output_against_pre_and_post() -> None:
    cov = coverage(_profile(pre=200, post=100))
    assert cov.chain_bytes == 4 * 300 + 4 * 100 + 100
    assert cov.activation_bytes == cov.chain_bytes + 300  # parameters and state not counted
    assert cov.share == pytest.approx(1700 / 2000)
    assert cov.stages == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def test_an_input_no_one_keeps_is_not_counted() -> None:
    cov = coverage(_profile(pre=0, post=0, saves_input=False))
    assert cov.chain_bytes == 4 * 300 + 100
    assert cov.share == 1.0


def test_the_line_names_count_ends_and_share() -> None:
    profile = _profile(pre=200, post=100)
    assert coverage_line(coverage(profile, given=False)) == (
        "stages: 4 found (blocks.0 .. blocks.3), covering 85% of activation memory"
    )
    assert coverage_line(coverage(profile, given=True)).startswith("stages: 4 given (")
    assert coverage_line(coverage(profile)).startswith("stages: 4 (blocks.0 .. blocks.3)")


def test_the_hint_appears_below_the_threshold_only() -> None:
    high = coverage(_profile(pre=200, post=100))
    assert high.share >= HINT_BELOW and coverage_hint(high) is None
    assert len(coverage_lines(_profile(pre=200, post=100))) == 1
    low = coverage(_profile(pre=1700, post=0))
    assert low.share == 0.5 and low.low
    hint = coverage_hint(low)
    assert hint is not None and "50%" in hint and "--stages" in hint and "\n" not in hint


def test_coverage_imports_without_torch() -> None:
    code = "import sys; sys.modules['torch'] = None\nimport remat.core.coverage\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


TINY_RESNET = ["--model", "resnet", "--set", "width=4", "--set", "image_size=16"]
TINY_RESNET += ["--batch-size", "2", "--repeats", "1"]


def test_profile_prints_the_chain_and_hints_at_stages_only_when_restricted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    assert main(["profile", *TINY_RESNET, "--json", str(path)]) == 0
    full = capsys.readouterr().out
    assert "stages: 8 found (layer1.0 .. layer4.1), covering" in full
    assert "hint:" not in full and "--stages" not in full

    assert main(["profile", *TINY_RESNET, "--stages", "layer4.0,layer4.1"]) == 0
    restricted = capsys.readouterr().out
    assert "stages: 2 given (layer4.0 .. layer4.1), covering" in restricted
    assert "hint:" in restricted and "--stages" in restricted

    # plan reads the saved profile: no claim about how the stages were chosen
    assert main(["plan", "--profile", str(path), "--solver", "per-stage"]) == 0
    planned = capsys.readouterr().out
    assert "stages: 8 (layer1.0 .. layer4.1), covering" in planned
    assert json.loads(path.read_text())["stages"][0]["name"] == "layer1.0"


def test_auto_prints_the_chain_line_and_the_hint_from_its_profile() -> None:
    from rich.console import Console

    from remat.benchmarking.main_job import AutoReport
    from remat.cli.auto import render
    from remat.core.plan_format import Plan

    profile = _profile(pre=1700, post=0)
    plan = Plan(stages=profile.stage_names, regions=(), options=("keep",) * 4, solver="optimal")
    report = AutoReport(
        model="m", budget="75%", budget_bytes=3000, plan=plan, baseline_peak_bytes=4000,
        predicted_peak_bytes=2900, measured_peak_bytes=2900, predicted_peak_event="e",
        peak_phase="backward", peak_module=None, peak_by_category={"activations": 2900},
        baseline_peak_by_category={"activations": 4000}, step_time_s=1.0,
        baseline_step_time_s=1.0, profile=profile,
    )  # fmt: skip
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "stages: 4 (blocks.0 .. blocks.3), covering 50% of activation memory" in text
    assert "hint: 50% of the activation memory is outside the stages" in text


def test_auto_that_finds_no_plan_names_the_chain_and_hints_at_stages(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    code = main(["auto", "--model", "resnet", "--set", "width=4", "--set", "image_size=8",
                 "--set", "batch_size=2", "--stages", "layer4.0,layer4.1", "--budget", "10%",
                 "--repeats", "1", "--json", str(out)])
    error = json.loads(out.read_text())["error"]
    assert code == 1 and error["stage"] == "planning" and error["minimum_budget_bytes"] > 0
    assert "stages: 2 given (layer4.0 .. layer4.1), covering" in error["message"]
    assert "--stages" in error["message"]
