"""The model a benchmark builds again for every row: a factory over the batch size."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from remat.core.errors import UsageError, UserCodeError

from .runners import Factory

__all__ = [
    "batch_size_of", "compiling", "describe", "failure", "make_factory", "torch_threads", "whole",
]


def whole(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name}={value!r} is invalid; give a whole number >= {low}")
    return value


def make_factory(
    model: str | Callable[..., Any], options: Mapping[str, Any] | None = None
) -> tuple[Factory, bool]:
    """``factory(batch_size)`` for a model spec or factory, and whether it takes batch_size."""
    from remat.models import _resolve, load_model
    from remat.runtime.install import cache_off_for_training

    base = dict(options or {})
    if isinstance(model, str):
        target = _resolve(model)  # the spec's factory, to read its options
    elif callable(model):
        target = model
    else:
        raise UsageError(
            f"model is a {type(model).__name__}; give a spec such as 'gpt' or a factory"
        )
    try:
        takes = "batch_size" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes = False

    def factory(batch_size: int | None) -> Any:
        opts = base if batch_size is None else {**base, "batch_size": batch_size}
        result = load_model(model, **opts) if isinstance(model, str) else model(**opts)
        if not (isinstance(result, tuple) and len(result) == 3):
            raise UserCodeError(
                "the model factory must return (model, example_batch, loss_fn)"
            )
        cache_off_for_training(result[0])  # every model built here is trained
        return result

    return factory, takes


def compiling(factory: Factory, stages: Sequence[str] | None) -> Factory:
    """``factory`` whose models have their stages compiled (:func:`remat.compile_stages`)."""
    from remat.runtime.compiled_stages import compile_stages
    from remat.runtime.stages import discover_stages

    def build(batch_size: int | None) -> Any:
        model, batch, loss_fn = factory(batch_size)
        compile_stages(model, stages or discover_stages(model, batch, loss_fn))
        return model, batch, loss_fn

    return build


def describe(model: str | Callable[..., Any], options: Mapping[str, Any]) -> str:
    name = model if isinstance(model, str) else getattr(model, "__name__", "factory")
    return " ".join([name, *(f"{k}={v}" for k, v in options.items())])


def batch_size_of(options: Mapping[str, Any], batch: Any) -> int | None:
    """The batch size: the ``batch_size`` option, else the first tensor's first dimension."""
    from remat.measure.tracker import iter_tensors

    if isinstance(options.get("batch_size"), int):
        return int(options["batch_size"])
    first = next(iter_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() else None


def failure(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside (None: left alone), restored after."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(whole(threads, "threads", 1))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
