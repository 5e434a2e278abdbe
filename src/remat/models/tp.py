"""A small decoder written the way tensor-parallel recipes expect (torchtitan's Llama
layout: separate ``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``, heads taken from the local
width), and :func:`parallelize`, torchtitan's tensor- and sequence-parallel plan for it.

The model runs as is on one process; after :func:`parallelize` on a 1-D device mesh its
linears are sharded (column-wise in, row-wise out), and with ``sequence_parallel`` the
residual stream between them is sharded along the sequence: each block's norms run on
the local sequence shard, its attention and MLP all-gather their input and
reduce-scatter their output (two all-gathers and two reduce-scatters per block)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.models._common import seeded

__all__ = ["TPTransformer", "parallelize", "tp_transformer"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # heads from the local width: a column-wise shard holds heads / ranks of them
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TPTransformer(nn.Module):
    """Token embeddings, ``layers``, a final norm and an output projection to logits."""

    def __init__(self, *, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tp_transformer(*, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4,
                   batch: int = 4, seq: int = 32, seed: int = 0
                   ) -> tuple[TPTransformer, tuple[torch.Tensor, torch.Tensor]]:
    """The model (same weights for the same seed on every process) and a batch of token
    ids with next-token targets."""
    with seeded(seed):
        model = TPTransformer(vocab=vocab, dim=dim, heads=heads, layers=layers)
        tokens = torch.randint(0, vocab, (batch, seq + 1))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def parallelize(model: TPTransformer, mesh: Any, *, sequence_parallel: bool = True
                ) -> TPTransformer:
    """torchtitan's tensor-parallel plan on ``mesh`` (1-D), in place: attention and MLP
    inputs column-wise, their outputs row-wise; with ``sequence_parallel`` the norms and
    the residual stream sharded along the sequence (dimension 1). Logits come back whole
    on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for layer in model.layers:
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(stream,),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(layer, mesh, plan)
    return model
