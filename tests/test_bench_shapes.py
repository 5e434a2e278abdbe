"""remat bench --shapes (issue 48, item 2): remat's plan set against the recipes at each
bucket's ends, a table whose rows say which plan covers which shapes, the shapes in the
report files, and clear errors for options a range does not take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.core.plan_set import PlanSet

TINY = ["--model", "gpt", "--set", "n_layer=3", "--set", "n_embd=32", "--set",
        "block_size=32", "--set", "vocab_size=64", "--batch-size", "2"]
RANGE = "seq=8..32:8"


@pytest.mark.slow
def test_every_bucket_is_measured_at_its_ends_within_the_budget_at_its_own_shape(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data_path = tmp_path / "report", tmp_path / "bench.json"
    assert main(["bench", *TINY, "--shapes", RANGE, "--budgets", "80%", "--strategies",
                 "none,per-stage,remat", "--repeats", "1", "--warmup", "0",
                 "--profile-repeats", "1", "--json", str(data_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(data_path.read_text())
    chosen = PlanSet.from_dict(data["plan_set"])
    assert data["shapes"] == RANGE and str(chosen.dims) == RANGE
    budget = data["budget_bytes"]
    assert budget == chosen.budget_bytes and len(chosen.plans) >= 2  # the range needs >1 plan

    # every shape of the range is run by one bucket's plan, and every bucket's ends measured
    assert all(chosen.choose(x) is not None for x in chosen.dims.lattice())
    rows = data["rows"]
    measured = {tuple(r["shape"]) for r in rows}
    assert measured == {x for k in range(len(chosen.plans)) for x in chosen.ends(k)}
    assert {(8,), (32,)} <= measured
    assert [b["plan"] for b in data["buckets"]] == list(range(len(chosen.plans)))
    for shape in measured:
        at = [r for r in rows if tuple(r["shape"]) == shape]
        assert sorted(r["strategy"] for r in at) == ["none", "per-stage", "remat"]
        k = chosen.choose(shape)
        assert all(r["plan"] == k and r["status"] == "ok" and r["grads_match"] for r in at)
        remat = next(r for r in at if r["strategy"] == "remat")
        assert remat["ran_plan"] == k  # the runtime switched to the bucket's plan
        assert remat["measured_peak_bytes"] <= budget and remat["within_budget"]
        # predicted at this shape, and measured at it: a batch left at the example's
        # shape would measure the largest shape's peak at every end
        assert abs(remat["peak_error"]) <= 0.05, (shape, remat)
        none = next(r for r in at if r["strategy"] == "none")
        assert abs(none["peak_error"]) <= 0.05, (shape, none)
        assert none["step_time_s"] and remat["overhead"] is not None
    by_shape = {tuple(r["shape"]): r["measured_peak_bytes"] for r in rows
                if r["strategy"] == "none"}
    assert by_shape[(8,)] < by_shape[(32,)]  # the batch really was resized
    assert by_shape[(32,)] > budget  # the largest shape needs checkpointing under 80%

    # the printed table and the report folder say which plan covers which shapes
    for k in range(len(chosen.plans)):
        bucket = "; ".join(data["buckets"][k]["shapes"])
        assert f"{k}: {bucket}" in printed
        assert f"| {k}: {bucket} |" in (out / "README.md").read_text()
    assert json.loads((out / "bench.json").read_text())["shapes"] == RANGE
    assert f"--shapes {RANGE}" in (out / "README.md").read_text()
    assert "MET budget" in printed and "MISSED" not in printed.split("MET budget")[0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--shapes", "seq=8..x"], "seq=8..x"),
        (["--shapes", "seq=32..8"], "seq"),
        (["--shapes", RANGE, "--budgets", "80%,50%"], "one budget"),
        (["--shapes", RANGE, "--strategies", "compile,remat"], "compile"),
        (["--shapes", RANGE, "--strategies", "none,per-stage"], "keep remat"),
        (["--shapes", RANGE, "--compile"], "drop --compile"),
        (["--shapes", RANGE, "--microbatch-budget", "50%"], "drop --microbatch-budget"),
        (["--shapes", RANGE, "--no-matched", "--verify-steps", "3"],
         "drop --no-matched, --verify-steps"),
        (["--shapes", RANGE, "--distributed", "ddp"], "drop --distributed"),
    ],
)
def test_a_bad_range_or_an_option_a_range_does_not_take_is_one_line_and_exits_2(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("remat bench: error:"), err


def test_the_cli_range_defaults_equal_the_library_defaults() -> None:
    import inspect

    from remat.benchmarking.range_bench import RANGE_STRATEGIES, bench_range
    from remat.cli import bench as cli

    assert ",".join(RANGE_STRATEGIES) == cli.RANGE_STRATEGIES
    assert inspect.signature(bench_range).parameters["budget"].default == cli.RANGE_BUDGET
    assert "compile" not in RANGE_STRATEGIES and "remat" in RANGE_STRATEGIES
