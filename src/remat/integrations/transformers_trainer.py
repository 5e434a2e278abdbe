"""remat in Hugging Face's ``Trainer`` (and TRL's trainers, which subclass it).

``RematCallback(budget)`` is a ``transformers.TrainerCallback``: when training begins it
takes an example batch (the first ``per_device_train_batch_size`` examples of the train
set, collated by the trainer's own collator, or the batch given), turns the model's own
gradient checkpointing off where it is on, and calls :func:`remat.auto_checkpoint` on the
model the trainer trains (a PEFT model too). ``add_remat(trainer, budget)`` is the one
line that adds it. With ``shapes=`` (a range of batch shapes, for dynamic padding) it
applies a plan set made from that example batch: each step runs the plan for its batch's
shape. docs/integrations/transformers.md says what was measured.

Importing this module imports transformers; ``import remat`` never does.
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from remat.core.errors import UsageError
from remat.core.plan_set import OUTSIDE
from remat.core.profile_format import OPTIMIZERS
from remat.core.shapes import Dim, ShapeRange, parse_shapes
from remat.core.solve.budget import Budget
from remat.in_script.script_entry import AutoCheckpoint, auto_checkpoint, model_loss
from remat.runtime.existing import find
from remat.runtime.install import applied, cache_off_for_training

__all__ = ["RematCallback", "add_remat", "model_loss", "remat_optimizer"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], Any]

#: TrainingArguments.optim -> what remat measures the optimizer state and step as
_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "sgd": "sgd",
}


def remat_optimizer(optim: Any) -> str | None:
    """remat's name for a ``TrainingArguments.optim`` value, or None where remat has no
    measurement of that optimizer (it then plans as AdamW, and says so)."""
    name = str(getattr(optim, "value", optim))
    return _OPTIMIZERS.get(name)


def _pad(batch: Any, pad_to: int, pad_id: int) -> dict[str, Any]:
    """The batch's (batch, sequence) tensors padded on the right to ``pad_to`` positions:
    ``input_ids`` with ``pad_id``, ``labels`` with -100 (no loss), the rest with 0 (an
    attention mask's padding)."""
    if not isinstance(batch, Mapping):
        raise UsageError(f"pad_to needs an example batch that maps names to tensors, not a "
                         f"{type(batch).__name__}; pass batch= padded yourself instead")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise UsageError("pad_to needs an 'input_ids' tensor of shape (batch, sequence) in "
                         "the example batch; pass batch= padded yourself instead")
    length = ids.shape[1]
    if length > pad_to:
        raise UsageError(f"pad_to={pad_to} is shorter than the example batch's {length} "
                         "positions; give the longest sequence length the run will see")
    out = dict(batch)
    for key, value in batch.items():
        if (isinstance(value, torch.Tensor) and value.dim() == 2
                and value.shape == ids.shape):
            fill = pad_id if key == "input_ids" else -100 if key == "labels" else 0
            extra = value.new_full((value.shape[0], pad_to - length), fill)
            out[key] = torch.cat([value, extra], dim=1)
    return out


def _example_batch(dataloader: Any, size: int) -> Any:
    """The first ``size`` examples of the dataloader's dataset, through its collator.

    Not the dataloader's own first batch: iterating it would draw from the random number
    generators (shuffling) and move accelerate's dataloader state, so the run would see
    other data than it does without remat.
    """
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if dataset is None or collate is None:
        raise UsageError("the trainer's train dataloader has no dataset and collator to take "
                         "an example batch from; pass RematCallback(..., batch=...)")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        examples = list(itertools.islice(iter(dataset), size))
    else:
        examples = [dataset[i] for i in range(min(size, len(dataset)))]
    if not examples:
        raise UsageError("the train dataset is empty; there is no batch to plan on")
    return collate(examples)


def pad_multiple(collate: Any, args: Any = None) -> int | None:
    """The multiple the collator pads each batch's sequence length to (its
    ``pad_to_multiple_of``, through the Trainer's column-removing wrapper), else
    ``TrainingArguments.pad_to_multiple_of`` (TRL's SFTConfig has one), else None."""
    for _ in range(4):  # RemoveColumnsCollator.data_collator, and the like
        found = getattr(collate, "pad_to_multiple_of", None)
        if found is not None:
            break
        collate = getattr(collate, "data_collator", None)
        if collate is None:
            break
    if found is None:
        found = getattr(args, "pad_to_multiple_of", None)
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 1 \
        else None


def on_multiples(dims: ShapeRange, multiple: int | None) -> ShapeRange:
    """``dims`` with its ``seq`` dimension on the lengths a collator padding to
    ``multiple`` makes: a ``seq`` given without a step gets step ``multiple``, its ends
    rounded up to multiples of it (a batch of the least and the largest length is padded
    so); a ``seq`` whose lattice misses some of those lengths is refused."""
    if multiple is None or "seq" not in dims.names:
        return dims
    out = []
    for d in dims.dims:
        if d.name == "seq" and d.step == 1 and d.lo < d.hi:
            d = Dim("seq", -(-d.lo // multiple) * multiple, -(-d.hi // multiple) * multiple,
                    multiple)
        elif d.name == "seq" and (d.lo % multiple or multiple % d.step):
            lo, hi = -(-d.lo // multiple) * multiple, -(-d.hi // multiple) * multiple
            raise UsageError(
                f"the collator pads every batch to a multiple of {multiple} positions, and "
                f"the range's {d} does not hold all of those lengths; give "
                f"seq={lo}..{hi}:{multiple}, or seq={d.lo}..{d.hi} and remat uses that step")
        out.append(d)
    return ShapeRange(tuple(out))


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _hf_checkpointing_off(model: nn.Module, args: Any) -> str | None:
    """Turn transformers' own gradient checkpointing off on ``model`` and in ``args``;
    return the sentence that says so, or None when it was off."""
    in_args = [name for name in ("activation_checkpointing", "gradient_checkpointing")
               if getattr(args, name, False) is True]
    flagged = find(model).flagged
    if not in_args and not flagged:
        return None
    if flagged:
        with warnings.catch_warnings():  # transformers 5 deprecates the gradient_ names
            warnings.simplefilter("ignore", FutureWarning)
            for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
                disable = getattr(model, name, None)
                if callable(disable):
                    disable()
                    break
        for path in find(model).flagged:  # a model without the method: the flags themselves
            setattr(model.get_submodule(path), "gradient_checkpointing", False)  # noqa: B010
    for name in in_args:  # else a later trainer.train() turns it on again
        setattr(args, name, False)
    where = " and ".join(
        ([f"TrainingArguments.{' and '.join(in_args)}=True"] if in_args else [])
        + ([f"the model's flag on {len(flagged)} modules"] if flagged else []))
    return (f"remat: gradient checkpointing was on ({where}); remat turned transformers' "
            "checkpointing off (and the argument to False, so the Trainer does not turn it "
            "on again) and checkpoints by its own plan under the budget instead")


class RematCallback(TrainerCallback):
    """Apply a remat plan under ``budget`` to the model when ``Trainer.train()`` begins.

    ``budget``: the peak of a whole training step, in bytes, a size (``"12GiB"``) or a
    fraction of the measured peak without checkpointing (``"60%"``). ``batch``: the
    example batch to plan on (default: the first ``per_device_train_batch_size`` examples
    of the train set through the trainer's collator). ``pad_to``: pad the example batch's
    sequences to this length; under dynamic padding give the longest length the run will
    see (a plan for the longest is within the budget for shorter batches too).
    ``shapes``: instead of ``pad_to``, the range of shapes the run's batches have
    (``"seq=32..512"`` or ``{"seq": (32, 512)}``, as :func:`remat.auto_checkpoint`): the
    callback applies a plan set made from the example batch, and each step runs the plan
    for its batch's shape. Where the collator pads to a multiple (``pad_to_multiple_of``),
    a ``seq`` given without a step gets that step, its ends rounded up to multiples of
    it; the range planned is then ``planned``. ``outside``: what a batch outside the
    range does, ``"error"`` (a UsageError) or ``"conservative"`` (the plan of least
    memory, with one warning).
    ``loss_fn(model, batch)``: default ``model(**batch).loss``. ``optimizer``: remat's
    name for the trainer's optimizer (default from ``TrainingArguments.optim``).
    ``stages``, ``cache``, ``repeats``: as :func:`remat.auto_checkpoint`.

    After ``on_train_begin``, ``checkpoint`` is the :class:`remat.AutoCheckpoint` (its
    ``report`` says what was done; ``checkpoint.remove()`` takes the plan off) and
    ``turned_off`` the sentence saying transformers' own checkpointing was turned off,
    or None. With ``shapes``, ``checkpoint.plan`` is a plan set
    (:class:`remat.core.plan_set.PlanSet`) and ``checkpoint.handle.running`` the plan the
    last step ran.
    """

    def __init__(
        self,
        budget: Budget | str | int | float,
        *,
        batch: Any = None,
        pad_to: int | None = None,
        shapes: str | Mapping[str, Any] | None = None,
        outside: str | None = None,
        loss_fn: LossFn | None = None,
        optimizer: str | None = None,
        stages: list[str] | tuple[str, ...] | None = None,
        cache: str | os.PathLike[str] | bool | None = None,
        repeats: int = 2,
    ) -> None:
        if isinstance(budget, bool) or not isinstance(budget, (Budget, str, int, float)):
            raise UsageError(f"budget={budget!r} is not a budget; give bytes, a size such as "
                             "'12GiB', or a fraction such as '60%'")
        read = Budget.parse(budget)  # before training begins, and only here
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer={optimizer!r} is unknown; use one of "
                             f"{', '.join(OPTIMIZERS)}")
        if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int)
                                   or pad_to < 1):
            raise UsageError(f"pad_to={pad_to!r} is not a sequence length; give a whole "
                             "number of positions, the longest the run will see")
        if shapes is not None:
            if pad_to is not None:
                raise UsageError("give pad_to (one plan for the longest batch) or shapes (a "
                                 "plan per shape of a range), not both")
            if not isinstance(shapes, (str, Mapping)):
                raise UsageError(f"shapes is a {type(shapes).__name__}; give a range such as "
                                 "'seq=32..512' or {'seq': (32, 512)}")
            parse_shapes(shapes)  # a bad range is refused here, in its own words
        if outside is not None:
            if shapes is None:
                raise UsageError(f"outside={outside!r} says what a batch outside shapes= "
                                 "does; give shapes= too, or leave outside out")
            if outside not in OUTSIDE:
                raise UsageError(f"outside={outside!r} is not one of {', '.join(OUTSIDE)}")
        if loss_fn is not None and not callable(loss_fn):
            raise UsageError(f"loss_fn is a {type(loss_fn).__name__}; pass a function "
                             "loss_fn(model, batch) that returns the scalar loss")
        self.budget = read
        self.batch = batch
        self.pad_to = pad_to
        self.shapes = shapes
        self.outside = outside
        self.planned: ShapeRange | None = None
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.stages = stages
        self.cache = cache
        self.repeats = repeats
        self.checkpoint: AutoCheckpoint | None = None
        self.turned_off: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise UsageError("the trainer passed no model to RematCallback.on_train_begin; "
                             "call remat.auto_checkpoint(model, ...) before training instead")
        self.turned_off = _hf_checkpointing_off(model, args)
        if self.turned_off:
            warnings.warn(self.turned_off, stacklevel=2)
        if self.checkpoint is not None and self.checkpoint.active and applied(model):
            return  # a later trainer.train(): the plan is on already
        cache_off_for_training(model)  # a rebuild must not append to a key/value cache
        optimizer = self.optimizer or remat_optimizer(getattr(args, "optim", "adamw_torch"))
        if optimizer is None:
            optimizer = "adamw"
            warnings.warn(f"remat: TrainingArguments.optim={args.optim!s} is not one remat "
                          "measures; the plan prices the optimizer state as AdamW's "
                          "(pass RematCallback(..., optimizer=) to say otherwise)", stacklevel=2)
        if getattr(args, "gradient_accumulation_steps", 1) > 1:
            warnings.warn("remat: with gradient_accumulation_steps > 1 the later micro-steps "
                          "hold every gradient through their forward, which the plan does not "
                          "price; leave headroom in the budget", stacklevel=2)
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            batch = self.batch
            if batch is None:
                if train_dataloader is None:
                    raise UsageError("the trainer has no train dataloader to take an example "
                                     "batch from; pass RematCallback(..., batch=...)")
                batch = _example_batch(train_dataloader, args.per_device_train_batch_size)
            batch = _to(batch, device)
            if self.pad_to is not None:
                config = getattr(model, "config", None)
                pad_id = getattr(config, "pad_token_id", None)
                batch = _pad(batch, self.pad_to, pad_id if isinstance(pad_id, int) else 0)
            ranged: dict[str, Any] = {}
            if self.shapes is not None:
                collate = getattr(train_dataloader, "collate_fn", None)
                self.planned = on_multiples(parse_shapes(self.shapes), pad_multiple(collate, args))
                if str(self.planned) != str(parse_shapes(self.shapes)):
                    logger.info("remat: the collator pads to a multiple of %s; planning %s",
                                self.planned.dims[self.planned.names.index("seq")].step,
                                self.planned)
                ranged = {"shapes": str(self.planned), "outside": self.outside or "error"}
            was_training = model.training
            model.train()
            try:
                self.checkpoint = auto_checkpoint(
                    model, self.budget, batch=batch, loss_fn=self.loss_fn or model_loss,
                    optimizer=optimizer, stages=self.stages, cache=self.cache,
                    repeats=self.repeats, **ranged)
            finally:
                model.train(was_training)
        logger.info("%s", self.checkpoint.report)


def add_remat(trainer: Any, budget: Budget | str | int | float, **kwargs: Any) -> RematCallback:
    """``trainer.add_callback(RematCallback(budget, **kwargs))``, returning the callback:
    the one line that makes ``trainer.train()`` checkpoint under ``budget``."""
    if not callable(getattr(trainer, "add_callback", None)):
        raise UsageError(f"add_remat got a {type(trainer).__name__}, not a transformers "
                         "Trainer; pass the Trainer (or TRL trainer) you call train() on")
    callback = RematCallback(budget, **kwargs)
    trainer.add_callback(callback)
    return callback
