"""remat with TRL's SFTTrainer, whose batches are padded to their own longest sequence.

    .venv/bin/python examples/trl_sft.py

Examples of 16 to 128 tokens make every batch a different shape; the collator pads each
batch to its longest example, rounded up to a multiple of 8. ``shapes="seq=16..128"``
makes remat plan a plan set over that range (with the collator's multiple as its step:
seq=16..128:8): each step runs the fastest plan predicted within the budget at its own
length, so short batches rebuild less than the longest needs. SFTConfig turns gradient
checkpointing on by default; remat replaces it and says so. ``bf16=False``: a plan set
cannot be profiled under autocast yet (docs/integrations/transformers.md). A tiny Llama
and a word-level tokenizer built in memory: nothing is downloaded.
"""

from __future__ import annotations

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from remat.integrations.transformers_trainer import add_remat

VOCAB, MAX_LENGTH = 256, 128


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="</s>")


def main() -> None:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a small CPU
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, MAX_LENGTH, (64,), generator=g).tolist()
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))
             for n in lengths]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0))
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=8,
        max_length=MAX_LENGTH, pad_to_multiple_of=8, use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=2, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer(),
                         train_dataset=Dataset.from_dict({"text": texts}))

    remat = add_remat(trainer, "60%", shapes=f"seq=16..{MAX_LENGTH}")

    trainer.train()
    assert remat.checkpoint is not None
    print(remat.checkpoint.report)  # one line per plan: the lengths it runs


if __name__ == "__main__":
    main()
