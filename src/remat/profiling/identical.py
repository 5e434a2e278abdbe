"""Which stages are the same computation, so their timed rounds can be pooled (:mod:`.pooling`).

Two stages are identical when they have the same class and module structure (each
submodule's class and ``extra_repr``, e.g. ``Linear(in_features=128, ...)``), the same
plain settings (each submodule's public ``bool``/``int``/``float``/``str`` attributes,
e.g. a block's ``kind``), the same parameters and buffers (names, shapes, dtypes,
``requires_grad``) and the same inputs (each tensor argument's shape, dtype and
``requires_grad``; other arguments by value or type). A layer's own position
(attributes named ``*idx``, ``*index``, ``*_id``, ``*_number``, as transformers' and
Megatron's layers carry) is left out: it names the layer, it does not change its work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from remat.profiling._tensors import stage_hooks

__all__ = ["recording_signatures", "stage_signature"]

_POSITION_SUFFIXES = ("idx", "index", "_id", "_number")
_PLAIN = (bool, int, float, str, type(None))


def _settings(module: nn.Module) -> list[str]:
    found = []
    for name, sub in module.named_modules():
        found.append(f"{name}:{type(sub).__module__}.{type(sub).__qualname__}({sub.extra_repr()})")
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or not isinstance(value, _PLAIN):
                continue
            if key.lower().endswith(_POSITION_SUFFIXES):
                continue
            found.append(f"{name}.{key}={value!r}")
    for name, p in module.named_parameters():
        found.append(f"param {name} {tuple(p.shape)} {p.dtype} {p.requires_grad}")
    for name, b in module.named_buffers():
        found.append(f"buffer {name} {tuple(b.shape)} {b.dtype}")
    return found


def _describe(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.device.type}{value.requires_grad}"
    if depth < 3 and isinstance(value, (tuple, list)):
        return "[" + ",".join(_describe(v, depth + 1) for v in value) + "]"
    if depth < 3 and isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_describe(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, _PLAIN):
        return repr(value)[:100]
    return type(value).__qualname__


def stage_signature(module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A short hash that is equal for identical stages (module docstring)."""
    text = "\n".join(
        [*_settings(module), "args " + _describe(list(args)),
         "kwargs " + _describe(dict(sorted(kwargs.items())))]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextmanager
def recording_signatures(modules: Sequence[nn.Module]) -> Iterator[list[str | None]]:
    """Within the block, each stage's signature at its first forward call (None until it
    is called); what is yielded fills in as the stages run."""
    found: list[str | None] = [None] * len(modules)

    def pre(i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if found[i] is None:
            found[i] = stage_signature(modules[i], args, kwargs)

    hook: Callable[[int, tuple[Any, ...], dict[str, Any]], None] = pre
    with stage_hooks(modules, hook):
        yield found
