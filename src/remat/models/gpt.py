"""A small nanoGPT-style decoder-only transformer (pre-LayerNorm, tied embeddings)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, check_prob, seeded


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block; takes and returns the hidden state (B, T, C) only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``blocks``, final LayerNorm, lm_head tied to ``wte``."""

    def __init__(
        self,
        *,
        n_layer: int,
        n_embd: int,
        n_head: int,
        block_size: int,
        vocab_size: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, T) to logits (B, T, vocab_size)."""
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTPart(nn.Module):
    """Pipeline rank ``rank`` of ``ranks``' share of ``model`` (a manual split, the
    torchtitan way: each rank keeps its own modules). The first embeds token ids, the
    last normalises and projects to logits; ``blocks`` are split evenly, the first ranks
    taking one more where they do not divide. The modules are ``model``'s own (its tied
    ``wte``/``lm_head`` weight is one parameter on a rank that holds both, two copies
    on two ranks, as in any pipeline)."""

    def __init__(self, model: GPT, rank: int, ranks: int) -> None:
        super().__init__()
        n = len(model.blocks)
        if not 0 <= rank < ranks <= n:
            raise ValueError(f"rank {rank} of {ranks} does not split {n} blocks")
        lo = rank * (n // ranks) + min(rank, n % ranks)
        hi = lo + n // ranks + (rank < n % ranks)
        self.first, self.last = rank == 0, rank == ranks - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first rank, hidden states (B, T, C) after it; logits
        (B, T, vocab_size) from the last, hidden states from the others."""
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of next-token logits against ``targets`` (a pipeline's loss_fn)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of next-token logits; ``batch`` is ``(idx, targets)`` or a dict of them."""
    if isinstance(batch, dict):
        idx, targets = batch["idx"], batch["targets"]
    else:
        idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt(
    *,
    n_layer: int = 8,
    n_embd: int = 128,
    n_head: int = 4,
    block_size: int = 128,
    seq_len: int | None = None,
    vocab_size: int = 512,
    dropout: float = 0.1,
    batch_size: int = 8,
    seed: int = 0,
) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor], Any]:
    """Build the GPT, a random ``(idx, targets)`` batch of shape (batch_size, seq_len) and the loss.

    ``block_size`` is the model's context length; ``seq_len`` (default ``block_size``) is the
    batch's sequence length and may not exceed it.
    """
    check_int("n_layer", n_layer)
    check_int("n_embd", n_embd)
    check_int("n_head", n_head)
    check_int("block_size", block_size)
    check_int("vocab_size", vocab_size)
    check_int("batch_size", batch_size)
    dropout = check_prob("dropout", dropout)
    if n_embd % n_head:
        raise UsageError(
            f"n_embd={n_embd} is not divisible by n_head={n_head}; pick sizes where it is"
        )
    seq = block_size if seq_len is None else check_int("seq_len", seq_len)
    if seq > block_size:
        raise UsageError(
            f"seq_len={seq} exceeds block_size={block_size}; lower seq_len or raise block_size"
        )
    with seeded(seed):
        model = GPT(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            block_size=block_size,
            vocab_size=vocab_size,
            dropout=dropout,
        )
        data = torch.randint(0, vocab_size, (batch_size, seq + 1))
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # (B, T) each
    return model, (idx, targets), gpt_loss
