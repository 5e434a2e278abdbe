"""remat in Hugging Face's Trainer, in PEFT LoRA models under Trainer, and in TRL's
SFTTrainer with dynamic padding (issue 48, item 4): ``RematCallback`` plans and applies
at ``on_train_begin``.

For each framework one module fixture trains twice from the same initial weights, seed
and data: once with remat (and ``gradient_checkpointing=True``, which remat must turn
off and replace), once plainly without any checkpointing. Both runs measure the peak of
every training step with remat's live-storage tracker, from the entry of
``Trainer.training_step`` (parameters, buffers, optimizer state and the step's batch
registered) to ``on_step_end`` (after the optimizer step, the scheduler and
``zero_grad``): the whole step the Trainer runs, its gradient clipping included.
The three tests per framework then read what their names say off those runs.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.core.errors import UsageError  # noqa: E402
from remat.integrations import transformers_trainer as tt  # noqa: E402
from remat.measure.tracker import LiveMemoryTracker, iter_tensors  # noqa: E402
from remat.runtime.existing import find  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, BATCH, STEPS = 256, 128, 4, 4


def tiny_llama(seed: int = 0, dropout: float = 0.0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        attention_dropout=dropout, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def token_lists(n: int, lengths: tuple[int, int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g)
    return [torch.randint(1, VOCAB, (int(k),), generator=g).tolist() for k in sizes]


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@dataclass
class Run:
    """What one training run left: the Trainer's logged losses, the measured peak of each
    step, the trained parameters, the callback (None without remat) and its warnings."""

    losses: list[float]
    peaks: list[int]
    lengths: list[int]
    params: dict[str, torch.Tensor]
    model: Any
    args: Any
    callback: tt.RematCallback | None
    said: list[str] = field(default_factory=list)


class StepPeaks(transformers.TrainerCallback):  # type: ignore[misc]
    """The measured peak of every optimizer step the Trainer runs (module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.peaks: list[int] = []
        self.lengths: list[int] = []  # each step's sequence length
        self.tracker: LiveMemoryTracker | None = None
        inner = trainer.training_step

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self.tracker is None:  # the step's first micro-batch
                opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
                gc.collect()
                tracker = LiveMemoryTracker()
                tracker.register_existing(trainer.model)
                tracker.register_existing(opt)
                tracker.register_existing(list(iter_tensors(dict(inputs))))
                tracker.watch(trainer.model)
                tracker.watch(opt)
                tracker.__enter__()
                self.tracker = tracker
                self.lengths.append(int(inputs["input_ids"].shape[-1]))
            return inner(model, inputs, *args, **kwargs)

        trainer.training_step = training_step
        trainer.add_callback(self)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.tracker is not None, "a step ended that training_step never began"
        self.tracker.__exit__(None, None, None)
        self.peaks.append(self.tracker.peak_bytes)
        self.tracker = None


def train(make_trainer: Any, callback: tt.RematCallback | None) -> Run:
    """Build the trainer (``gradient_checkpointing`` on where remat runs), add the
    callback and the step measurement, train, and keep what the run left."""
    trainer = make_trainer(checkpointing=callback is not None)
    if callback is not None:
        trainer.add_callback(callback)
    peaks = StepPeaks(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if p.requires_grad}
    return Run(losses, peaks.peaks, peaks.lengths, params, trainer.model, trainer.args, callback,
               [str(w.message) for w in caught])


def arguments(tmp: Path, checkpointing: bool, config: type | None = None, **kw: Any) -> Any:
    cls = config or transformers.TrainingArguments
    kw.setdefault("max_steps", STEPS)
    return cls(output_dir=str(tmp), per_device_train_batch_size=BATCH,
               logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
               disable_tqdm=True, gradient_checkpointing=checkpointing, **kw)


def both(make_trainer: Any, callback: tt.RematCallback) -> tuple[Run, Run]:
    return train(make_trainer, callback), train(make_trainer, None)


# --------------------------------------------------------------------------- Trainer

@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    tmp = tmp_path_factory.mktemp("trainer")
    data = [{"input_ids": ids} for ids in token_lists(4 * BATCH, (SEQ, SEQ))]

    def make(checkpointing: bool) -> Any:
        return transformers.Trainer(
            model=tiny_llama(dropout=0.1), args=arguments(tmp, checkpointing),
            train_dataset=data, data_collator=collate)

    return both(make, tt.RematCallback("60%", cache=tmp / "plans", repeats=1))


def check_budget(runs: tuple[Run, Run]) -> None:
    with_remat, plain = runs
    assert with_remat.callback is not None and with_remat.callback.checkpoint is not None
    budget = with_remat.callback.checkpoint.plan.budget_bytes
    assert budget is not None
    assert len(with_remat.peaks) == len(plain.peaks) == STEPS  # every step measured
    assert max(plain.peaks) > budget, "the budget does not bind: this test could not fail"
    over = [(i, p) for i, p in enumerate(with_remat.peaks) if p > budget]
    assert not over, f"steps over the {budget} B budget: {over}"


def check_equal(runs: tuple[Run, Run]) -> None:
    with_remat, plain = runs
    assert len(with_remat.losses) == STEPS
    assert with_remat.losses == plain.losses  # bitwise: floats compared exactly
    for name, value in plain.params.items():
        assert torch.equal(with_remat.params[name], value), name


def check_replaced(runs: tuple[Run, Run]) -> None:
    with_remat, _ = runs
    callback = with_remat.callback
    assert callback is not None and callback.checkpoint is not None
    assert callback.turned_off is not None
    assert any("remat turned transformers' checkpointing off" in s for s in with_remat.said)
    assert not find(with_remat.model).flagged  # transformers' flags stay off
    assert not with_remat.args.gradient_checkpointing
    assert remat.applied(with_remat.model)
    assert callback.checkpoint.plan.regions, "the plan checkpoints no region"
    # each step's backward rebuilt each region once: remat's plan is what ran
    assert callback.checkpoint.handle.rebuilds == STEPS * len(callback.checkpoint.plan.regions)


def test_trainer_every_step_peak_is_within_the_budget(trainer_runs: tuple[Run, Run]) -> None:
    check_budget(trainer_runs)


def test_trainer_losses_and_weights_equal_the_run_without_checkpointing(
    trainer_runs: tuple[Run, Run],
) -> None:
    check_equal(trainer_runs)  # with dropout on: remat's rebuilds replay the RNG


def test_trainer_gradient_checkpointing_is_replaced_by_remat_and_said(
    trainer_runs: tuple[Run, Run],
) -> None:
    check_replaced(trainer_runs)


def test_a_second_train_keeps_transformers_checkpointing_off_and_the_plan_on(
    trainer_runs: tuple[Run, Run], tmp_path: Path,
) -> None:
    callback = trainer_runs[0].callback
    assert callback is not None and callback.cache is not None
    data = [{"input_ids": ids} for ids in token_lists(BATCH, (SEQ, SEQ))]
    trainer = transformers.Trainer(
        model=tiny_llama(dropout=0.1), args=arguments(tmp_path, True, max_steps=1),
        train_dataset=data, data_collator=collate)
    again = tt.add_remat(trainer, "60%", cache=callback.cache)  # the plan from the cache
    for _ in range(2):  # Trainer.train() turns transformers' checkpointing on if asked
        trainer.train()
        assert not find(trainer.model).flagged
    assert again.checkpoint is not None and again.checkpoint.report.source == "cache"
    assert again.checkpoint.handle.rebuilds == 2 * len(again.checkpoint.plan.regions)


# --------------------------------------------------------------------------- PEFT LoRA

@pytest.fixture(scope="module")
def peft_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    peft = pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("peft")
    data = [{"input_ids": ids} for ids in token_lists(4 * BATCH, (SEQ, SEQ))]

    def make(checkpointing: bool) -> Any:
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                               target_modules=["q_proj", "v_proj", "up_proj"])
        model = peft.get_peft_model(tiny_llama(), lora)
        return transformers.Trainer(model=model, args=arguments(tmp, checkpointing),
                                    train_dataset=data, data_collator=collate)

    return both(make, tt.RematCallback("60%", cache=tmp / "plans", repeats=1))


def test_peft_every_step_peak_is_within_the_budget(peft_runs: tuple[Run, Run]) -> None:
    check_budget(peft_runs)


def test_peft_losses_and_adapter_weights_equal_the_run_without_checkpointing(
    peft_runs: tuple[Run, Run],
) -> None:
    check_equal(peft_runs)  # LoRA dropout on
    assert all("lora_" in name for name in peft_runs[0].params)  # only adapters train


def test_peft_stages_are_found_inside_the_peft_model_and_remat_replaces_its_checkpointing(
    peft_runs: tuple[Run, Run],
) -> None:
    callback = peft_runs[0].callback
    assert callback is not None and callback.checkpoint is not None
    stages = callback.checkpoint.plan.stages
    assert stages == tuple(f"base_model.model.model.layers.{i}" for i in range(3))
    check_replaced(peft_runs)


# --------------------------------------------------------------------------- TRL SFT

@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tmp = tmp_path_factory.mktemp("trl")
    lists = token_lists(4 * BATCH, (SEQ // 4, SEQ - 1))  # dynamic padding: lengths vary
    lists[5] += lists[6][: SEQ - len(lists[5])]  # one step (of an epoch) is the longest, SEQ
    data = datasets.Dataset.from_dict({"input_ids": lists})
    tokenizer = tiny_tokenizer()

    def make(checkpointing: bool) -> Any:
        args = arguments(tmp, checkpointing, trl.SFTConfig, max_length=SEQ,
                         dataset_num_proc=None)
        return trl.SFTTrainer(model=tiny_llama(dropout=0.1), args=args, train_dataset=data,
                              processing_class=tokenizer)

    # the plan is made for the longest batch the run can see: SEQ positions
    return both(make, tt.RematCallback("60%", pad_to=SEQ, cache=tmp / "plans", repeats=1))


def tiny_tokenizer() -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>",
                                                eos_token="</s>")


def test_trl_every_step_peak_is_within_the_budget_under_dynamic_padding(
    trl_runs: tuple[Run, Run],
) -> None:
    check_budget(trl_runs)
    # the batches really vary in length, up to the planned SEQ
    lengths = trl_runs[0].lengths
    assert len(set(lengths)) > 1 and max(lengths) == SEQ, lengths


def test_trl_losses_and_weights_equal_the_run_without_checkpointing(
    trl_runs: tuple[Run, Run],
) -> None:
    check_equal(trl_runs)


def test_trl_gradient_checkpointing_is_replaced_by_remat_and_said(
    trl_runs: tuple[Run, Run],
) -> None:
    check_replaced(trl_runs)


# --------------------------------------------------------------------------- the API

def test_importing_remat_and_its_integrations_does_not_import_transformers() -> None:
    code = ("import sys, remat, remat.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kwargs, said", [
    (dict(budget=None), "not a budget"),
    (dict(budget="12 parsecs"), "budget"),
    (dict(optimizer="adam"), "unknown"),
    (dict(pad_to=0), "not a sequence length"),
    (dict(loss_fn=3), "loss_fn is a int"),
])
def test_bad_arguments_are_usage_errors_when_the_callback_is_made(
    kwargs: dict[str, Any], said: str,
) -> None:
    args = {"budget": "60%", **kwargs}
    with pytest.raises(UsageError, match=said):
        tt.RematCallback(args.pop("budget"), **args)


def test_add_remat_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(UsageError, match="not a transformers Trainer"):
        tt.add_remat(object(), "60%")


def test_pad_to_pads_ids_labels_and_mask_to_the_longest_length() -> None:
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10]}])
    padded = tt._pad(batch, 5, pad_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 0, 0]]
    assert padded["labels"][:, 3:].eq(-100).all()
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0]] * 2
    with pytest.raises(UsageError, match="shorter than"):
        tt._pad(batch, 2, pad_id=0)


def test_the_trainers_optimizer_is_priced_as_remat_names_it() -> None:
    assert tt.remat_optimizer("adamw_torch_fused") == "adamw-fused"
    assert tt.remat_optimizer(transformers.training_args.OptimizerNames.ADAMW_TORCH) == "adamw"
    assert tt.remat_optimizer("adafactor") is None


@pytest.mark.parametrize("given", [False, True])
def test_the_example_batch_is_the_given_one_or_the_first_examples_collated_and_the_rng_stays(
    given: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = [{"input_ids": ids} for ids in token_lists(3 * BATCH, (8, 8))]
    trainer = transformers.Trainer(model=tiny_llama(), args=arguments(tmp_path, False),
                                   train_dataset=data, data_collator=collate)
    seen: dict[str, Any] = {}

    def fake(model: Any, budget: Any, **kwargs: Any) -> Any:
        torch.rand(3)  # a profile draws from the RNG: the callback forks it
        seen.update(kwargs, model=model, training=model.training)
        return type("Done", (), {"report": "stub"})()

    monkeypatch.setattr(tt, "auto_checkpoint", fake)
    mine = collate(data[5:7])
    callback = tt.RematCallback("60%", batch=mine if given else None, optimizer="sgd",
                                cache=False)
    trainer.model.eval()
    rng = torch.get_rng_state()
    callback.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model,
                            train_dataloader=trainer.get_train_dataloader())
    assert torch.equal(torch.get_rng_state(), rng)
    expected = mine if given else collate(data[:BATCH])
    assert seen["batch"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(seen["batch"][key], value), key
    assert seen["model"] is trainer.model and seen["training"] and not trainer.model.training
    assert seen["loss_fn"] is tt.model_loss and seen["optimizer"] == "sgd"
