"""A checkpoint frame whose one rebuild serves every backward pass over its forward.

Note [One rebuild for a backward in passes]
torch's non-reentrant checkpoint keys a region's rebuilt tensors by the backward pass
(the graph task) that unpacks them and drops each at its first unpack. A backward run
as several passes over one forward therefore rebuilds the region in each pass:
torch.distributed.pipelining's zero-bubble schedules run an input-gradient pass with
the graph kept (``stage_backward_input``) and then one weight-gradient ``autograd.grad``
per parameter group (``stage_backward_weight``), and the weight passes unpack, for the
weights' gradients, tensors the input pass unpacked already; torch's ``GraphExecGroup``
(one rebuild per group of passes) refuses exactly that (Note [Backward in passes] in
engine.py; pytorch/pytorch#136766).

This frame keeps each rebuilt tensor on the placeholder that autograd keeps in place of
the saved tensor. The region is rebuilt once, at the first unpack of any pass, and a
rebuilt tensor then lives exactly as long as autograd keeps its placeholder: a single
backward releases it when its node has run (as torch's frame does, one node later at
most), an input pass that keeps the graph keeps it until the weight pass that releases
the node. So under a zero-bubble schedule a region's saved tensors are absent from the
forward to the input pass and present from there to the weight passes, as they would be
without the region.

It is torch's frame in everything else, on public API: the RNG state of the CPU and of
the input's device is stashed at the forward and restored for the rebuild, autocast is
re-entered as the forward had it, a rebuild stops at the last placeholder still alive
(torch's early stop), a rebuilt tensor of another shape, dtype or device than the one
saved is an error, and so is an input changed in place after the forward. What it does
not do is nest: regions inside regions need torch's frame, which saves a child's input
through its parent's hooks, so remat refuses nested regions, and selective options inside
regions (a selective stage is a checkpoint of its own), where this frame is asked for
(``remat.apply(..., split_backward=True)``). A selective stage outside regions runs in
this frame with its selective-checkpoint contexts (``context_fn``), rebuilt once too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from remat.core.errors import RematError

__all__ = ["RebuildOnceFrame"]


class _Placeholder:
    """What autograd keeps in place of a tensor saved inside the region."""

    __slots__ = ("__weakref__", "index", "value")

    def __init__(self, index: int) -> None:
        self.index = index
        self.value: torch.Tensor | None = None


class _StopRebuild(Exception):
    """Raised from the rebuild's pack hook once the last live placeholder is filled."""


def _autocast_state(device_type: str) -> dict[str, tuple[bool, torch.dtype]]:
    kinds = {"cpu", device_type}
    return {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in kinds if torch.amp.is_autocast_available(kind)}


class _Region:
    """The state a rebuild needs; the placeholders' hooks hold it, the frame lets go of
    it at ``close`` (so the engine's entry, which holds the frame, holds no cycle)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any],
                 recompute_context: Any, preserve_rng_state: bool) -> None:
        self.fn = fn
        self.args = tuple(args)
        self.versions = tuple(a._version if isinstance(a, torch.Tensor) else None
                              for a in self.args)
        self.placeholders: list[weakref.ref[_Placeholder]] = []
        self.metadata: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.rebuilt = False
        self.recompute_context = recompute_context
        tensor = next((a for a in self.args if isinstance(a, torch.Tensor)), None)
        self.device_type = tensor.device.type if tensor is not None else "cpu"
        self.autocast = _autocast_state(self.device_type)
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.preserve_rng_state = preserve_rng_state
        self.cpu_rng: torch.Tensor | None = None
        self.devices: list[int] = []
        self.device_rng: list[torch.Tensor] = []
        if preserve_rng_state:
            self.cpu_rng = torch.get_rng_state()
            module = getattr(torch, self.device_type, None)
            if self.device_type != "cpu" and getattr(module, "_initialized", False):
                self.devices, self.device_rng = get_device_states(*self.args)

    def pack(self, x: torch.Tensor) -> _Placeholder:
        saved = _Placeholder(len(self.placeholders))
        self.placeholders.append(weakref.ref(saved))
        self.metadata.append((x.shape, x.dtype, x.device))
        return saved

    def unpack(self, saved: _Placeholder) -> torch.Tensor:
        if saved.value is None:
            if self.rebuilt:  # every live placeholder got its value at the rebuild
                raise RematError("internal error: a rebuilt region lost a saved tensor; "
                                 "please report it")
            self.rebuild()
        assert saved.value is not None
        return saved.value

    def _inputs(self) -> list[Any]:
        inputs = []
        for a, version in zip(self.args, self.versions, strict=True):
            if isinstance(a, torch.Tensor):
                if a._version != version:
                    raise RematError(
                        "a checkpointed region's input was changed in place after the "
                        "region's forward, so its rebuild would compute other values; "
                        "clone the tensor before changing it")
                a = a.detach().requires_grad_(a.requires_grad)
            inputs.append(a)
        return inputs

    def rebuild(self) -> None:
        alive = [i for i, ref in enumerate(self.placeholders) if ref() is not None]
        last = alive[-1] if alive else -1
        count = 0

        def pack(x: torch.Tensor) -> torch.Tensor:
            nonlocal count
            i = count
            count += 1
            if i >= len(self.placeholders):
                raise RematError(
                    "a checkpointed region saved more tensors in its rebuild than in its "
                    "forward; its code takes another path the second time (a branch on "
                    "data or on state it changes): keep that code out of regions")
            shape, dtype, device = self.metadata[i]
            if (x.shape, x.dtype, x.device) != (shape, dtype, device):
                raise RematError(
                    f"a checkpointed region's rebuild saved a tensor of shape "
                    f"{tuple(x.shape)} {x.dtype} on {x.device} where its forward saved "
                    f"{tuple(shape)} {dtype} on {device}; its code takes another path the "
                    "second time: keep that code out of regions")
            # Detached: the rebuild's own graph would otherwise keep x through its hook,
            # and x its graph (a cycle autograd's C++ side keeps alive).
            x = x.detach() if x.requires_grad else x
            saved = self.placeholders[i]()
            if saved is not None:
                saved.value = x
            if i == last:
                raise _StopRebuild
            return x

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(
                devices=self.devices, enabled=self.preserve_rng_state,
                device_type=self.device_type))
            if self.cpu_rng is not None:
                torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache_enabled))
            stack.enter_context(self.recompute_context)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(contextlib.suppress(_StopRebuild))
            self.fn(*self._inputs())
        self.rebuilt = True
        if count <= last:
            raise RematError(
                "a checkpointed region saved fewer tensors in its rebuild than in its "
                "forward; its code takes another path the second time (a branch on data or "
                "on state it changes): keep that code out of regions")


class RebuildOnceFrame:
    """:class:`~remat.runtime._torch_checkpoint.CheckpointFrame`'s interface with one
    rebuild for all backward passes (Note [One rebuild for a backward in passes])."""

    __slots__ = ("_exit",)

    def __init__(self, exit_stack: contextlib.ExitStack) -> None:
        self._exit: contextlib.ExitStack | None = exit_stack

    @classmethod
    def open(
        cls,
        fn: Callable[..., Any],
        *args: Any,
        context_fn: Callable[[], Any] | None = None,
        preserve_rng_state: bool = True,
    ) -> RebuildOnceFrame:
        forward_context, recompute_context = (
            context_fn() if context_fn is not None
            else (contextlib.nullcontext(), contextlib.nullcontext()))
        region = _Region(fn, args, recompute_context, preserve_rng_state)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(region.pack,
                                                                     region.unpack))
        try:
            stack.enter_context(forward_context)
        except BaseException:
            stack.close()
            raise
        return cls(stack)

    def close(self) -> None:
        """Finish the forward: the hooks are popped; the placeholders keep the rest."""
        if self._exit is not None:
            exit_stack, self._exit = self._exit, None
            exit_stack.close()

    def abort(self) -> None:
        """Give up on the forward after an exception; idempotent."""
        self.close()
