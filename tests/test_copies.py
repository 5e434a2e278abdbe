"""Copies of a model with a plan applied (Note [Copies of an applied model] in
``remat.runtime.engine``): ``copy.deepcopy`` gives a copy whose plan runs its own blocks,
as EMA models, teacher copies and frameworks that copy models need; pickling is refused
with the fix."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.models import load_model
from remat.runtime.stages import discover_stages


def _gpt() -> tuple[nn.Module, torch.Tensor, object, Plan]:
    model, batch, loss_fn = load_model("gpt", n_layer=4, dropout=0.1, batch_size=2, n_embd=32,
                                       block_size=16)
    names = discover_stages(model, batch, loss_fn)
    # nested and multi-stage regions (stage hooks, code between stages) and a selective
    # option: everything apply installs
    plan = Plan(stages=tuple(names), regions=(Region(0, 3), Region(0, 2), Region(3, 4)),
                options=("keep", "selective:save-matmuls", "keep", "keep"))
    return model, batch, loss_fn, plan


def _step(model: nn.Module, batch: torch.Tensor, loss_fn: object, seed: int) -> float:
    torch.manual_seed(seed)
    loss = loss_fn(model, batch)  # type: ignore[operator]
    loss.backward()
    return float(loss.detach())


def test_a_deep_copy_runs_its_own_blocks_and_trains_as_a_plain_copy() -> None:
    model, batch, loss_fn, plan = _gpt()
    plain = copy.deepcopy(model)
    remat.apply(model, plan)
    twin = copy.deepcopy(model)
    assert remat.applied(twin)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (twin, plain)]
    for seed in range(3):  # a training loop of its own: losses and gradients as plain
        losses = [_step(m, batch, loss_fn, seed) for m in (twin, plain)]
        assert losses[0] == losses[1]
        for (name, p), q in zip(twin.named_parameters(), plain.parameters(), strict=True):
            assert p.grad is not None, f"{name} of the copy got no gradient"
            assert torch.equal(p.grad, q.grad), f"{name}'s gradient differs from a plain copy's"
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # the original's blocks were never run by the copy
    assert all(p.grad is None for p in model.parameters())
    # the copy's regions were rebuilt by its own engine, the original's never
    assert remat.runtime.install._APPLIED[twin].engine.rebuilds > 0
    assert remat.runtime.install._APPLIED[model].engine.rebuilds == 0


def test_removing_the_plan_from_a_copy_leaves_the_original_applied() -> None:
    model, batch, loss_fn, plan = _gpt()
    remat.apply(model, plan)
    twin = copy.deepcopy(model)
    remat.remove(twin)
    assert not remat.applied(twin)
    for m in twin.modules():
        assert "forward" not in vars(m)
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert remat.applied(model)
    _step(model, batch, loss_fn, 0)
    assert all(p.grad is not None for p in model.parameters())
    remat.remove(model)


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_pickling_an_applied_model_is_refused_with_the_fix(save: str) -> None:
    model, _, _, plan = _gpt()
    remat.apply(model, plan)
    with pytest.raises(UsageError, match=r"remat.remove\(model\).*state_dict"):
        if save == "pickle":
            pickle.dumps(model)
        else:
            torch.save(model, io.BytesIO())
    remat.remove(model)
    pickle.dumps(model)  # and works once the plan is removed
