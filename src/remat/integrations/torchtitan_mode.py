"""remat as a torchtitan activation-checkpointing mode: ``RematAC``.

torchtitan (0.3.0) applies activation checkpointing in each model's ``parallelize_fn``
(``ac_config.build(dump_folder=...).apply(model)``) to the model still on the meta
device, before ``torch.compile``, FSDP and ``init_weights``; its modes
(``torchtitan.distributed.activation_checkpoint``: ``FullAC``, ``SelectiveAC``,
``MemoryBudgetAC``) wrap every block of ``model.layers``. ``RematAC`` is one more mode
of the same shape: its ``apply(model)`` plans the blocks of ``model.layers`` under a
budget and applies the plan with :func:`remat.apply`, whose hooks outlive
``to_empty``/``init_weights`` and which ``fully_shard`` after it is fine with
(``docs/distributed.md``). Select it in a Python config (a ``config_registry``
function)::

    from remat.integrations.torchtitan_mode import RematAC
    config.activation_checkpoint = RematAC.Config(
        budget="60%", local_batch_size=config.training.local_batch_size,
        seq_len=config.training.seq_len)

The model is on the meta device when ``apply`` runs, so the plan comes from a **fake
profile** (``docs/fake.md``): a twin of the model built from fake tensors, run on a
fake batch of ``local_batch_size`` x ``seq_len`` tokens with a cross-entropy loss on
its logits; no memory of the model's size is allocated. Or give ``plan_file``, a plan
saved as JSON (``remat plan --out``, ``Plan.to_dict``), to skip profiling. The budget
is one process's whole training step (parameters, gradients and AdamW state unsharded,
in the dtype the model is built in): under FSDP a rank holds less, so the plan is
conservative there. torchtitan's tyro command line only knows its own modes (its
``ActivationCheckpointingConfig`` is a closed union), so this mode is chosen in Python.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.planner import plan as make_plan
from remat.profiling.fake import fake_mode
from remat.profiling.profiler import profile
from remat.runtime.install import Handle, apply

__all__ = ["RematAC", "fake_twin", "token_loss"]


def fake_twin(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` (on any device, meta included) whose parameters and buffers
    are fake CPU tensors of ``mode`` (``remat.fake_mode()``), of the same shapes, dtypes
    and sharing (tied weights stay tied)."""
    twin = copy.deepcopy(model)  # outside the mode: it refuses real and meta inputs
    made: dict[int, torch.Tensor] = {}
    with mode:
        for module in twin.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        new = torch.empty(t.shape, dtype=t.dtype)
                        made[id(t)] = (nn.Parameter(new, requires_grad=t.requires_grad)
                                       if isinstance(t, nn.Parameter) else new)
                    table[name] = made[id(t)]
    return twin


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """torchtitan's language-model step: logits of the tokens, cross entropy (in float32)
    against the labels."""
    tokens, labels = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class RematAC(ActivationCheckpointing):
    """remat's plan for ``model.layers`` under a budget (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        budget: str = "60%"
        """The peak of one process's whole training step: bytes, a size ("40GiB") or a
        fraction of the step's peak without checkpointing ("60%")."""

        local_batch_size: int = 8
        """Sequences per step on one process (``training.local_batch_size``)."""

        seq_len: int = 2048
        """Tokens per sequence (``training.seq_len``)."""

        optimizer: str = "adamw"
        """The optimizer whose state the budget counts: adamw, adamw-fused or sgd."""

        plan_file: str = ""
        """A plan saved as JSON; when given, it is applied and nothing is profiled."""

    handle: Handle | None = None
    plan: Plan | None = None

    def _plan(self, model: nn.Module, stages: list[str]) -> Plan:
        config = self.config
        assert isinstance(config, RematAC.Config)
        if config.plan_file:
            try:
                data = json.loads(Path(config.plan_file).read_text())
            except (OSError, ValueError) as err:
                raise UsageError(f"plan_file {config.plan_file!r} could not be read as "
                                 f"JSON ({err}); give a plan saved by remat") from None
            return Plan.from_dict(data.get("plan", data))
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not isinstance(vocab, int):
            raise UsageError("the model has no config.vocab_size to make the fake batch's "
                             "tokens from; give RematAC.Config(plan_file=...) instead")
        shape = (config.local_batch_size, config.seq_len)
        mode = fake_mode()
        twin = fake_twin(model, mode)
        with mode:
            batch = (torch.zeros(shape, dtype=torch.long),
                     torch.zeros(shape, dtype=torch.long))
        prof = profile(twin, batch, token_loss, stages, config.optimizer, fake=True)
        return make_plan(prof, config.budget)

    def apply(self, model: nn.Module) -> None:
        """Plan ``model.layers`` and apply the plan (the model may be on meta)."""
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.Module) or not len(list(layers.children())):
            raise UsageError(f"{type(model).__name__} has no 'layers' of blocks, which "
                             "torchtitan's checkpointing modes and RematAC plan over")
        stages = [f"layers.{name}" for name, _ in layers.named_children()]
        self.plan = self._plan(model, stages)
        self.handle = apply(model, self.plan)
