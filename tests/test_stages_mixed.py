"""Stage discovery inside mixed containers: a stem, blocks and a head side by side
(docs/stages.md, rules 7 and 8), on torchvision-shaped CNNs and small models of our own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from conftest import TanhBlock
from remat.cli import main
from remat.core.errors import UsageError
from remat.models import load_model
from remat.runtime.stages import Chain, discover_chain, discover_stages

# small enough to trace in a blink, with every stage and block of the default layouts
SMALL: dict[str, dict[str, Any]] = {
    "mobilenet": {"width": 4, "image_size": 16, "batch_size": 2},
    "efficientnet": {"width": 4, "image_size": 16, "batch_size": 2},
    "vgg": {"width": 4, "hidden": 16, "image_size": 16, "batch_size": 2},
}


def _chain(name: str, **options: Any) -> Chain:
    model, batch, loss_fn = load_model(name, **{**SMALL[name], **options})
    return discover_chain(model, batch, loss_fn)


def test_mobilenet_chains_the_inverted_residuals_between_stem_and_head() -> None:
    chain = _chain("mobilenet")
    # the blocks stay whole: the two ConvNormActivations in a row inside each block's
    # ``conv`` are its own layers, not blocks (runs count only outside blocks)
    assert chain.stages == tuple(f"features.{i}" for i in range(1, 9))
    assert chain.share > 0.8
    assert chain.rejected == (
        "features.0: rejected, a single ConvNormActivation (a run needs two)",
        "features.9: rejected, a single ConvNormActivation (a run needs two)",
        "classifier: rejected, no two children in a row of one class or one structure",
    )


def test_efficientnet_splits_its_stages_into_the_mbconv_blocks() -> None:
    chain = _chain("efficientnet")
    assert chain.stages == (
        "features.1.0", "features.2.0", "features.2.1", "features.3.0", "features.3.1",
        "features.4.0", "features.4.1", "features.4.2",
    )  # fmt: skip
    assert chain.share > 0.8
    assert chain.rejected[:2] == (
        "features.0: rejected, a single ConvNormActivation (a run needs two)",
        "features.5: rejected, a single ConvNormActivation (a run needs two)",
    )


@pytest.mark.parametrize("batch_norm", [False, True])
def test_vgg_layers_are_the_stages_and_in_place_relus_stay_glue(batch_norm: bool) -> None:
    model, batch, loss_fn = load_model("vgg", **SMALL["vgg"], batch_norm=batch_norm)
    chain = discover_chain(model, batch, loss_fn)
    kinds = {type(model.get_submodule(s)) for s in chain.stages}
    expected = {nn.Conv2d, nn.MaxPool2d, nn.Linear, nn.Dropout}
    assert kinds == (expected | {nn.BatchNorm2d} if batch_norm else expected)
    assert list(chain.stages) == [
        f"{part}.{n}" for part in ("features", "classifier")
        for n, m in model.get_submodule(part).named_children() if not isinstance(m, nn.ReLU)
    ]
    assert chain.rejected == ()


class Down(nn.Module):
    """A strided conv block: another class than the blocks after it."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class Res(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.conv(x))


class Twin(nn.Module):
    """A class of its own with Res's module tree (one structure, rule 7)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(self.conv(x))


class Mixed(nn.Module):
    """Runs of two block classes one after another, a stage nested one level deeper (a
    ``Sequential`` of a Down and two Res), a twin of Res, stem and head convs."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),  # 0: stem
            Down(c), Down(c),  # 1, 2: a run of Down
            Res(c), Res(c), Twin(c),  # 3, 4, 5: a run of one structure
            nn.BatchNorm2d(c),  # 6
            nn.Sequential(Down(c), Res(c), Res(c)),  # 7: a single holding a run
            nn.Conv2d(c, 8, 1),  # 8: head
        )  # fmt: skip
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean(dim=(2, 3))).sum()


def test_runs_of_different_classes_and_depths_chain_in_call_order() -> None:
    chain = discover_chain(Mixed(), torch.randn(2, 3, 16, 16))
    assert chain.stages == (
        "body.1", "body.2", "body.3", "body.4", "body.5", "body.7.1", "body.7.2",
    )  # fmt: skip
    # the stem saves nothing (its input is the batch), so it is not worth a line
    assert chain.rejected == (
        "body.6: rejected, a single BatchNorm2d (a run needs two)",
        "body.7.0: rejected, a single Down (a run needs two)",
        "body.8: rejected, a single Conv2d (a run needs two)",
    )


class Reused(nn.Module):
    """A mixed container whose ReLU the forward calls after every block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TanhBlock(4), TanhBlock(4), TanhBlock(4), nn.ReLU()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers[:3]:
            x = self.layers[3](block(x))
        return x.sum()


def test_a_mixed_container_with_a_child_called_twice_contributes_nothing() -> None:
    with pytest.raises(UsageError, match="found no repeated blocks in Reused"):
        discover_stages(Reused(), torch.randn(2, 4))


class WithHead(nn.Module):
    """A chain of blocks and an MLP head of layers: the head stays glue (rule 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TanhBlock(8) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def test_layers_of_a_flat_container_are_stages_only_without_repeated_blocks() -> None:
    chain = discover_chain(WithHead(), torch.randn(4, 8))
    assert chain.stages == ("blocks.0", "blocks.1", "blocks.2")
    assert chain.rejected == (
        "head: rejected, its 3 layers are taken as stages only where the model has no "
        "repeated blocks",
    )
    head = WithHead().head  # alone, the head's layers are the chain
    assert discover_stages(head, torch.randn(4, 8)) == ["0", "1", "2"]


def test_auto_on_mobilenet_meets_its_budget_as_predicted() -> None:
    # large enough that 75% is above the least peak a plan reaches (fixed bytes dominate
    # the SMALL one)
    options = {"width": 4, "image_size": 32, "batch_size": 8}
    report = remat.auto("mobilenet", options=options, budget="75%", repeats=2)
    assert list(report.plan.stages) == [f"features.{i}" for i in range(1, 9)]
    assert report.ok, report.problems
    assert report.measured_peak_bytes <= report.budget_bytes
    assert abs(report.peak_error) <= 0.05
    assert report.verify_ok and report.grads_match


def test_profile_prints_the_rejected_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    sets = [arg for k, v in SMALL["mobilenet"].items() for arg in ("--set", f"{k}={v}")]
    assert main(["profile", "--model", "mobilenet", *sets, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "features.0: rejected, a single ConvNormActivation (a run needs two)" in out
    assert "features.9: rejected" in out
