"""Small helpers: the main tensor of a stage's input or output, storage bytes, stage hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from remat.measure.tracker import local_shard, storage_key
from remat.runtime.engine import main_input, main_output

__all__ = [
    "buffers_restored",
    "main_input",
    "main_output",
    "same_storage",
    "stage_hooks",
    "storage_bytes",
]

_CUDA_BLOCK_BYTES = 512  # the tracker counts whole caching-allocator blocks on CUDA


def storage_bytes(t: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``t`` as the live-storage tracker counts them."""
    if t is None:
        return 0
    try:
        storage = local_shard(t).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0
    nbytes = int(storage.nbytes())
    if storage.device.type == "cuda" and nbytes > 0:
        nbytes = -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES
    return nbytes


def same_storage(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return False
    key = storage_key(a)
    return key is not None and key == storage_key(b)


PreHook = Callable[[int, tuple[Any, ...], dict[str, Any]], None]
PostHook = Callable[[int, tuple[Any, ...], dict[str, Any], Any], None]


@contextmanager
def stage_hooks(
    modules: Sequence[nn.Module], pre: PreHook | None = None, post: PostHook | None = None
) -> Iterator[None]:
    """Call ``pre(i, args, kwargs)`` before and ``post(i, args, kwargs, out)`` after stage i.

    The post hook also runs when the stage raises (a rebuild ended early by torch).
    """
    handles = []
    try:
        for i, module in enumerate(modules):
            if pre is not None:

                def pre_hook(
                    _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i
                ) -> None:
                    pre(i, args, kwargs)

                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            if post is not None:

                def post_hook(
                    _m: nn.Module,
                    args: tuple[Any, ...],
                    kwargs: dict[str, Any],
                    out: Any,
                    i: int = i,
                ) -> None:
                    post(i, args, kwargs, out)

                handles.append(
                    module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
                )
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def buffers_restored(model: nn.Module) -> Iterator[None]:
    """Put the model's buffers (BatchNorm running statistics) back after a measuring pass."""
    with torch.no_grad():
        saved = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
