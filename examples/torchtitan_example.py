"""remat as torchtitan's activation-checkpointing mode, on torchtitan's llama3 built tiny
on the CPU the way its Trainer builds it (meta device, checkpointing, then materialized).

    python examples/torchtitan_example.py

torchtitan's Trainer itself cannot train a language model on a CPU (flex attention has
no CPU backward, varlen attention needs CUDA), so this runs its model in a plain loop
with torchtitan's ScaledDotProductAttention; in a torchtitan config you would write
``config.activation_checkpoint = RematAC.Config(budget=..., local_batch_size=...,
seq_len=...)``. torchtitan 0.3.0's models package imports triton: install it
(``pip install triton``) to run this.
"""

from __future__ import annotations

import torch
import torchtitan.models.llama3 as llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention

from remat.integrations.torchtitan_mode import RematAC, token_loss

VOCAB, DIM, HEADS, LAYERS, BATCH, SEQ = 256, 64, 4, 4, 8, 128


def tiny_llama3() -> llama3.Llama3Model.Config:
    layers = llama3._build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=4 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    for layer in layers:  # torchtitan's SDPA module: trains on a CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=llama3._output_linear_init(DIM)))


def main() -> None:
    with torch.device("meta"):
        model = tiny_llama3().build()
    ac = RematAC.Config(budget="50%", local_batch_size=BATCH, seq_len=SEQ).build()
    ac.apply(model)  # what torchtitan's parallelize_fn does with config.activation_checkpoint
    print("plan:", ac.plan.regions if ac.plan else None, ac.plan.options if ac.plan else None)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        batch = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ)))
        loss = token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    assert ac.handle is not None
    print(f"region rebuilds: {ac.handle.rebuilds}")


if __name__ == "__main__":
    main()
