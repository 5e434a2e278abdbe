"""Finding the chain of stages in a model: the repeated-block container on the forward path."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.errors import UsageError

__all__ = ["discover_stages", "resolve_stages", "unknown_path_message"]


def _candidates(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Containers whose children are two or more modules of one class, with child paths."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        prefix = f"{path}." if path else ""
        found.append((path, [prefix + name for name, _ in children]))
    return found


def _call_order(model: nn.Module, paths: Sequence[str], run: Callable[[], Any]) -> list[str]:
    """The order in which ``run()`` calls the modules at ``paths`` (first call of each)."""
    order: list[str] = []
    handles = []
    for path in paths:

        def record(_module: nn.Module, _args: Any, path: str = path) -> None:
            if path not in order:
                order.append(path)

        handles.append(model.get_submodule(path).register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return order


def discover_stages(
    model: nn.Module,
    batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> list[str]:
    """Module paths of the model's stages, in call order.

    The stages are the children of the largest ``nn.ModuleList`` or ``nn.Sequential``
    whose children all share one class (ties go to the container with more parameters).
    Given an example ``batch`` (and the ``loss_fn(model, batch)`` that runs the forward),
    only containers whose children the forward actually calls count, and the order is
    the call order; without one it is the container's order.
    """
    candidates = _candidates(model)
    if batch is not None:

        def run() -> Any:
            return loss_fn(model, batch) if loss_fn is not None else model(batch)

        every_child = [p for _, children in candidates for p in children]
        was_training = model.training
        try:
            order = _call_order(model, every_child, run)
        finally:
            model.train(was_training)
        position = {p: i for i, p in enumerate(order)}
        candidates = [
            (path, sorted((c for c in children if c in position), key=position.__getitem__))
            for path, children in candidates
        ]
        candidates = [(path, children) for path, children in candidates if len(children) >= 2]
    if not candidates:
        raise UsageError(
            f"found no repeated-block container in {type(model).__name__} (an nn.ModuleList "
            "or nn.Sequential of two or more modules of one class on the forward path); "
            "name the stages with stages=[module paths]"
        )

    def size(item: tuple[str, list[str]]) -> tuple[int, int]:
        path, children = item
        params = sum(p.numel() for p in model.get_submodule(path).parameters())
        return len(children), params

    return max(candidates, key=size)[1]


def resolve_stages(model: nn.Module, stages: Sequence[str] | None = None) -> list[str]:
    """``stages`` checked against the model, or the discovered stages when ``None``."""
    if stages is None:
        return discover_stages(model)
    stages = list(stages)
    if not stages:
        raise UsageError("stages=[] names no module; give module paths or leave stages unset")
    known = dict(model.named_modules())
    for path in stages:
        if not isinstance(path, str) or path not in known or path == "":
            raise UsageError(unknown_path_message(model, path))
    if len(set(stages)) != len(stages):
        dup = next(p for p in stages if stages.count(p) > 1)
        raise UsageError(f"stage {dup!r} is named twice; each stage must be a distinct module")
    return stages


def unknown_path_message(model: nn.Module, path: object) -> str:
    """One sentence naming a module path the model lacks, with the closest real ones."""
    known = [name for name, _ in model.named_modules() if name]
    close = difflib.get_close_matches(str(path), known, n=3)
    hint = (
        "did you mean " + " or ".join(repr(c) for c in close) + "?"
        if close
        else "list the paths with model.named_modules()"
    )
    return f"the model has no submodule {path!r}; {hint}"
