"""Stages with forward hooks of their own inside multi-stage regions (FSDP2's, without ranks).

``fully_shard(block)`` hooks the block: a pre-hook that gathers parameters (in-place writes
to tensors outside any region) and hands the block new input tensors through an autograd
function whose backward reduces the gradients, and a forward hook that reshards (and casts
the output). These tests put hooks that do the same things on the stages of a one-process
model, registered before and after ``remat.apply``, and check that nested multi-stage
regions train exactly as without a plan (Note [Stages with hooks of their own] in
``remat/runtime/engine.py``). The real FSDP2 on 2 ranks: ``tests/test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.plan_format import Plan, Region
from remat.models import load_model

GPT = dict(n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32, batch_size=4, dropout=0.1)
pytestmark = pytest.mark.usefixtures("one_thread")

STAGES = tuple(f"blocks.{i}" for i in range(4))
NESTED = Plan(stages=STAGES, regions=(Region(0, 4), Region(0, 2), Region(2, 4)))


class Handover(torch.autograd.Function):
    """Returns its input as a new tensor and counts its backward, like FSDP2's
    ``RegisterPostBackwardFunction`` (whose backward reduce-scatters the unit's grads)."""

    @staticmethod
    def forward(ctx: Any, counts: list[int], i: int, x: torch.Tensor) -> torch.Tensor:
        ctx.counts, ctx.i = counts, i
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.counts[ctx.i] += 1
        return None, None, grad


class UnitHooks:
    """FSDP-like hooks on every block; ``state`` stands for the unit's unsharded storage."""

    def __init__(self, model: nn.Module) -> None:
        self.state = nn.Parameter(torch.zeros(4))  # requires grad, outside every region
        self.backwards = [0] * len(STAGES)
        self.handles = []
        for i, name in enumerate(STAGES):
            block = model.get_submodule(name)
            self.handles += [
                block.register_forward_pre_hook(self._pre(i), prepend=True, with_kwargs=True),
                block.register_forward_hook(self._post),
            ]

    def _pre(self, i: int) -> Any:
        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with torch.no_grad():
                self.state.add_(1.0)  # "all-gather": a write the glue recorder refuses
            return (Handover.apply(self.backwards, i, args[0]), *args[1:]), kwargs

        return pre

    def _post(self, _m: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.state.sub_(1.0)  # "reshard"
        return output.clone()  # "cast": the model receives another tensor than forward made


def _steps(plan: Plan | None, hooks: str) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """Two AdamW steps of the gpt model with unit hooks put on before or after the plan."""
    model, batch, loss_fn = load_model("gpt", **GPT)
    unit = UnitHooks(model) if hooks == "before" else None
    handle = remat.apply(model, plan) if plan is not None else None
    if hooks == "after":
        unit = UnitHooks(model)
    assert unit is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        torch.manual_seed(step)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if handle is not None:
        assert handle.rebuilds == 2 * len(plan.regions)  # type: ignore[union-attr]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, unit


@pytest.mark.parametrize("hooks", ["before", "after"])
def test_stage_units_inside_nested_regions_train_exactly(hooks: str) -> None:
    want_losses, want, plain = _steps(None, hooks)
    losses, got, unit = _steps(NESTED, hooks)
    assert losses == want_losses
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # each unit's backward hook ran once per step, as without the plan: the rebuilds
    # ran the stages again but never their gradients through the handed-over inputs
    assert unit.backwards == plain.backwards == [2] * len(STAGES)


def test_hooks_registered_after_apply_run_inside_ours_and_remove_restores_them() -> None:
    model, batch, loss_fn = load_model("gpt", **GPT)
    handle = remat.apply(model, NESTED)
    unit = UnitHooks(model)  # prepend=True: ahead of remat's pre-hook until the next pass
    block = model.get_submodule("blocks.1")
    theirs_pre, theirs_post = (h.id for h in unit.handles[2:4])
    ours_pre = [k for k in block._forward_pre_hooks if k != theirs_pre]
    ours_post = [k for k in block._forward_hooks if k != theirs_post]
    assert list(block._forward_pre_hooks) == [theirs_pre, *ours_pre]
    assert list(block._forward_hooks) == [*ours_post, theirs_post]
    loss_fn(model, batch).backward()
    assert list(block._forward_pre_hooks) == [*ours_pre, theirs_pre]  # ours first again
    assert list(block._forward_hooks) == [theirs_post, *ours_post]  # and last
    handle.remove()
    assert list(block._forward_pre_hooks) == [theirs_pre]
    assert list(block._forward_hooks) == [theirs_post]
