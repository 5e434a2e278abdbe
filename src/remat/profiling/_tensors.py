"""Small helpers: the main tensor of a stage's input or output, storage bytes, stage hooks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from remat.measure.tracker import local_shard, storage_key
from remat.runtime.engine import main_input, main_output
from remat.runtime.stage_calls import PostHook, PreHook, hook_stages

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


@contextmanager
def stage_hooks(
    modules: Sequence[nn.Module], pre: PreHook | None = None, post: PostHook | None = None
) -> Iterator[None]:
    """Call ``pre(i, args, kwargs)`` before and ``post(i, args, kwargs, out)`` after stage i.

    The post hook also runs when the stage raises (a rebuild ended early by torch). A module
    that is several stages (its calls, ``path#k``) gets one pair of hooks, which tells each
    call's stage apart (:func:`remat.runtime.stage_calls.hook_stages`).
    """
    handles = hook_stages(modules, pre, post)
    try:
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
