"""Stage discovery: the repeated-block container on the forward path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.errors import UsageError
from remat.stages import discover_stages, resolve_stages


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TwoStacks(nn.Module):
    """A long stack that the forward never calls and a shorter one that it calls backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.ModuleList(Block(4) for _ in range(6))
        self.layers = nn.ModuleList(Block(4) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # mixed classes: not a chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = layer(x)
        return self.head(x).sum()


def test_without_a_batch_the_largest_same_class_container_wins() -> None:
    assert discover_stages(TwoStacks()) == [f"unused.{i}" for i in range(6)]


def test_with_a_batch_only_called_containers_count_in_call_order() -> None:
    model = TwoStacks()
    assert discover_stages(model, torch.randn(2, 4)) == ["layers.2", "layers.1", "layers.0"]


def test_loss_fn_runs_the_forward_and_training_mode_is_kept() -> None:
    model = TwoStacks().train()
    stages = discover_stages(model, {"x": torch.randn(2, 4)}, lambda m, b: m(b["x"]))
    assert stages == ["layers.2", "layers.1", "layers.0"]
    assert model.training


def test_sequential_root_and_no_container() -> None:
    seq = nn.Sequential(*(Block(3) for _ in range(4)))
    assert discover_stages(seq) == ["0", "1", "2", "3"]
    with pytest.raises(UsageError, match="no repeated-block container"):
        discover_stages(nn.Linear(2, 2))


def test_resolve_checks_paths_and_suggests_a_fix() -> None:
    model = TwoStacks()
    assert resolve_stages(model, ["layers.0", "layers.1"]) == ["layers.0", "layers.1"]
    with pytest.raises(UsageError, match=r"did you mean 'layers\.1'"):
        resolve_stages(model, ["layers.0", "layer.1"])
    with pytest.raises(UsageError, match="named twice"):
        resolve_stages(model, ["layers.0", "layers.0"])
    with pytest.raises(UsageError, match="names no module"):
        resolve_stages(model, [])
