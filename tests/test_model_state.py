"""The caller's model is the caller's: ``remat.profile`` puts back everything its
training steps change (Note [The user's model is the user's] in
:mod:`remat.measure.model_state`), on success, after a failing ``loss_fn`` and after a NaN
loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import UsageError


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a forward that reassigns a buffer (a new object), as some modules count calls
        self.calls = self.calls + 1
        return x + torch.tanh(self.norm(self.lin(x)))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(*(Block(16) for _ in range(3))),
                          nn.Linear(16, 1))
    model[0].weight.requires_grad_(False)  # partly frozen
    model[1][2].norm.eval()  # one submodule in eval mode under a training root
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 0.5)  # gradients the caller left
    return model, torch.randn(32, 8)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "values": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "objects": {k: id(v) for k, v in [*model.named_parameters(), *model.named_buffers()]},
        "grads": {k: None if p.grad is None else (id(p.grad), p.grad.clone())
                  for k, p in model.named_parameters()},
        "flags": {k: p.requires_grad for k, p in model.named_parameters()},
        "modes": {k: m.training for k, m in model.named_modules()},
    }


def _assert_same(model: nn.Module, before: dict[str, Any]) -> None:
    after = _state(model)
    assert after["values"].keys() == before["values"].keys()
    for key, value in after["values"].items():
        # bitwise: NaN where there was none fails, as any changed bit does
        assert torch.equal(value, before["values"][key]), f"{key} changed"
    assert after["objects"] == before["objects"], "a parameter or buffer object was swapped"
    for key, grad in after["grads"].items():
        was = before["grads"][key]
        assert (grad is None) == (was is None), f"{key}'s gradient appeared or went"
        if grad is not None:
            assert grad[0] == was[0] and torch.equal(grad[1], was[1]), f"{key}.grad changed"
    assert after["flags"] == before["flags"]
    assert after["modes"] == before["modes"]


def test_profile_leaves_the_model_bitwise_as_it_was() -> None:
    model, batch = _model()
    before = _state(model)
    remat.profile(model, batch, _loss, stages=[f"1.{i}" for i in range(3)], repeats=1)
    _assert_same(model, before)


def test_a_failing_loss_fn_midway_leaves_the_model_as_it_was() -> None:
    model, batch = _model()
    before = _state(model)
    calls = 0

    def failing(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 8:  # after some optimizer steps have run
            raise RuntimeError("the user's loss failed")
        return _loss(m, b)

    with pytest.raises(RuntimeError, match="the user's loss failed"):
        remat.profile(model, batch, failing, stages=[f"1.{i}" for i in range(3)], repeats=1)
    assert calls == 8
    _assert_same(model, before)


def test_a_nan_loss_leaves_no_nan_in_the_model() -> None:
    model, batch = _model()
    before = _state(model)
    remat.profile(model, batch, lambda m, b: _loss(m, b) * float("nan"),
                  stages=[f"1.{i}" for i in range(3)], repeats=1)
    _assert_same(model, before)


def test_a_given_optimizer_keeps_its_state() -> None:
    model, batch = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _loss(model, batch).backward()
    opt.step()
    before = _state(model)
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in enumerate(opt.state.values())}
    remat.profile(model, batch, _loss, stages=[f"1.{i}" for i in range(3)], optimizer=opt,
                  repeats=1)
    _assert_same(model, before)
    for k, s in enumerate(opt.state.values()):
        for name, value in s.items():
            assert torch.equal(value, state[k][name]), f"optimizer state {name} changed"


def test_a_model_on_the_meta_device_is_refused_up_front() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    with pytest.raises(UsageError, match="meta device"):
        remat.profile(model, torch.randn(2, 4))


def test_batch_none_is_a_usage_error() -> None:
    model, _ = _model()
    with pytest.raises(UsageError, match="batch is None"):
        remat.profile(model, None, _loss)
