"""remat with a PEFT LoRA model under Hugging Face's Trainer.

    .venv/bin/python examples/peft_lora.py

The base weights are frozen and only the adapters train; remat finds the decoder layers
inside the PeftModel (``base_model.model.model.layers.N``) and checkpoints them under the
budget, a tiny random-weight Llama on the CPU (docs/integrations/transformers.md).
"""

from __future__ import annotations

import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from remat.integrations.transformers_trainer import RematCallback


def main() -> None:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a small CPU
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16,
                                            target_modules=["q_proj", "v_proj"]))
    model.print_trainable_parameters()
    tokens = torch.randint(0, 256, (32, 128), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens.tolist()]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=8,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=2, disable_tqdm=True)

    remat = RematCallback("60%")  # the callback form of add_remat
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[remat])
    trainer.train()

    assert remat.checkpoint is not None
    print(remat.checkpoint.report)
    print("stages:", ", ".join(remat.checkpoint.plan.stages))


if __name__ == "__main__":
    main()
