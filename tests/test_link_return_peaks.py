"""What the code between two stages holds to the return, and the two tensors at one
boundary (Note [What the code between stages holds to the return] and Note [Two tensors
at one boundary] in remat.profiling.assemble).

SigLIP runs a vision tower, norms its last hidden state (the norm saves the tower's
output), keeps the normed state in the model's output and pools it; then the text tower
starts from token embeddings. Every text stage's backward of hf:siglip was predicted
671,744 bytes over without checkpointing (1.05% at its peak): the normed state, which no
backward needs, was charged to the first text stage's backward, and the tower's output
(saved by the norm) once as that stage's input and again as the norm's saved tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from conftest import planned_peak, stage_maxima
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve.simulator import simulate
from remat.measure.records import Phase

B, S, WIDE, NARROW, V = 4, 32, 64, 16, 20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TwoTowers(nn.Module):
    """A wide tower, its output normed and the normed state only held (returned), a
    narrow tower from token embeddings after a value read (no region spans that code)."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Linear(8, WIDE)
        self.wide = nn.ModuleList(Block(WIDE) for _ in range(2))
        self.post_norm = nn.LayerNorm(WIDE)
        self.pool = nn.Linear(WIDE, NARROW)
        self.tokens = nn.Embedding(V, NARROW)
        self.narrow = nn.ModuleList(Block(NARROW) for _ in range(3))

    def _wide_tower(self, x: torch.Tensor) -> torch.Tensor:  # its locals go at its return
        h = self.patches(x)
        for block in self.wide:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        # the norm saves the tower's output; mean saves nothing: state is only held
        state = self.post_norm(self._wide_tower(x))
        pooled = self.pool(state.mean(1))
        if bool(ids.min() < 0):  # a value read into Python: the chain breaks here
            raise ValueError("negative token id")
        t = self.tokens(ids)
        for block in self.narrow:
            t = block(t)
        return {"state": state, "image": pooled, "text": t.mean(1)}


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(*batch)
    return (out["image"] * out["text"]).sum()


@pytest.fixture(scope="module")
def towers() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], remat.Profile]:
    torch.manual_seed(0)
    model = TwoTowers()
    batch = (torch.randn(B, S, 8), torch.randint(0, V, (B, S)))
    stages = ["wide.0", "wide.1", "narrow.0", "narrow.1", "narrow.2"]
    return model, batch, remat.profile(model, batch, loss_fn, stages=stages, repeats=1,
                                       options=("keep",))


def test_the_profile_measures_what_the_code_between_holds_to_the_return(towers) -> None:
    _, _, profile = towers
    first = profile.stages[2]
    assert first.break_before is not None
    assert first.link_at_return_bytes == B * S * WIDE * 4  # the normed state
    assert [s.link_at_return_bytes for s in profile.stages] == [0, 0, B * S * WIDE * 4, 0, 0]


@pytest.mark.parametrize("regions", [(), ((0, 2),), ((3, 5),), ((0, 1), (1, 2), (2, 3))],
                         ids=["none", "wide", "narrow", "per-stage"])
def test_the_narrow_towers_later_stages_are_predicted_to_the_byte(towers, regions) -> None:
    model, batch, profile = towers
    plan = Plan(profile.stage_names, regions=tuple(Region(*r) for r in regions))
    sim = simulate(plan, to_problem(profile))
    events = dict(sim.events)
    measured = stage_maxima(model, batch, loss_fn, plan, Phase.BACKWARD)
    for name in ("narrow.1", "narrow.2"):  # (narrow.0's backward charges its input's
        # gradient at the boundary's one size, the wide tower's: over by the difference)
        assert events[f"backward {name}"] == measured[name], name
    assert sim.peak_bytes >= planned_peak(model, batch, loss_fn, plan)
