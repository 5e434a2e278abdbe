"""Parameters the code between stages reads are no gradients pending at earlier stages:
a parameter's gradient is counted as one, and the step is exact without charging it twice.

hf:bart embeds the decoder's input in the code between the encoder and the decoder,
reading the shared token embedding and the position embedding; the profile charged their
bytes as gradients pending at every encoder layer's backward, each predicted 707,584
bytes over (Note [Gradients pending before the chain] in remat.profiling.links).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.plan_format import Plan
from remat.core.planner import to_problem
from remat.core.solve.simulator import simulate
from remat.measure import measure_step

B, S, D, V = 4, 16, 32, 512  # a token table (V x D) larger than an activation (B x S x D)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        y = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return y if memory is None else y + memory


class EncoderDecoder(nn.Module):
    """Two encoder blocks; the decoder's input embedded between them and the decoder's two
    blocks, which also read the encoder's output. One token table, as bart's ``shared``:
    the encoder's, the decoder's and the head's (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.encoder = nn.ModuleList(Block() for _ in range(2))
        self.target = self.embed
        self.decoder = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.encoder:
            h = block(h)
        memory, h = h, self.target(ids.flip(1))
        for block in self.decoder:
            h = block(h, memory)
        return self.head(h)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).square().mean()


@pytest.fixture(scope="module")
def measured() -> tuple[remat.Profile, dict[str, int]]:
    torch.manual_seed(0)
    model, ids = EncoderDecoder(), torch.randint(0, V, (B, S))
    profile = remat.profile(model, ids, loss_fn, repeats=1)
    step = measure_step(model, ids, loss_fn, timeline=True)
    assert step.timeline is not None
    peaks: dict[str, int] = {}
    for event in step.timeline:
        for name in profile.stage_names:
            if event.phase.value == "backward" and (
                    event.module_path == name or event.module_path.startswith(name + ".")):
                peaks[name] = max(peaks.get(name, 0), event.live_bytes)
    return profile, peaks


def test_every_stage_backward_without_checkpointing_is_predicted_to_the_byte(measured) -> None:
    profile, peaks = measured
    sim = simulate(Plan(profile.stage_names), to_problem(profile))
    events = dict(sim.events)
    assert {n: events[f"backward {n}"] for n in profile.stage_names} == peaks
