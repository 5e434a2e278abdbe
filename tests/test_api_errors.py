"""Bad input through the Python API and the command line is named at the boundary, as a
one-sentence ``remat.UsageError`` (or exit 2/3), never torch's own error from deep inside
a measurement (issue 47, item 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import plans
from remat.cli import main
from remat.core.errors import UsageError

STAGES = [str(i) for i in range(4)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
                           for _ in range(4)))


def test_verify_refuses_a_model_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = _model()
    with pytest.raises(UsageError, match="meta device") as err:
        remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES))
    assert "fake=True" not in str(err.value)  # verify needs values: no fake profile fix


def test_a_loss_that_is_not_a_scalar_is_named_by_profile() -> None:
    with pytest.raises(UsageError, match=r"shape \(4, 8\).*scalar"):
        remat.profile(_model(), torch.randn(4, 8), lambda m, b: m(b), stages=STAGES)


@pytest.mark.parametrize("api", ["profile", "verify"])
def test_a_detached_loss_is_named(api: str) -> None:
    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum().detach()

    model = _model()
    with pytest.raises(UsageError, match="does not require grad"):
        if api == "profile":
            remat.profile(model, torch.randn(4, 8), loss_fn, stages=STAGES)
        else:
            remat.verify(model, torch.randn(4, 8), plans.every(model, 2, stages=STAGES),
                         loss_fn=loss_fn)


def test_a_partly_frozen_model_is_told_its_parameters_are_frozen() -> None:
    model = _model()
    for p in model[:2].parameters():
        p.requires_grad_(False)
    with pytest.raises(UsageError, match=r"frozen \(requires_grad=False\).*--stages 2,3"):
        remat.profile(model, torch.randn(4, 8), lambda m, b: m(b).sum())


def frozen_factory(batch_size: int = 4) -> Any:
    model = _model()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, torch.randn(batch_size, 8), lambda m, b: m(b).sum()


def detached_factory(batch_size: int = 4) -> Any:
    return _model(), torch.randn(batch_size, 8), lambda m, b: m(b).sum().detach()


@pytest.mark.parametrize("factory", ["frozen_factory", "detached_factory"])
def test_the_cli_names_a_loss_without_grad(factory: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--model", f"{__name__}:{factory}", "--stages", ",".join(STAGES)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "does not require grad" in err
    assert "element 0 of tensors" not in err
