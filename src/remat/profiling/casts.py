"""What autocast's cast cache keeps per stage (Note [Autocast's cast cache] in
``remat.core.solve.simulator``).

Under ``torch.autocast`` the first lower-precision op to use a parameter (a leaf that
requires grad) casts it, and autocast caches the cast until the outermost autocast region
exits. One forward with grad, outside any plan, shows both figures per stage:

* ``cast_cache_bytes``: the storages of the casts of such leaves that the stage's forward
  made while autocast (with its cache) was on at the stage's call: what a forward that
  saves nothing leaves alive until the forward ends;
* ``cast_unsaved_bytes``: of those, the ones autograd did not pack for backward (a
  Linear's bias): what a keep forward leaves to the cache alone;
* the pre-chain's casts autograd did not pack (an input projection's weight when the
  batch needs no gradient): ``fixed_bytes.pre_chain_cast``.

A parameter cast at an earlier stage is taken from the cache later (no new cast), so each
cast counts at the stage that made it. Without autocast every figure is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.measure.tracker import storage_key
from remat.profiling._tensors import stage_hooks, storage_bytes
from remat.runtime.stage_calls import stage_submodule

__all__ = ["cast_cache"]


def _autocast_on(device_type: str) -> bool:
    kinds = {"cpu", device_type}
    return torch.is_autocast_cache_enabled() and any(
        torch.amp.is_autocast_available(k) and torch.is_autocast_enabled(k) for k in kinds)


class _Casts(TorchDispatchMode):
    """Records the casts of leaves that require grad while a stage with autocast on runs
    (autocast turns itself off around its own casts, so the stage's call tells)."""

    def __init__(self) -> None:
        super().__init__()
        # the stage running now (-1: the pre-chain), if autocast was on at its call
        self.stage: int | None = None
        self.made: dict[Any, tuple[int, torch.Tensor]] = {}  # storage -> (stage, cast)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (self.stage is not None and func is torch.ops.aten._to_copy.default
                and isinstance(args[0], torch.Tensor) and args[0].is_leaf
                and args[0].requires_grad and isinstance(out, torch.Tensor)
                and out.dtype != args[0].dtype):
            key = storage_key(out)  # a DTensor's local shard's; None without a storage
            if key is not None:
                self.made.setdefault(key, (self.stage, out.detach()))
        return out


def cast_cache(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    names: Sequence[str],
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Per stage: ``cast_cache_bytes`` and ``cast_unsaved_bytes``; and the pre-chain's
    unsaved casts (the model's code before the first stage, while autocast was on at the
    model's call), from one forward with grad (no backward; the graph is let go of)."""
    n = len(names)
    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    mode = _Casts()
    packed: set[Any] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)  # a DTensor's local shard's; None without a storage
        if key is not None:
            packed.add(key)
        return t

    handles = []

    def model_called(_m: nn.Module, _args: Any) -> None:
        # the pre-chain: from the model's call to the first stage's (stage index -1)
        if not seen_a_stage[0]:
            mode.stage = -1 if _autocast_on(device_type) else None

    seen_a_stage = [False]
    handles.append(model.register_forward_pre_hook(model_called))

    def enter(i: int, _args: Any, _kwargs: Any) -> None:
        seen_a_stage[0] = True
        mode.stage = i if _autocast_on(device_type) else None

    def leave(_i: int, _args: Any, _kwargs: Any, _out: Any) -> None:
        mode.stage = None

    modules = [stage_submodule(model, name) for name in names]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, \
                stage_hooks(modules, enter, leave):
            loss = loss_fn(model, batch)
        del loss
    finally:
        for h in handles:
            h.remove()
    cached = [0] * n
    unsaved = [0] * n
    pre = 0
    for key, (i, cast) in mode.made.items():
        nbytes = storage_bytes(cast)
        if i < 0:
            pre += 0 if key in packed else nbytes
            continue
        cached[i] += nbytes
        if key not in packed:
            unsaved[i] += nbytes
    mode.made.clear()
    return tuple(cached), tuple(unsaved), pre
