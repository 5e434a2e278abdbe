"""What the model's forward holds before the chain and lets go of at its return.

A decoder (hf:opt, gpt2) makes token and position embeddings, adds them into the first
layer's input and keeps both in its locals until its forward returns; their backward needs
neither. Charged to the pre-chain's backward, every stage's backward was predicted their
bytes over (hf:opt: 524,288 at every layer, under every plan). Note [What the forward lets
go of at its return] in remat.core.solve.simulator.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from conftest import planned_peak
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve.simulator import simulate

B, S, D, V = 4, 32, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Decoder(nn.Module):
    """Token and position embeddings summed into the first block's input, both held in
    locals to the return (as transformers' decoders do), then four blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(V, D), nn.Embedding(S, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tok = self.tokens(ids)
        pos = self.positions(torch.arange(ids.shape[1]).expand_as(ids))
        h = tok + pos
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


@pytest.fixture(scope="module")
def decoder() -> tuple[nn.Module, torch.Tensor, remat.Profile]:
    torch.manual_seed(0)
    model, ids = Decoder(), torch.randint(0, V, (B, S))
    return model, ids, remat.profile(model, ids, loss_fn, repeats=1)


def test_the_profile_measures_the_embeddings_the_forward_lets_go_of(decoder) -> None:
    _, _, profile = decoder
    embeddings = 2 * B * S * D * 4  # tok and pos; the position ids are int64, B x S
    assert profile.fixed.pre_chain_at_return_bytes == embeddings
    # and still counts them in the pre-chain (alive through the forward)
    assert profile.fixed.pre_chain_bytes >= embeddings


@pytest.mark.parametrize("regions", [(), "per-stage", ((0, 4),), ((3, 4),)],
                         ids=["none", "per-stage", "one", "last"])
def test_a_stage_backward_peak_is_predicted_to_the_byte(decoder, regions) -> None:
    model, ids, profile = decoder
    names = profile.stage_names
    if regions == "per-stage":
        regions = tuple((i, i + 1) for i in range(len(names)))
    plan = Plan(names, regions=tuple(Region(*r) for r in regions))
    sim = simulate(plan, to_problem(profile))
    assert sim.peak_event.startswith("backward blocks."), sim.peak_event  # the case at hand
    assert sim.peak_bytes == planned_peak(model, ids, loss_fn, plan)
