"""An honest verify (Note [A model that is not finite on its own] in
``remat.verification.harness``): a model whose own loss or gradients are NaN or infinite
fails the ``finite`` check, however equal the two sides look; values that are not finite
only with the plan fail the comparisons, as any difference does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import plans
from remat.cli import main


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
                           for _ in range(4)))


STAGES = [str(i) for i in range(4)]


def _check(report: remat.VerifyReport, name: str) -> remat.verification.verify_report.Check:
    return next(c for c in report.checks if c.name == name)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_on_the_plain_model_fails(bad: float) -> None:
    model = _model()
    report = remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES),
                          loss_fn=lambda m, b: m(b).pow(2).mean() * bad, steps=2)
    finite = _check(report, "finite")
    assert finite.status == "fail"
    assert "the model's own loss is" in finite.message
    assert "cannot tell equal from unequal" in finite.message
    assert not report.ok


def test_a_gradient_that_is_not_finite_on_the_plain_model_fails() -> None:
    model = _model()

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b)
        # a finite loss whose gradient is NaN: sqrt at zero
        return out.pow(2).mean() + torch.sqrt(out[0, 0] * 0).sum()

    report = remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES),
                          loss_fn=loss_fn, steps=1)
    finite = _check(report, "finite")
    assert finite.status == "fail", finite.message
    assert "gradient" in finite.message
    assert not report.ok


def test_a_loss_that_turns_nan_in_a_later_step_fails() -> None:
    model = _model()
    calls = {"n": 0}

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = m(b).pow(2).mean()
        return loss * float("nan") if calls["n"] > 2 else loss  # twin and plain, step 1

    report = remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES),
                          loss_fn=loss_fn, steps=3)
    finite = _check(report, "finite")
    assert finite.status == "fail"
    assert "step 2 loss" in finite.message
    assert not report.ok


def test_a_finite_model_passes_the_finite_check() -> None:
    model = _model()
    report = remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES),
                          loss_fn=lambda m, b: m(b).pow(2).mean(), steps=2)
    assert _check(report, "finite").status == "pass"
    assert report.ok


def nan_factory(batch_size: int = 4):
    model = _model()
    return model, torch.randn(batch_size, 8), lambda m, b: m(b).pow(2).mean() * float("nan")


def test_remat_verify_on_a_nan_model_exits_1_and_says_so(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    code = main(["verify", "--model", f"{__name__}:nan_factory", "--plan", "every:2",
                 "--stages", ",".join(STAGES), "--steps", "1"])
    out = capsys.readouterr()
    assert code == 1
    assert "the model's own loss is NaN" in out.out + out.err
