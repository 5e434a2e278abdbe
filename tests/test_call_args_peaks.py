"""Exact peaks where stages get different arguments from before the chain (issue 49,
item 4).

* gemma2 passes its sliding-window layers one 4-D mask and its full-attention layers
  another; only the first layer's were measured, so a region over both kinds was
  predicted one mask under its peak (hf:gemma2 at 75%: +0.62%), and a region over one
  kind one mask over it after the forward's return (the minimum plan: -0.91%).
  ``Alternating`` is that model in small (Note [Arguments a checkpoint frame holds]).
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from conftest import planned_peak
from remat.core.plan_format import Plan, Region
from remat.core.solve import simulate
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile

D, S, B = 32, 64, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # the bias is added, not multiplied: no op saves it (it is an argument only)
        return x + torch.tanh(self.lin(x + bias))


class Alternating(nn.Module):
    """Four blocks; even ones get one (B, S, D) tensor made before them, odd ones another."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        biases = {"even": torch.ones_like(h).cumsum(1), "odd": torch.ones_like(h).cumsum(2)}
        for i, block in enumerate(self.blocks):
            h = block(h, biases["even" if i % 2 == 0 else "odd"])
        return h


def _loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).pow(2).mean()


def _measured(model: nn.Module, batch: torch.Tensor, plan: Plan) -> int:
    return planned_peak(model, batch, _loss, plan)


def test_each_stage_records_the_arguments_its_call_got() -> None:
    model, batch = Alternating(), torch.randn(B, S, D)
    prof = remat.profile(model, batch, _loss, repeats=1)
    nbytes = B * S * D * 4
    assert prof.fixed.args_at_return_bytes == 2 * nbytes
    tensors = [tuple(a.tensor for a in s.call_args) for s in prof.stages]
    assert tensors[0] == tensors[2] != tensors[1] == tensors[3]
    assert all(a.nbytes == nbytes for s in prof.stages for a in s.call_args)


def test_regions_over_stages_with_other_arguments_are_predicted_to_the_byte() -> None:
    model, batch = Alternating(), torch.randn(B, S, D)
    prof = remat.profile(model, batch, _loss, repeats=1)
    problem = problem_from_profile(prof)
    names = prof.stage_names
    plans = [
        no_checkpoint_plan(problem),
        Plan(names, regions=(Region(0, 2),)),  # holds both tensors past the return
        Plan(names, regions=(Region(0, 1),)),  # holds one of them
    ]
    # Before each stage's arguments were read, the region over an even and an odd block
    # missed by one tensor; before the last stage's input was held at the chain's end
    # (its caller's frame: Note [The last stage's input at the chain's end]), every plan
    # was 32,768 bytes (that input) under at the top of the backward.
    gaps = {_measured(model, batch, plan) - simulate(plan, problem).peak_bytes
            for plan in plans}
    assert gaps == {0}, gaps

