"""``remat demo``: each worked example passes, fails for the reason in its name, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from remat import demo
from remat.cli import main
from remat.core import theory
from remat.core.errors import UsageError


@pytest.fixture(scope="module")
def results() -> dict[str, demo.DemoCheck]:
    return {check.name: check for check in demo.run_all()}


def test_all_four_checks_pass(results: dict[str, demo.DemoCheck]) -> None:
    assert list(results) == ["memory-table", "mlp-gradients", "checkpointed-chain", "dropout"]
    for check in results.values():
        assert check.passed, f"{check.name}: {check.summary} {check.details}"
        json.dumps(check.to_dict())


def test_run_all_leaves_global_rng_alone() -> None:
    torch.manual_seed(7)
    before = torch.get_rng_state()
    demo.run_all()
    assert torch.equal(before, torch.get_rng_state())


# --------------------------------------------------------------------------- memory-table


def test_memory_table_headline(results: dict[str, demo.DemoCheck]) -> None:
    details = results["memory-table"].details
    assert details["headline"]["best_k"] == 8
    assert details["headline"]["best_bytes"] == 512 * 2**20
    assert details["headline"]["no_checkpoint_bytes"] == 2 * 2**30
    assert [row["k"] for row in details["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert {(c["n"], c["k"]) for c in details["not_dividing"]} == {(10, 4), (64, 7)}


@pytest.mark.parametrize(("n", "k"), [(64, 8), (64, 7), (10, 4), (10, 3), (10, 12), (1, 1)])
def test_simulation_matches_textbook_formula(n: int, k: int) -> None:
    assert demo.simulate_segment_peak(n, k) == math.ceil(n / k) + min(k, n)


def test_freeing_boundaries_saves_one_copy_only_when_the_last_segment_is_short() -> None:
    assert demo.simulate_segment_peak(10, 4, release_boundaries=True) == 6
    assert demo.simulate_segment_peak(64, 7, release_boundaries=True) == 16
    assert demo.simulate_segment_peak(64, 8, release_boundaries=True) == 16


def _floor_boundaries(n: int, k: int, a: int) -> theory.SegmentRow:
    segments = n // k  # wrong when k does not divide n
    return theory.SegmentRow(k, segments, segments * a, min(k, n) * a, (segments + min(k, n)) * a)


def _one_extra_local(n: int, k: int, a: int) -> theory.SegmentRow:
    row = theory.segment_row(n, k, a)
    return theory.SegmentRow(
        k, row.segments, row.boundary_bytes, row.local_bytes + a, row.total_bytes + a
    )


def test_memory_table_fails_when_formula_ignores_a_short_last_segment() -> None:
    check = demo.check_memory_table(_floor_boundaries)
    assert not check.passed
    assert check.details["headline"] == check.details["expected"]  # n=64 powers of 2 agree
    assert {(m["n"], m["k"]) for m in check.details["mismatches"]} >= {(10, 4), (64, 7)}


def test_memory_table_fails_when_formula_counts_wrong() -> None:
    check = demo.check_memory_table(_one_extra_local)
    assert not check.passed
    assert "!=" in check.summary


# --------------------------------------------------------------------------- mlp-gradients


def _no_tanh_derivative(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, g: torch.Tensor
) -> dict[str, torch.Tensor]:
    a = torch.tanh(x @ w1)
    d_z = g @ w2.T  # forgets s'(Z)
    return {"W1": x.T @ d_z, "W2": a.T @ g, "X": d_z @ w1.T}


def test_mlp_fails_with_wrong_hand_gradient() -> None:
    check = demo.check_mlp_gradients(_no_tanh_derivative)
    assert not check.passed
    assert check.details["close"] == {"X": False, "W1": False, "W2": True}


def test_mlp_error_is_rounding_only(results: dict[str, demo.DemoCheck]) -> None:
    assert max(results["mlp-gradients"].details["max_abs_error"].values()) < 1e-12


# --------------------------------------------------------------------------- checkpointed-chain


def test_chain_counts_and_peak(results: dict[str, demo.DemoCheck]) -> None:
    details = results["checkpointed-chain"].details
    assert details["evaluations"] == {"forward": 12, "rebuild": 12}
    assert details["peak_live_tensors"] == details["live_tensor_bound"] == 7
    assert details["max_abs_error_vs_finite_difference"] < 1e-8


def test_chain_fails_when_rebuilt_from_the_wrong_boundary() -> None:
    check = demo.check_checkpointed_chain(rebuild_offset=1)
    assert not check.passed
    assert not check.details["matches_stored"]
    assert not check.details["matches_finite_difference"]


def test_a_negative_rebuild_offset_and_a_double_hold_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="rebuild_offset=-1 must be 0 or more"):
        demo.check_checkpointed_chain(rebuild_offset=-1)
    ledger = demo.Ledger()
    ledger.hold("x0")
    with pytest.raises(UsageError, match="x0 is already held"):
        ledger.hold("x0")


# --------------------------------------------------------------------------- dropout


def test_dropout_numbers(results: dict[str, demo.DemoCheck]) -> None:
    details = results["dropout"].details
    assert details["scalar"] == {"Y": 2.0, "L": 2.0, "dL_dW": 4.0, "dL_dW_rebuilt_D0": 0.0}
    assert details["max_abs_grad_diff_preserved"] == 0.0
    assert details["max_abs_grad_diff_unpreserved"] > 0.0
    assert details["checkpoint_error"] is None  # masks differ in values, not shapes


def test_dropout_fails_without_preserved_rng_state() -> None:
    check = demo.check_dropout(preserve_rng_state=False)
    assert not check.passed
    assert not check.details["preserved_matches"]


# --------------------------------------------------------------------------- CLI


def test_cli_demo_returns_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for name in ("memory-table", "mlp-gradients", "checkpointed-chain", "dropout"):
        assert f"PASS {name}: " in out


def test_cli_demo_json_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "demo.json"
    assert main(["demo", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["ok"] is True
    assert [c["name"] for c in data["checks"]] == [
        "memory-table",
        "mlp-gradients",
        "checkpointed-chain",
        "dropout",
    ]
    for check in data["checks"]:
        assert set(check) == {"name", "passed", "summary", "details"}


def test_cli_demo_json_stdout_is_pure_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] is True
    assert "PASS memory-table" in captured.err


def test_cli_demo_exits_one_on_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = demo.DemoCheck("dropout", False, "broken on purpose", {})
    monkeypatch.setattr(demo, "run_all", lambda: [failing])
    assert main(["demo"]) == 1
    assert "FAIL dropout: broken on purpose" in capsys.readouterr().out
