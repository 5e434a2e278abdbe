"""Fake-tensor profiles: a model sized without its memory (docs/fake.md).

``remat.fake_mode()`` is a ``FakeTensorMode``: a model and batch built inside it have fake
tensors (shapes, dtypes and devices, no data), so a model of any size costs the memory
of its Python objects. ``remat.profile(model, batch, loss_fn, fake=True)`` runs the usual
profile inside the same mode with the tracker counting fake storages (Note [Fake
storages] in :mod:`remat.measure.tracker`): every byte figure is the real step's, through
the same code path as a real profile; no kernel runs, so its times are only the fake
run's dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode

from remat.core.errors import UsageError
from remat.measure.tracker import iter_tensors

__all__ = ["fake_mode", "fake_mode_of"]


def fake_mode() -> FakeTensorMode:
    """A mode to build a model and its batch in with fake tensors::

        with remat.fake_mode() as mode:
            model, batch, loss_fn = make_model()
        profile = remat.profile(model, batch, loss_fn, fake=True)
    """
    return FakeTensorMode(allow_non_fake_inputs=False)


def fake_mode_of(model: nn.Module, batch: Any) -> FakeTensorMode:
    """The one fake mode ``model``'s parameters and buffers and ``batch`` belong to;
    UsageError naming the first tensor that is real or of another mode."""
    found: FakeTensorMode | None = None
    named = [*((f"parameter {n}", t) for n, t in model.named_parameters()),
             *((f"buffer {n}", t) for n, t in model.named_buffers()),
             *((f"batch tensor {k}", t) for k, t in enumerate(iter_tensors(batch)))]
    for name, t in named:
        mode = maybe_get_fake_mode(t) if isinstance(t, torch.Tensor) else None
        if mode is None:
            raise UsageError(
                f"fake=True needs the model and batch built under remat.fake_mode(), but "
                f"{name} is a real tensor; build them inside `with remat.fake_mode():`")
        if found is not None and mode is not found:
            raise UsageError(f"{name} belongs to another fake mode than the first tensor; "
                             "build the model and batch under one remat.fake_mode()")
        found = mode
    if found is None:
        raise UsageError("fake=True needs a model with parameters built under "
                         "remat.fake_mode()")
    return found
