"""An MLP chain whose blocks differ widely in saved-activation size and compute.

Wide blocks (``"w"``) expand each of the ``d_model`` features into ``expansion`` shifted
ReLU copies and mix them back with one weight vector: a (B, d_model, expansion) tensor is
saved for backward, but the block does only a few elementwise FLOPs per element. Narrow
blocks (``"n"``) apply one square ``d_model`` x ``d_model`` layer ``depth`` times: only
(B, d_model) tensors are saved, yet each step is a full matmul. At the defaults a wide
block saves over 10x the bytes of a narrow one and a narrow block does over 10x its FLOPs,
so checkpointing every block alike is far from optimal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, seeded

KINDS = ("w", "n")
DEFAULT_PATTERN = "wnnwwnwnnnwn"  # aperiodic, so no fixed checkpoint stride lines up with it


class HeteroBlock(nn.Module):
    """A residual block ``x + f(x)`` on (B, d_model); ``kind`` picks wide-cheap or narrow-costly."""

    def __init__(self, kind: str, d_model: int, *, expansion: int, depth: int) -> None:
        super().__init__()
        if kind not in KINDS:
            raise UsageError(
                f"unknown block kind {kind!r}; use one of {', '.join(map(repr, KINDS))}"
            )
        self.kind = kind
        self.depth = depth
        if kind == "w":
            # Feature i is expanded to relu(x_i + shift[i, j]) for j < expansion, then mixed.
            self.shift = nn.Parameter(torch.randn(d_model, expansion))
            self.mix = nn.Parameter(torch.randn(expansion) / expansion)
        else:
            # One square layer applied ``depth`` times (weights shared across the loop).
            self.layer = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "w":
            wide = torch.relu_(x.unsqueeze(-1) + self.shift)  # (B, d, e), saved for backward
            return x + wide @ self.mix  # (B, d)
        y = x
        for _ in range(self.depth):
            y = torch.tanh(self.layer(y) + x)  # (B, d), saved once per iteration
        return x + y

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}" + (f", depth={self.depth}" if self.kind == "n" else "")


class HeteroMLP(nn.Module):
    """Input projection, a chain of ``HeteroBlock`` in ``blocks``, LayerNorm and a classifier."""

    def __init__(
        self,
        *,
        in_features: int,
        d_model: int,
        num_classes: int,
        kinds: list[str],
        expansion: int,
        depth: int,
    ) -> None:
        super().__init__()
        self.proj_in = nn.Linear(in_features, d_model)
        self.blocks = nn.Sequential(
            *(HeteroBlock(k, d_model, expansion=expansion, depth=depth) for k in kinds)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map features (B, in_features) to logits (B, num_classes)."""
        return self.head(self.norm(self.blocks(self.proj_in(x))))


def hetero_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the logits; ``batch`` is ``(x, labels)`` or a dict of them."""
    if isinstance(batch, dict):
        x, labels = batch["x"], batch["labels"]
    else:
        x, labels = batch
    return F.cross_entropy(model(x), labels)


def mlp_hetero(
    *,
    n_blocks: int = 12,
    d_model: int = 768,
    pattern: str = DEFAULT_PATTERN,
    expansion: int = 80,
    depth: int = 5,
    in_features: int = 64,
    num_classes: int = 10,
    batch_size: int = 64,
    seed: int = 0,
) -> tuple[HeteroMLP, tuple[torch.Tensor, torch.Tensor], Any]:
    """Build the chain, a random ``(x, labels)`` batch and the loss.

    ``pattern`` is a string of ``w`` (wide, cheap) and ``n`` (narrow, costly) blocks,
    repeated or cut to ``n_blocks``; ``expansion`` is the wide blocks' width factor and
    ``depth`` the number of matmuls in a narrow block.
    """
    for name, value in (
        ("n_blocks", n_blocks),
        ("d_model", d_model),
        ("expansion", expansion),
        ("depth", depth),
        ("in_features", in_features),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    check_int("num_classes", num_classes, minimum=2)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(KINDS):
        raise UsageError(
            f"option pattern={pattern!r} is invalid; give a string of 'w' and 'n' such as 'wn'"
        )
    kinds = [pattern[i % len(pattern)] for i in range(n_blocks)]
    with seeded(seed):
        model = HeteroMLP(
            in_features=in_features,
            d_model=d_model,
            num_classes=num_classes,
            kinds=kinds,
            expansion=expansion,
            depth=depth,
        )
        x = torch.randn(batch_size, in_features)
        labels = torch.randint(0, num_classes, (batch_size,))
    return model, (x, labels), hetero_loss
