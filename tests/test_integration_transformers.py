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

TRL again with a plan set (``shapes=``, issue 48, item 4 of the plan-set increment): the
batches of a run come in lengths 48 to 128, padded to multiples of 8, in a fixed order;
each step runs the plan of its length, and each is measured as above.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.core.errors import CheckFailed, UsageError  # noqa: E402
from remat.core.plan_set import PlanSet  # noqa: E402
from remat.core.shapes import parse_shapes  # noqa: E402
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
    # regions or selective options, as the planner's measured times choose (they move
    # with the machine's load)
    assert not callback.checkpoint.plan.checkpoints_nothing, "the plan checkpoints nothing"
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


# --------------------------------------------------------------------------- TRL, plan set

#: each step's longest example, in the order the steps run (a sequential sampler); the
#: collator pads to multiples of 8: lengths 128, 48, 80, 104
SET_MAXIMA = (128, 41, 75, 100)
SET_RANGE = "seq=40..128"  # given without a step: planned as seq=40..128:8


def sft_lists(maxima: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """BATCH examples per step: one of the step's longest length, the rest shorter."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for most in maxima:
        for j in range(BATCH):
            n = most if j == 1 else int(torch.randint(most // 2, most + 1, (1,), generator=g))
            out.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
    return out


def sft_trainer(tmp: Path, lists: list[list[int]], checkpointing: bool, **kw: Any) -> Any:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    kw.setdefault("bf16", False)  # under autocast a plan set cannot be profiled yet (below)
    kw.setdefault("max_length", SEQ)
    args = arguments(tmp, checkpointing, trl.SFTConfig, dataset_num_proc=None,
                     pad_to_multiple_of=8, train_sampling_strategy="sequential",
                     max_steps=len(lists) // BATCH, **kw)
    return trl.SFTTrainer(model=tiny_llama(dropout=0.1), args=args,
                          train_dataset=datasets.Dataset.from_dict({"input_ids": lists}),
                          processing_class=tiny_tokenizer())


class Running(transformers.TrainerCallback):  # type: ignore[misc]
    """The plan each step ran: the callback's ``handle.running`` at each step's end."""

    def __init__(self, callback: tt.RematCallback) -> None:
        self.callback = callback
        self.plans: list[Any] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.callback.checkpoint is not None
        self.plans.append(self.callback.checkpoint.handle.running)


@pytest.fixture(scope="module")
def trl_set_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run, list[Any]]:
    tmp = tmp_path_factory.mktemp("trl-set")
    lists = sft_lists(SET_MAXIMA)
    callback = tt.RematCallback("60%", shapes=SET_RANGE, cache=tmp / "plans", repeats=1)
    running = Running(callback)

    def make(checkpointing: bool) -> Any:
        trainer = sft_trainer(tmp, lists, checkpointing)
        if checkpointing:
            trainer.add_callback(running)
        return trainer

    return (*both(make, callback), running.plans)


def test_trl_plan_set_every_step_peak_is_within_the_budget_at_every_length(
    trl_set_runs: tuple[Run, Run, list[Any]],
) -> None:
    with_remat, plain, _ = trl_set_runs
    assert with_remat.lengths == plain.lengths == [128, 48, 80, 104]
    assert with_remat.callback is not None and with_remat.callback.checkpoint is not None
    budget = with_remat.callback.checkpoint.plan.budget_bytes
    assert len(with_remat.peaks) == len(plain.peaks) == len(SET_MAXIMA)
    assert max(plain.peaks) > budget, "the budget does not bind: this test could not fail"
    over = [(n, p) for n, p in zip(with_remat.lengths, with_remat.peaks, strict=True)
            if p > budget]
    assert not over, f"steps (length, peak) over the {budget} B budget: {over}"


def test_trl_plan_set_losses_and_weights_equal_the_run_without_checkpointing(
    trl_set_runs: tuple[Run, Run, list[Any]],
) -> None:
    with_remat, plain, _ = trl_set_runs
    assert len(with_remat.losses) == len(SET_MAXIMA)
    assert with_remat.losses == plain.losses  # bitwise, dropout on
    for name, value in plain.params.items():
        assert torch.equal(with_remat.params[name], value), name


def test_trl_plan_set_each_step_ran_its_lengths_plan_and_more_than_one_ran(
    trl_set_runs: tuple[Run, Run, list[Any]],
) -> None:
    with_remat, _, running = trl_set_runs
    callback = with_remat.callback
    assert callback is not None and callback.checkpoint is not None
    plans = callback.checkpoint.plan
    assert str(callback.planned) == "seq=40..128:8"  # the collator's multiple as the step
    assert str(plans.dims) == "seq=40..128:8" and len(plans.plans) > 1
    assert callback.checkpoint.report.buckets  # the report says which plan runs where
    assert [plans.plans.index(p) for p in running] == [
        plans.choose((n,)) for n in with_remat.lengths]
    assert len({id(p) for p in running}) > 1, "one plan ran every step"
    # length 48 needs no checkpointing; 128 does (regions or selective options: the
    # planner picks between them by measured time, which moves with the machine's load)
    assert running[1].checkpoints_nothing and not running[0].checkpoints_nothing
    # each backward rebuilt each region of the plan its step ran: remat's plans ran
    assert callback.checkpoint.handle.rebuilds == sum(len(p.regions) for p in running)
    assert callback.turned_off is not None and not find(with_remat.model).flagged


def test_trl_plan_set_a_batch_longer_than_the_range_stops_training_with_one_sentence(
    trl_set_runs: tuple[Run, Run, list[Any]], tmp_path: Path,
) -> None:
    callback = trl_set_runs[0].callback
    assert callback is not None and callback.cache is not None
    lists = sft_lists((64, 130))  # the second step pads to 136
    trainer = sft_trainer(tmp_path, lists, True, max_length=136)
    again = tt.add_remat(trainer, "60%", shapes=SET_RANGE, cache=callback.cache)
    with pytest.raises(UsageError, match=r"a batch of seq=136 is outside the plan set's "
                       r"range seq=40\.\.128:8"):
        trainer.train()
    assert again.checkpoint is not None and again.checkpoint.report.source == "cache"
    assert trainer.state.global_step == 1  # the step of length 64 ran


def test_trl_plan_set_conservative_runs_a_longer_batch_with_one_warning(tmp_path: Path) -> None:
    lists = sft_lists((24, 40, 33), seed=2)  # lengths 24, 40, 40 over a range seq=8..32
    trainer = sft_trainer(tmp_path, lists, False)
    callback = tt.add_remat(trainer, "75%", shapes="seq=8..32", outside="conservative",
                            cache=False, repeats=1)
    running = Running(callback)
    trainer.add_callback(running)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "outside the plan set's range" in str(w.message)]
    assert said == ["remat: a batch of seq=40 is outside the plan set's range seq=8..32:8; it "
                    "runs the plan of least memory, which was not predicted for it (said once)"]
    assert callback.checkpoint is not None
    plans = callback.checkpoint.plan
    assert running.plans[1:] == [plans.plans[plans.conservative]] * 2


def test_trl_plan_set_under_bf16_autocast(tmp_path: Path) -> None:
    # SFTConfig's default: the bytes-only profiles of the range count autocast's cast
    # cache as the timed ones do (they once skipped it, and the range was refused)
    trainer = sft_trainer(tmp_path, sft_lists((32,)), True, bf16=True)
    with pytest.raises(CheckFailed, match=r"the range seq=8\.\.32:8 needs at least"):
        tt.add_remat(trainer, "60%", shapes="seq=8..32", cache=False, repeats=1)
        trainer.train()  # 60% of seq=32's peak is under seq=8's least
    trainer = sft_trainer(tmp_path, sft_lists((32,)), True, bf16=True)
    callback = tt.add_remat(trainer, "90%", shapes="seq=8..32", cache=False, repeats=1)
    trainer.train()
    assert callback.checkpoint is not None
    assert isinstance(callback.checkpoint.plan, PlanSet)
    assert trainer.state.global_step >= 1


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
    (dict(shapes="seq=40..128", pad_to=128), "pad_to .* or shapes .*, not both"),
    (dict(shapes=128), "shapes is a int"),
    (dict(shapes="seq=128..40"), "runs backwards"),
    (dict(shapes="length=40..128"), "not one remat knows"),
    (dict(outside="conservative"), "give shapes= too"),
    (dict(shapes="seq=40..128", outside="clamp"), "not one of error, conservative"),
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


def test_a_collator_padding_to_a_multiple_makes_the_seq_step() -> None:
    trl = pytest.importorskip("trl")
    collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(0, pad_to_multiple_of=8)
    wrapped = transformers.trainer_utils.RemoveColumnsCollator(collate, ["input_ids"])
    assert tt.pad_multiple(wrapped) == 8  # through the Trainer's column-removing wrapper
    args = SimpleNamespace(pad_to_multiple_of=16)  # SFTConfig has one
    assert tt.pad_multiple(collate_fn_without_multiple, args) == 16  # else the arguments'
    assert tt.pad_multiple(collate_fn_without_multiple) is None

    def planned(text: str, multiple: int | None = 8) -> str:
        return str(tt.on_multiples(parse_shapes(text), multiple))

    assert planned("seq=40..128") == "seq=40..128:8"
    assert planned("seq=33..130") == "seq=40..136:8"  # the lengths the collator makes
    assert planned("batch=1..4,seq=40..136:16", None) == "batch=1..4,seq=40..136:16"
    assert planned("seq=40..128:4") == "seq=40..128:4"  # holds every multiple of 8
    assert planned("batch=2..4") == "batch=2..4"
    with pytest.raises(UsageError, match=r"give seq=40\.\.136:8"):
        planned("seq=33..129:4")
    with pytest.raises(UsageError, match="does not hold all of those lengths"):
        planned("seq=40..136:16")


def collate_fn_without_multiple(examples: Any) -> Any:
    return examples
