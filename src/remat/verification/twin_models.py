"""The two twins of a verification: the models, their batches, their seeds, the loss.

Two twins start from the same parameters and buffers and see the same batch, the same
seeds for torch, Python and NumPy before every step, the same dtype and the same loss.
The model the user passed is never touched: it is deep-copied twice, or a factory builds
both twins.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.runtime.install import applied

__all__ = [
    "LossFn",
    "PlanLike",
    "build_twins",
    "cuda_devices",
    "default_loss",
    "fresh_batch",
    "resolve_plan",
    "seeded",
]

LossFn = Callable[[nn.Module, Any], Any]
PlanLike = Plan | Callable[[nn.Module], Plan]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch)``; a scalar output is the loss, else the mean square of the first tensor.

    A mean square rather than a sum: a sum's gradient can vanish (after a softmax or a
    normalization), and then nothing would be compared.
    """
    out = model(batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise UsageError(
            f"the model returned {type(out).__name__}; pass loss_fn(model, batch) that runs "
            "the forward and returns the scalar loss"
        )
    return out if out.numel() == 1 else out.float().square().mean()


def _map_tensors(obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], label: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(label, obj)
    if isinstance(obj, tuple):
        items = [_map_tensors(x, fn, f"{label}[{k}]") for k, x in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map_tensors(x, fn, f"{label}[{k}]") for k, x in enumerate(obj)]
    if isinstance(obj, Mapping):
        return {key: _map_tensors(x, fn, f"{label}[{key!r}]") for key, x in obj.items()}
    return obj


def fresh_batch(batch: Any, *, grad: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """A copy of ``batch`` per twin; floating-point tensors require grad when ``grad``."""
    leaves: dict[str, torch.Tensor] = {}

    def copy_leaf(label: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
            leaves[label] = t
        return t

    return _map_tensors(batch, copy_leaf, "batch"), leaves


def build_twins(
    model_or_factory: Any, batch: Any, loss_fn: LossFn | None, seed: int
) -> tuple[nn.Module, nn.Module, Any, LossFn]:
    """The plain twin, the twin for the plan, the batch and the loss; the input is untouched."""
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
        if applied(model):
            raise UsageError(
                "a remat plan is applied to this model; remove it with remat.remove(model) "
                "and pass the plain model with the plan to verify"
            )
        try:
            plain, twin = copy.deepcopy(model), copy.deepcopy(model)
        except Exception as err:
            raise UsageError(
                f"cannot deep-copy the model ({type(err).__name__}: {err}); pass a zero-argument "
                "factory that builds it instead"
            ) from err
    elif callable(model_or_factory):
        built = []
        for _ in range(2):
            with seeded(seed, cuda_devices()):
                built.append(model_or_factory())
        results = []
        for result in built:
            if isinstance(result, tuple) and len(result) == 3:
                model, batch_from, loss_from = result
                batch = batch if batch is not None else batch_from
                loss_fn = loss_fn if loss_fn is not None else loss_from
                result = model
            if not isinstance(result, nn.Module):
                raise UsageError(
                    f"the factory returned {type(result).__name__}; it must return an "
                    "nn.Module or a (model, batch, loss_fn) triple"
                )
            results.append(result)
        plain, twin = results
        if plain is twin:
            raise UsageError("the factory returned the same model twice; build a new one per call")
        twin.load_state_dict(plain.state_dict())  # a factory that draws unseeded weights
    else:
        raise UsageError(
            f"model_or_factory is a {type(model_or_factory).__name__}; pass an nn.Module or a "
            "zero-argument factory"
        )
    if batch is None:
        raise UsageError("no batch given; pass the example batch the loss function takes")
    plain.train()
    twin.train()  # checkpointing only acts in training mode; verifying eval proves nothing
    return plain, twin, batch, loss_fn or default_loss


def resolve_plan(plan: PlanLike, model: nn.Module) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if callable(plan):
        built = plan(model)
        if isinstance(built, Plan):
            return built
    raise UsageError(
        f"plan is a {type(plan).__name__}; pass a remat Plan or a builder such as "
        "remat.plans.per_stage"
    )


def cuda_devices() -> list[int]:
    """Every CUDA device once CUDA is in use: ``torch.manual_seed`` reseeds them all."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


@contextlib.contextmanager
def seeded(seed: int, devices: list[int]) -> Iterator[None]:
    """Seed torch, Python and NumPy inside the block; the caller's states come back after."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
