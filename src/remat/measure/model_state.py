"""The caller's model put back as it was after a measuring run trained it.

Note [The user's model is the user's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Measuring a training step means running training steps: the optimizer's state is part of
what a step holds, and its first step is unlike the rest, so ``remat.profile`` takes a
few dozen optimizer steps on the example batch. On a pretrained model that is a fine-tune
on one batch behind the caller's back (a 2-layer GPT's loss on its batch fell from 6.3 to
0.6), and a NaN loss would leave every weight NaN. So the steps run on the model itself
(what is measured is the model the caller trains, its storages and its kernels) and
:func:`model_restored` puts back, bitwise, everything a step or a forward may change:

- every parameter's and buffer's values, and the module attribute each one is (a forward
  that reassigns a buffer gets the original object back);
- every parameter's gradient: the tensor it held (``None`` while measuring, so the
  measured steps start from none whatever the caller left), ``requires_grad``, and each
  module's ``training`` flag (not only the root's: a frozen BatchNorm in eval mode stays
  in eval mode);
- a given optimizer's state (its ``state_dict``, copied to host memory).

Copies live in host memory (a parameter on an accelerator is copied to the host), so the
device's peak during the run is the step's own. Host memory is what it costs: one copy
of the parameters and buffers (and, on an accelerator, of the gradients the caller left);
on the CPU the gradients are kept by reference, not copied. The time is two copies of the
parameters, a few milliseconds per 100 MB here (``benchmarks/model_restored.md``).
Fake tensors (``remat.fake_mode``) have no values: only their flags and modes are put
back. DTensor parameters (FSDP2, tensor parallelism) are copied by their local shard.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.core.errors import UsageError
from remat.measure.tracker import iter_tensors, local_shard

__all__ = ["ModelState", "check_batch", "model_restored", "refuse_meta"]


def _host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``t``'s values (its local shard's, for a DTensor) in host memory; None
    for a fake tensor, which has none."""
    local = local_shard(t)
    if isinstance(local, FakeTensor) or local.device.type == "meta":
        return None
    with torch.no_grad():
        return local.detach().to("cpu", copy=True)


def _put_back(t: torch.Tensor, value: torch.Tensor | None) -> None:
    if value is None:
        return
    with torch.no_grad():
        local_shard(t).copy_(value)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


@dataclass
class _Slot:
    """One ``module._parameters`` or ``module._buffers`` entry: the object and its values."""

    module: nn.Module
    table: str  # "_parameters" or "_buffers"
    name: str
    tensor: torch.Tensor | None
    value: torch.Tensor | None

    def restore(self) -> None:
        entries = getattr(self.module, self.table)
        now = entries.get(self.name)
        # FSDP2 swaps its own parameter objects (sharded, unsharded) as it runs: only
        # the values of those are put back, never the objects
        if now is not self.tensor and not (_is_dtensor(now) or _is_dtensor(self.tensor)):
            entries[self.name] = self.tensor
            now = self.tensor
        if now is not None and self.tensor is not None:
            _put_back(now, self.value)


class ModelState:
    """What a measuring run may change in ``model`` (and ``optimizer``), captured to be
    put back by :meth:`restore` (Note [The user's model is the user's])."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                 ) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.slots: list[_Slot] = []
        copied: dict[int, torch.Tensor | None] = {}  # one copy per tensor, however shared
        for module in model.modules():
            for table in ("_parameters", "_buffers"):
                for name, t in getattr(module, table).items():
                    if t is not None and id(t) not in copied:
                        copied[id(t)] = _host_copy(t)
                    self.slots.append(_Slot(module, table, name, t,
                                            None if t is None else copied[id(t)]))
        self.params = list(model.parameters())
        self.flags = [p.requires_grad for p in self.params]
        self.grads: list[tuple[torch.Tensor | None, torch.device | None]] = []
        for p in self.params:
            g = p.grad
            if g is None or isinstance(local_shard(g), FakeTensor) or g.device.type == "cpu":
                self.grads.append((g, None))  # kept as it is
            else:  # off the accelerator while the run measures it
                self.grads.append((g.detach().to("cpu", copy=True), g.device))
            p.grad = None
        self.optimizer = optimizer
        self.optimizer_state = (None if optimizer is None
                                else _host_state(optimizer.state_dict()))

    def restore(self) -> None:
        for slot in self.slots:
            slot.restore()
        for p, flag, (grad, device) in zip(self.params, self.flags, self.grads, strict=True):
            if p.requires_grad != flag:
                p.requires_grad_(flag)
            p.grad = grad if device is None or grad is None else grad.to(device)
        for module, training in self.modes:
            module.training = training
        if self.optimizer is not None and self.optimizer_state is not None:
            # load_state_dict copies the state onto each parameter's device and dtype
            self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))


def _host_state(state: dict[str, Any]) -> dict[str, Any]:
    def host(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, dict):
            return {k: host(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(host(v) for v in x)
        return copy.deepcopy(x)

    return host(state)


@contextmanager
def model_restored(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> Iterator[ModelState]:
    """Run the block, then put ``model`` (and ``optimizer``) back as they were, also when
    the block raises (Note [The user's model is the user's])."""
    state = ModelState(model, optimizer)
    try:
        yield state
    finally:
        state.restore()


def refuse_meta(model: nn.Module, batch: Any = None, *, fake: bool = True) -> None:
    """UsageError where the model or batch is on the meta device: it has shapes and no
    values, so a step would measure nothing (and compare nothing) but say it had.
    ``fake``: the fix may be a fake profile (not for ``verify``, which needs values)."""
    named = [*((f"parameter {n!r}", t) for n, t in model.named_parameters()),
             *((f"buffer {n!r}", t) for n, t in model.named_buffers()),
             *((f"batch tensor {k}", t) for k, t in enumerate(iter_tensors(batch)))]
    for name, t in named:
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.is_meta:
            raise UsageError(
                f"{name} is on the meta device (shapes, no values), so there is no step to "
                "run; load real weights first (e.g. model.to_empty(device='cpu') and "
                "initialise them)" + (", or size it without weights under remat.fake_mode() "
                                      "with fake=True (docs/fake.md)" if fake else ""))


def check_batch(batch: Any) -> None:
    """UsageError for an example batch that cannot be one."""
    if batch is None:
        raise UsageError("batch is None; pass the example batch your loss_fn(model, batch) "
                         "takes (a tensor, or a tuple, list or dict of tensors)")
