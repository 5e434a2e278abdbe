"""The model's own code between the stages of a region: recorded in forward, replayed in rebuild.

Note [Glue between stages]
--------------------------
A model's loop often does more than pass one stage's output to the next: ``x = x + b(x)``
(the residual add outside the block), ``torch.cat([h, skip])`` (a UNet's skip), a norm, a
dropout, an encoder's final norm and a decoder's embedding between two stacks. Inside a
region that code must run again in the rebuild, in the same order as in forward, or the
rebuild would save other tensors than the forward did (torch rejects that) and could not
produce the next stage's input at all.

So while a region is open, between a stage's return and the next stage's call, a
:class:`~torch.overrides.TorchFunctionMode` records every torch call the model makes
(``func``, its arguments, its outputs). Tensors made inside the pass's regions (stage
inputs and outputs, results of recorded calls) are named by *slot*, never held: a record
holding them would keep alive what the region exists to free. The rebuild replays the
tape, stage calls and recorded calls alike, with each slot bound to the value rebuilt this
time. Tensors from outside the region (parameters, masks, an encoder output, a skip made
before the region opened) are held as they are; each one's ``_version`` is noted, and a
replay that finds one changed in place since refuses to run rather than rebuild from a
changed value.

Only the outermost call is recorded (inside ``__torch_function__`` torch switches the mode
off), so ``F.dropout`` or ``F.layer_norm`` of a module called between stages is one
record, replayed with the RNG state torch's checkpoint restores. Calls whose results hold
no tensor are skipped unless they change state (``__setitem__``, in-place methods,
``torch.set_grad_enabled``).

Some links cannot be replayed, and the profile marks them as chain breaks (no region
crosses them): the code reads tensor values into Python (``item``, ``bool(t)``,
``tolist``...; the branch it then takes is not recorded), or changes a tensor from outside
the region in place that needs a gradient. Buffers changed in place between stages
(BatchNorm's running statistics) are put back after their replay, as stage buffers are
(Note [Buffers mutated in forward] in ``engine.py``). Python side effects (appending to a
list) are not torch calls: they happen once, in forward.

Under ``torch.compile`` of the whole model the recorder's ``__torch_function__`` is
disabled for Dynamo, which then graph-breaks at each call between two stages of an open
region and runs it eagerly, through the recorder: a compiled graph there would save other
tensors in forward than the eager replay saves, and torch would reject the rebuild.
Outside regions the model's code compiles as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from remat.core.errors import RematError

__all__ = [
    "GlueRecorder", "GlueStep", "Slot", "Tape", "Template", "bind", "call_restoring", "func_name",
]

# Calls that turn tensor values into Python values: what the code does next is not recorded.
READS_VALUES = frozenset(
    {"__bool__", "item", "tolist", "__int__", "__float__", "__complex__", "__index__",
     "numpy", "__array__", "equal", "allclose", "is_nonzero", "__format__"}
)
# Calls with no tensor result that still change what later calls compute.
_STATEFUL = frozenset({"__setitem__", "_set_grad_enabled", "set_grad_enabled", "__delitem__"})


def func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", type(func).__name__)


class Slot:
    """A tensor made inside the pass's regions, by number."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __repr__(self) -> str:
        return f"Slot({self.k})"


@dataclass(eq=False)
class Template:
    """A call's ``(args, kwargs)`` with region tensors as :class:`Slot` and the rest as is."""

    leaves: list[Any]
    spec: Any
    versions: tuple[tuple[int, int], ...]  # (leaf index, _version) of outside tensors

    def decode(self, env: dict[int, torch.Tensor], what: str) -> Any:
        for index, version in self.versions:
            if self.leaves[index]._version != version:
                raise RematError(
                    f"a tensor that {what} uses from outside its region was changed in place "
                    "after the forward used it, so the rebuild cannot replay it; do not modify "
                    "tensors in place after a checkpointed region used them"
                )
        leaves = [env[leaf.k] if isinstance(leaf, Slot) else leaf for leaf in self.leaves]
        return tree_unflatten(leaves, self.spec)


@dataclass(eq=False)
class GlueStep:
    """One recorded call of the model's own code between two stages of a region."""

    func: Callable[..., Any]
    inputs: Template
    outputs: tuple[int | None, ...]
    restore: tuple[torch.Tensor, ...] = ()  # buffers it changed in place: put back after

    def replay(self, env: dict[int, torch.Tensor]) -> None:
        args, kwargs = self.inputs.decode(env, f"the model's call of {func_name(self.func)}")
        out = call_restoring(self.restore, self.func, *args, **kwargs)
        bind(self.outputs, out, env, func_name(self.func))


def call_restoring(
    buffers: tuple[torch.Tensor, ...], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` with ``buffers`` put back afterwards (Note [Buffers mutated
    in forward] in ``engine.py``): a rebuild must not move running statistics again."""
    if not buffers:
        return fn(*args, **kwargs)
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    try:
        return fn(*args, **kwargs)
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def bind(slots: tuple[int | None, ...], out: Any, env: dict[int, torch.Tensor], what: str) -> None:
    """Bind the rebuilt ``out``'s tensors to the slots its forward twin was given."""
    leaves, _ = tree_flatten(out)
    if len(leaves) != len(slots):
        raise RematError(
            f"{what} returned {len(leaves)} values in the rebuild but {len(slots)} in forward; "
            "a stage or the code between stages must return the same structure every time"
        )
    for k, leaf in zip(slots, leaves, strict=True):
        if k is not None:
            env[k] = leaf


@dataclass(eq=False)
class Tape:
    """Slot numbers of the tensors made inside the regions of one forward pass."""

    slots: WeakTensorKeyDictionary = field(default_factory=WeakTensorKeyDictionary)
    made_after: list[int] = field(default_factory=list)  # slot -> stages called before it
    # slot -> its storage's bytes, kept only when asked (the profile's probe pass): a list
    sizes: list[int] | None = None

    def reset(self) -> None:
        self.slots = WeakTensorKeyDictionary()
        self.made_after = []
        if self.sizes is not None:
            self.sizes = []

    def nbytes(self, k: int) -> int:
        assert self.sizes is not None, "Tape.sizes is off"
        return self.sizes[k]

    @property
    def count(self) -> int:
        return len(self.made_after)

    def slot_of(self, t: object) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        return self.slots.get(t)

    def give(self, t: torch.Tensor, stages_called: int) -> int:
        """``t``'s slot, a new one if it has none."""
        k = self.slots.get(t)
        if k is None:
            k = len(self.made_after)
            self.slots[t] = k
            self.made_after.append(stages_called)
            if self.sizes is not None:
                self.sizes.append(t.untyped_storage().nbytes())
        return k

    def encode(self, value: Any) -> Template:
        leaves, spec = tree_flatten(value)
        out: list[Any] = []
        versions = []
        for index, leaf in enumerate(leaves):
            k = self.slot_of(leaf)
            if k is not None:
                out.append(Slot(k))
            else:
                out.append(leaf)
                if isinstance(leaf, torch.Tensor):
                    versions.append((index, leaf._version))
        return Template(out, spec, tuple(versions))

    def outputs(self, out: Any, stages_called: int) -> tuple[int | None, ...]:
        leaves, _ = tree_flatten(out)
        return tuple(
            self.give(leaf, stages_called) if isinstance(leaf, torch.Tensor) else None
            for leaf in leaves
        )


class GlueRecorder(TorchFunctionMode):
    """Records the torch calls between two stages of an open region (Note [Glue between ...]).

    ``on_step(step)`` receives each recorded call; ``on_hazard(reason)`` is told about a
    call that cannot be replayed, before it runs.
    """

    def __init__(
        self,
        tape: Tape,
        stages_called: int,
        on_step: Callable[[GlueStep], None],
        on_hazard: Callable[[str], None],
    ) -> None:
        super().__init__()
        self.tape = tape
        self.stages_called = stages_called
        self.on_step = on_step
        self.on_hazard = on_hazard

    @torch.compiler.disable(recursive=True)
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func_name(func)
        if name in READS_VALUES:
            self.on_hazard(f"it reads tensor values into Python ({name})")
            return func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        outside = [
            t for t in leaves if isinstance(t, torch.Tensor) and self.tape.slot_of(t) is None
        ]
        before = [t._version for t in outside]
        out = func(*args, **kwargs)
        out_leaves, _ = tree_flatten(out)
        has_tensor = any(isinstance(t, torch.Tensor) for t in out_leaves)
        changed = [t for t, v in zip(outside, before, strict=True) if t._version != v]
        if name == "batch_norm":  # updates running stats without bumping _version
            changed += [
                t for t in outside if not t.requires_grad and all(t is not c for c in changed)
            ]
        if not has_tensor and not changed and name not in _STATEFUL:
            return out
        for t in changed:
            if t.requires_grad:
                self.on_hazard(f"it changes a tensor from outside the region in place ({name})")
        step = GlueStep(
            func,
            self.tape.encode((args, kwargs)),
            (),
            tuple(t for t in changed if not t.requires_grad),
        )
        # Encoded before the outputs get slots: an in-place result is its own input.
        step.outputs = self.tape.outputs(out, self.stages_called)
        self.on_step(step)
        return out
