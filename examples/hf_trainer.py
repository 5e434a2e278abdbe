"""remat in Hugging Face's Trainer: one line checkpoints the model under a memory budget.

    .venv/bin/python examples/hf_trainer.py

A tiny Llama with random weights (nothing is downloaded) trains 8 steps on the CPU.
``gradient_checkpointing=True`` is on to show what happens: remat turns transformers'
checkpointing off, says so, and checkpoints by its own plan instead, which keeps every
step's peak within 60% of the step's peak without checkpointing
(docs/integrations/transformers.md).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from remat.integrations.transformers_trainer import add_remat


def main() -> None:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a small CPU
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256))
    tokens = torch.randint(0, 256, (32, 128), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens.tolist()]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=8,
        gradient_checkpointing=True, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=2, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)

    remat = add_remat(trainer, "60%")  # plans at the start of train() on the first batch

    trainer.train()
    assert remat.checkpoint is not None
    print(remat.checkpoint.report)
    print(f"region rebuilds during training: {remat.checkpoint.handle.rebuilds}")


if __name__ == "__main__":
    main()
