"""A small expert-parallel mixture-of-experts block: each rank holds ``experts / ranks``
of the experts, and tokens travel to their expert's rank and back by two all-to-alls.

Written for counting what a rebuild communicates (``docs/tensor-parallel.md``), with fixed
message sizes: every rank sends every other rank a slot per token (zero where the token's
expert lives elsewhere), with a one-hot of the local expert it goes to, so the
all-to-alls' splits are equal and no token is dropped. ``ranks=1`` with no group is the
same computation in one process, all experts local (the reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EPBlock", "EPModel"]


class EPBlock(nn.Module):
    """Norm, top-1 router over ``experts`` (on every rank), this rank's experts."""

    def __init__(self, dim: int, experts: int, rank: int = 0, ranks: int = 1,
                 group: Any = None) -> None:
        super().__init__()
        if experts % ranks:
            raise ValueError(f"{experts} experts do not split over {ranks} ranks")
        self.local, self.rank, self.ranks, self.group = experts // ranks, rank, ranks, group
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(self.local))

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        if self.ranks == 1:
            return x
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(x.contiguous(), None, None, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x).reshape(b * t, d)
        weight, chosen = torch.topk(self.gate(h).softmax(-1), 1, dim=-1)
        owner, slot = chosen[:, 0] // self.local, chosen[:, 0] % self.local
        # to every rank j: each token (zero where its expert is not on j) and a one-hot
        # of its local expert there
        send = torch.stack([
            torch.cat([h * (owner == j).unsqueeze(-1).to(h.dtype),
                       F.one_hot(slot, self.local).to(h.dtype)
                       * (owner == j).unsqueeze(-1).to(h.dtype)], dim=-1)
            for j in range(self.ranks)])
        got = self._exchange(send)  # [source rank, token, d + local]
        tokens, onehot = got[..., :d], got[..., d:]
        done = sum(onehot[..., e:e + 1] * expert(tokens)
                   for e, expert in enumerate(self.experts))
        back = self._exchange(done)  # [expert rank, token, d]: zero but from the owner
        return x + (back.sum(0) * weight).reshape(b, t, d)


class EPModel(nn.Module):
    """Embedding, ``layers`` expert-parallel blocks, a head to logits."""

    def __init__(self, *, vocab: int = 64, dim: int = 32, experts: int = 4, layers: int = 2,
                 rank: int = 0, ranks: int = 1, group: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(EPBlock(dim, experts, rank, ranks, group)
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
