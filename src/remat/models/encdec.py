"""A small T5-shaped encoder-decoder: two stacks, the decoder cross-attending to the encoder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, check_prob, seeded


class Attention(nn.Module):
    """Multi-head attention of ``x`` over ``context`` (itself by default)."""

    def __init__(self, d_model: int, n_head: int, *, causal: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.causal = causal
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        B, T, C = x.shape
        S = context.shape[1]
        q = self.q(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k, v = self.kv(context).split(C, dim=2)
        k = k.view(B, S, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, S, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(F.relu(self.wi(x))))


class EncoderBlock(nn.Module):
    """Pre-norm self-attention and feed-forward, each with dropout and a residual add."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_head, causal=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.dropout(self.attn(self.norm1(h)))
        return h + self.dropout(self.ff(self.norm2(h)))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, feed-forward."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.self_attn = Attention(d_model, n_head, causal=True)
        self.norm2 = nn.RMSNorm(d_model)
        self.cross_attn = Attention(d_model, n_head, causal=False)
        self.norm3 = nn.RMSNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, encoder_out: torch.Tensor) -> torch.Tensor:
        h = h + self.dropout(self.self_attn(self.norm1(h)))
        h = h + self.dropout(self.cross_attn(self.norm2(h), encoder_out))
        return h + self.dropout(self.ff(self.norm3(h)))


class Stack(nn.Module):
    """``block`` (an nn.ModuleList run in this module's own loop), then ``final_layer_norm``."""

    def __init__(self, blocks: list[nn.Module], d_model: int, dropout: float) -> None:
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.final_layer_norm = nn.RMSNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, encoder_out: torch.Tensor | None = None) -> torch.Tensor:
        h = self.dropout(h)
        for block in self.block:
            h = block(h) if encoder_out is None else block(h, encoder_out)
        return self.dropout(self.final_layer_norm(h))


class EncoderDecoder(nn.Module):
    """``shared`` embedding, ``encoder`` and ``decoder`` stacks, ``lm_head``."""

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        n_head: int,
        d_ff: int,
        n_encoder_layers: int,
        n_decoder_layers: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab_size, d_model)
        args = (d_model, n_head, d_ff, dropout)
        self.encoder = Stack(
            [EncoderBlock(*args) for _ in range(n_encoder_layers)], d_model, dropout
        )
        self.decoder = Stack(
            [DecoderBlock(*args) for _ in range(n_decoder_layers)], d_model, dropout
        )
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """Map source (B, S) and decoder input (B, T) token ids to logits (B, T, vocab)."""
        encoder_out = self.encoder(self.shared(input_ids))
        return self.lm_head(self.decoder(self.shared(decoder_input_ids), encoder_out))


def encdec_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the decoder's logits against ``labels``.

    ``batch`` is ``(input_ids, decoder_input_ids, labels)`` or a dict of them.
    """
    if isinstance(batch, dict):
        src, tgt_in, labels = batch["input_ids"], batch["decoder_input_ids"], batch["labels"]
    else:
        src, tgt_in, labels = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def encdec(
    *,
    n_encoder_layers: int = 4,
    n_decoder_layers: int = 4,
    d_model: int = 64,
    n_head: int = 4,
    d_ff: int = 256,
    vocab_size: int = 256,
    src_len: int = 32,
    tgt_len: int = 32,
    dropout: float = 0.1,
    batch_size: int = 8,
    seed: int = 0,
) -> tuple[EncoderDecoder, tuple[torch.Tensor, torch.Tensor, torch.Tensor], Any]:
    """Build the model, a random ``(input_ids, decoder_input_ids, labels)`` batch and the loss.

    The labels are the decoder inputs shifted by one (teacher forcing).
    """
    for name, value in (
        ("n_encoder_layers", n_encoder_layers),
        ("n_decoder_layers", n_decoder_layers),
        ("d_model", d_model),
        ("n_head", n_head),
        ("d_ff", d_ff),
        ("vocab_size", vocab_size),
        ("src_len", src_len),
        ("tgt_len", tgt_len),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    dropout = check_prob("dropout", dropout)
    if d_model % n_head:
        raise UsageError(
            f"d_model={d_model} is not divisible by n_head={n_head}; pick sizes where it is"
        )
    with seeded(seed):
        model = EncoderDecoder(
            vocab_size=vocab_size,
            d_model=d_model,
            n_head=n_head,
            d_ff=d_ff,
            n_encoder_layers=n_encoder_layers,
            n_decoder_layers=n_decoder_layers,
            dropout=dropout,
        )
        src = torch.randint(0, vocab_size, (batch_size, src_len))
        tgt = torch.randint(0, vocab_size, (batch_size, tgt_len + 1))
    return model, (src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()), encdec_loss
