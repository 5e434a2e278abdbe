"""remat bench: rows, predicted against measured, gradients, the report folder, the CLI."""

from __future__ import annotations

import json
import platform
import sys
import types
from pathlib import Path

import pytest

import remat
from remat.benchmarking import BenchReport, parse_budgets, parse_strategies, write_report
from remat.benchmarking.microbatch import split
from remat.cli import main
from remat.core.errors import UsageError

# torch.compile uses a deprecated torch.jit helper internally (torch 2.13).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32, "vocab_size": 64,
        "batch_size": 4}
TINY_SETS = [arg for k, v in TINY.items() for arg in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def report() -> BenchReport:
    # No cached graphs: a forward or backward graph served from an earlier run's FX graph
    # or AOT autograd cache must not hide a compile that fails when it really runs (a
    # backward compiled under other inductor settings than its forward did once). Every
    # compile here lowers both; only compiled C++ kernels of identical source are reused.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        return remat.bench(
            "gpt", options=TINY, budgets="100%,80%",
            strategies="per-stage,every-2,compile,remat", repeats=2, warmup=1,
            microbatch_budget="70%",
        )


# -- parsing -----------------------------------------------------------------------------


def test_strategies_parse_in_report_order_and_reject_unknown_names() -> None:
    assert parse_strategies("remat, per-stage,every-3,none") == (
        "none", "per-stage", "every-3", "remat")
    with pytest.raises(UsageError, match="'fast' is not known"):
        parse_strategies("per-stage,fast")
    with pytest.raises(UsageError, match="empty entry"):
        parse_strategies("per-stage,,remat")
    with pytest.raises(UsageError, match="every-2"):
        parse_strategies("every-0")


def test_budgets_parse_and_reject_what_parse_budget_rejects() -> None:
    assert parse_budgets("100%, 50%,64MiB,50%") == ("100%", "50%", "64MiB")
    with pytest.raises(UsageError, match="budget 'lots'"):
        parse_budgets("50%,lots")
    with pytest.raises(UsageError, match="empty entry"):
        parse_budgets("")


def test_the_cli_defaults_equal_the_library_defaults() -> None:
    from remat.benchmarking import DEFAULT_BUDGETS, STRATEGIES
    from remat.cli import bench as cli

    assert ",".join(DEFAULT_BUDGETS) == cli.DEFAULT_BUDGETS
    assert ",".join(STRATEGIES) == cli.DEFAULT_STRATEGIES


def test_split_keeps_the_global_batch() -> None:
    assert split(8, 3) == (3, 3, 2)
    assert split(8, 8) == (8,)
    assert split(64, 17) == (17, 17, 17, 13)


# -- one run -----------------------------------------------------------------------------


def test_every_requested_row_is_there(report: BenchReport) -> None:
    keys = [r.key for r in report.rows]
    for key in ("none", "per-stage", "every-2", "remat@100%", "remat@80%",
                "compile@100%", "compile@80%", "remat@per-stage", "remat@every-2"):
        assert key in keys
    assert report.row("remat@80%").budget_bytes == int(0.8 * report.no_checkpoint_peak_bytes)


def test_plans_are_measured_by_the_tracker_as_predicted(report: BenchReport) -> None:
    planned = [r for r in report.rows if r.strategy != "compile" and r.status == "ok"]
    assert len(planned) >= 5
    for r in planned:
        assert r.instrument == "tracker"
        assert r.predicted_peak_bytes and r.measured_peak_bytes
        assert abs(r.peak_error) <= 0.05, r.key  # type: ignore[arg-type]
        # the profiler's allocator events see the same step to within 0.1 MiB
        assert abs(r.profiler_peak_bytes - r.measured_peak_bytes) <= 0.1 * 2**20, r.key  # type: ignore[operator]
        assert r.grads_match is True and r.verify_ok is True, (r.key, r.grads_detail)
        assert r.step_time_s and r.step_time_min_s <= r.step_time_s <= r.step_time_max_s  # type: ignore[operator]
        assert len(r.step_times_s) == 2
    for r in planned:
        if r.strategy == "remat" and r.budget_bytes is not None:
            assert r.within_budget, r.key
    none = report.row("none")
    assert none.overhead == 0 and none.rebuild_time_s == 0
    per_stage = report.row("per-stage")
    assert per_stage.measured_peak_bytes < none.measured_peak_bytes  # type: ignore[operator]
    assert per_stage.regions == ("[0, 1)", "[1, 2)")
    assert per_stage.predicted_overhead is not None and per_stage.overhead is not None


def test_compile_rows_are_measured_by_the_profiler_and_gradient_checked(
    report: BenchReport,
) -> None:
    if report.row("compile@100%").status != "ok":  # no working compiler here: it says why
        pytest.skip(f"torch.compile does not work here: {report.row('compile@100%').reason}")
    for budget in ("100%", "80%"):
        r = report.row(f"compile@{budget}")
        assert r.status == "ok", r.reason  # a budget below 1 compiles too
        assert r.instrument == "torch.profiler"
        assert r.measured_peak_bytes and r.predicted_peak_bytes is None
        if budget == "100%":
            # fallback_random: compiled dropout draws eager's masks, so the gradients agree
            assert r.grads_match is True, r.grads_detail
        assert r.grads_match is not None and r.grads_detail
        if r.grads_match:
            assert r.grads_detail == "loss and parameter gradients equal eager's (auto tolerance)"
        else:  # below 100% the budget may redraw dropout masks (docs/bench.md): then say so
            assert r.grads_rounding_only is not None and "eager float64 step" in r.grads_detail
        assert r.compile_time_s is not None and r.step_time_s is not None
        assert r.budget_fraction is not None and 0 < r.budget_fraction <= 1
    assert report.compile_status


def test_findings_and_environment_explain_the_rows(report: BenchReport) -> None:
    names = [f.name for f in report.findings]
    assert "prediction remat@100%" in names and "gradients" in names
    assert "per-stage overhead" in names and "fastest under budget" in names
    assert any(n.startswith("matched ") for n in names)
    env = report.environment
    assert env.torch_version and env.threads >= 1 and env.dtype == "float32"
    # the built-in gpt has dropout on: CPU attention then runs as separate ops
    assert env.attention_backend.startswith(("math", "fused"))
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert env.malloc.startswith("glibc, freed memory kept")  # bench's default, recorded


def test_microbatch_comparison_keeps_the_global_batch(report: BenchReport) -> None:
    micro = report.microbatch
    assert micro is not None and micro.global_batch == 4 and micro.rows
    confirmed = [m for m in micro.rows if m.status == "ok"]
    assert confirmed and micro.fastest in {m.strategy for m in confirmed}
    for m in confirmed:
        assert m.microbatch is not None and 1 <= m.microbatch <= 4
        assert m.accumulation_steps == len(split(4, m.microbatch))
        assert m.measured_peak_bytes <= micro.budget_bytes  # type: ignore[operator]
        assert m.samples_per_s and m.samples_per_s > 0
    assert micro.fastest in micro.statement


def test_json_has_the_documented_keys(report: BenchReport) -> None:
    data = json.loads(json.dumps(report.to_dict()))
    for key in ("rows", "findings", "environment", "microbatch", "budgets", "strategies",
                "compile_status", "no_checkpoint_peak_bytes", "schema_version"):
        assert key in data
    for row in data["rows"]:
        for key in ("strategy", "budget", "budget_bytes", "predicted_peak_bytes",
                    "measured_peak_bytes", "instrument", "step_time_s", "step_time_min_s",
                    "step_time_max_s", "overhead", "grads_match", "regions", "options",
                    "status", "reason", "peak_error", "within_budget"):
            assert key in row, key
    assert {"torch_version", "device", "threads", "malloc", "dtype", "attention_backend"} <= set(
        data["environment"])


def test_report_folder_has_json_markdown_and_plots(report: BenchReport, tmp_path: Path) -> None:
    files = write_report(report, tmp_path / "out")
    assert json.loads(files.json_path.read_text())["rows"]
    text = files.markdown_path.read_text()
    assert "## Rows" in text and "## Findings" in text and "remat@80%" in text
    names = {p.name for p in files.plots}
    assert {"timelines.png", "tradeoff.png"} <= names
    for p in files.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({p.name})" in text


def test_without_matplotlib_the_plots_are_skipped_with_the_hint(
    report: BenchReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    files = write_report(report, tmp_path)
    assert files.plots == () and "pip install 'remat[plot]'" in (files.plots_skipped or "")
    assert files.json_path.exists()
    assert "Plots were skipped" in files.markdown_path.read_text()


# -- the command line --------------------------------------------------------------------


def test_cli_writes_the_report_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    out = tmp_path / "report"
    code = main(["bench", *TINY_SETS, "--budgets", "100%,1%", "--strategies", "remat",
                 "--repeats", "1", "--warmup", "0", "--microbatch-budget", "off",
                 "--out", str(out), "--json", str(tmp_path / "b.json")])
    assert code == 0
    data = json.loads((tmp_path / "b.json").read_text())
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {"none", "remat@100%", "remat@1%"}
    assert rows["remat@1%"]["status"] == "infeasible"
    assert "at least" in rows["remat@1%"]["reason"]
    assert data["microbatch"] is None
    assert (out / "bench.json").exists() and (out / "README.md").exists()
    assert "remat bench --model gpt" in (out / "README.md").read_text()
    assert "remat@100%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budgets", "50%,,25%"], "--budgets"),
        (["--budgets", "half"], "budget 'half'"),
        (["--strategies", "remat,magic"], "strategy 'magic' is not known"),
        (["--microbatch-budget", "lots"], "budget 'lots'"),
        (["--threads", "0"], "--threads 0"),
    ],
)
def test_cli_usage_errors_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("remat bench: error:")


def test_remat_bench_is_a_plain_function_that_runs_a_bench() -> None:
    import remat.benchmarking
    import remat.benchmarking.main_job

    # Importing the package that holds it changes nothing: remat.bench is the function.
    assert type(remat.bench) is types.FunctionType
    assert remat.bench is remat.benchmarking.bench
    small = remat.bench("gpt", options=TINY, budgets="100%", strategies="none", repeats=1,
                        warmup=0, verify_steps=1, profile_repeats=1, microbatch_budget=None)
    assert isinstance(small, BenchReport)
    (row,) = small.rows
    assert (row.key, row.status, row.instrument) == ("none", "ok", "tracker")
    assert row.measured_peak_bytes and row.step_time_s  # a step really ran and was measured
    # ``remat.auto`` is the main job's function itself, as the subpackage exports it.
    assert type(remat.auto) is types.FunctionType
    assert remat.auto is remat.benchmarking.auto is remat.benchmarking.main_job.auto
