"""Fake profiles of transformers models for an accelerator (docs/fake.md, "Target
devices"): transformers builds a causal mask for fake tensors, which it cannot read, where
on the device it runs an unpadded batch with ``is_causal`` and grouped key/value heads."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.models import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, HIDDEN, HEADS, KV_HEADS = 2, 32, 64, 4, 2
LLAMA = {"num_hidden_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "intermediate_size": 128, "vocab_size": 128,
         "seq_len": S, "max_position_embeddings": 64, "batch_size": B}
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def _fake_profile(spec: str, options: dict[str, Any], **kwargs: Any) -> remat.Profile:
    torch.set_default_dtype(torch.bfloat16)
    try:
        with remat.fake_mode():
            model, batch, loss_fn = load_model(spec, **options)
    finally:
        torch.set_default_dtype(torch.float32)
    return remat.profile(model, batch, loss_fn, fake=True, options=["keep"], **kwargs)


@pytest.mark.parametrize("switch", [True, False])
def test_an_unpadded_causal_mask_runs_as_is_causal_with_grouped_heads(
    switch: bool, monkeypatch: Any
) -> None:
    if not switch:  # a transformers without the switch repeats the heads: the stand-in
        # keeps one of each group instead (transformers 5.17 on the H200)
        monkeypatch.setattr("remat.profiling.device_kernels._FORCE_GQA", "REMAT_NO_SWITCH")
    before = os.environ.get(FORCE_GQA)
    unpadded = _fake_profile("hf:llama", LLAMA, device="h100-sxm")
    assert os.environ.get(FORCE_GQA) == before  # transformers' switch is put back
    padded = _fake_profile("hf:llama", LLAMA, device="h100-sxm", padded_batches=True)
    assert unpadded.kernels is not None and padded.kernels is not None
    assert all(dict(calls) == {"flash (causal mask as is_causal)": 1}
               for calls in unpadded.kernels.values())
    assert all(dict(calls) == {"memory-efficient": 1} for calls in padded.kernels.values())
    # with a mask transformers repeats the grouped key and value to every head and
    # attention keeps the copies: exactly the difference (bf16; with one key/value head
    # the repeat is a view, no copy)
    repeated = 2 * B * S * (HIDDEN - HIDDEN * KV_HEADS // HEADS) * 2
    for u, p in zip(unpadded.stages, padded.stages, strict=True):
        assert p.saved_bytes["keep"] - u.saved_bytes["keep"] == repeated


@pytest.mark.parametrize("window,kernel", [(16, "memory-efficient"),
                                           (64, "flash (causal mask as is_causal)")])
def test_a_sliding_window_the_sequence_reaches_keeps_its_mask(window: int, kernel: str
                                                               ) -> None:
    # transformers masks a window the sequence reaches on the device too
    options = {**LLAMA, "sliding_window": window}
    found = _fake_profile("hf:mistral", options, device="h100-sxm")
    assert found.kernels is not None
    assert all(dict(calls) == {kernel: 1} for calls in found.kernels.values())
