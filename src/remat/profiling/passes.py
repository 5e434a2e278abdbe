"""Forward passes under the live-storage tracker: per-stage bytes for one saving option.

A pass runs ``loss_fn(model, batch)`` once with grad, reads the tracker's live and peak
bytes at every stage's call and return, and drops the graph without a backward. The
option is applied the way a plan applies it (``remat.runtime.install``), so what a
selective policy keeps (torch's selective-checkpoint cache plus the input the checkpoint
saves) is what the runtime will keep. A no-save pass drops every saved tensor, which is
what a stage costs inside a region's forward, and shows which stage outputs stay
referenced from outside the chain (after the chain moved on, or in what the model
returns, e.g. its hidden states).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.stage_record import CallArg
from remat.measure import LiveMemoryTracker
from remat.measure.tracker import iter_tensors
from remat.profiling._tensors import (
    buffers_restored,
    main_input,
    main_output,
    same_storage,
    stage_hooks,
    storage_bytes,
)
from remat.runtime.stage_calls import stage_submodule

__all__ = ["ForwardPass", "StageForward", "forward_pass"]


@dataclass(frozen=True)
class StageForward:
    """Live bytes around one stage call of a forward pass."""

    entry_bytes: int  # live when the stage was called (its input included)
    exit_bytes: int  # live when it returned (its output included)
    peak_bytes: int  # highest live while it ran
    boundary_bytes: int
    output_bytes: int
    output_is_new: bool  # the output's storage was made by the stage, not passed through
    # What autograd would save among the stage's input and output; known only from a
    # pass that saves nothing (its hook sees every tensor autograd offers to save).
    saves_input: bool = False
    saves_output: bool = False
    # Its input is the previous stage's output (by storage): no code of the model's between.
    gets_previous_output: bool = False
    # Buffers the stage changed in place (BatchNorm's running statistics): the runtime
    # clones them around every rebuild of the stage (Note [Buffers mutated in forward]).
    mutated_buffer_bytes: int = 0

    @property
    def new_output_bytes(self) -> int:
        return self.output_bytes if self.output_is_new else 0

    @property
    def kept_bytes(self) -> int:
        """What the stage left alive beyond its input and output (what it saved)."""
        return max(0, self.exit_bytes - self.entry_bytes - self.new_output_bytes)

    @property
    def over_io_bytes(self) -> int:
        """Peak above what was live when it was called plus its output."""
        return max(0, self.peak_bytes - self.entry_bytes - self.new_output_bytes)


@dataclass(frozen=True)
class ForwardPass:
    stages: tuple[StageForward, ...]
    # Per stage: its output was still alive after the chain moved past it (two stages
    # later, or after the forward). In the no-save pass nothing was saved, so that is a
    # reference from outside the chain; in a saving pass, also whatever saved it.
    kept_outside: tuple[bool, ...]
    # Per stage: the last stage whose return still found its input / its output
    # referenced beyond what the chain holds (n: still after the model's forward
    # returned), or None; read from the no-save pass only (Note [Held outside the chain]).
    input_held_through: tuple[int | None, ...] = ()
    output_held_through: tuple[int | None, ...] = ()
    # Per stage: the stages whose input the model's code just before it saves for
    # backward (``x * sigmoid(block(x))``); read from the no-save pass only.
    link_saved_inputs: tuple[frozenset[int], ...] = ()
    # Per stage: the model's code just before it saves its input (an in-place ReLU between
    # two stages saves its result, the next stage's input); read from the no-save pass only.
    input_saved_before: tuple[bool, ...] = ()
    # The storage behind the loss loss_fn returned: more than its one element where the
    # kernel returns a view of a whole buffer (CPU mse_loss keeps its elementwise losses).
    loss_storage_bytes: int = 0
    # No-save pass: what the stages' calls are passed from before the chain besides their
    # input (not the batch's own tensors) that no stage offers to save and that is gone
    # once the model's forward has returned (FixedBytes.args_at_return_bytes), and per
    # stage which of those its call got (StageRecord.call_args)
    args_at_return_bytes: int = 0
    call_args: tuple[tuple[CallArg, ...], ...] = ()
    # No-save pass: what the code before the chain made and still held when the first
    # stage was called, that no code offered to save, no stage was passed, and is gone
    # once the model's forward has returned (FixedBytes.pre_chain_at_return_bytes; Note
    # [What the model's forward lets go of at its return] in remat.profiling.assemble)
    pre_chain_at_return_bytes: int = 0


def _mutated_bytes(module: nn.Module, versions: list[tuple[torch.Tensor, int]]) -> int:
    """Bytes of the buffers the runtime clones around a rebuild of ``module`` (the rule of
    ``remat.runtime.engine``: those whose version changed, and a norm's running statistics
    when its ``num_batches_tracked`` did, which torch's kernels update without a bump)."""
    changed = {id(b): b for b, v in versions if b._version != v}
    for m in module.modules():
        stats = m._buffers
        counter = stats.get("num_batches_tracked")
        if counter is not None and id(counter) in changed:
            for name in ("running_mean", "running_var"):
                b = stats.get(name)
                if b is not None:
                    changed[id(b)] = b
    return sum(storage_bytes(b) for b in changed.values())


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _never(_packed: None) -> torch.Tensor:
    raise AssertionError("remat profile: a no-save pass was run backward")


def forward_pass(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    names: Sequence[str],
    *,
    device: torch.device | None,
    plan: Plan | None = None,
    save: bool = True,
) -> ForwardPass:
    """Run one forward under the tracker with ``plan`` applied (or none) and read each stage.

    ``save=False`` drops everything autograd saves (no backward is possible).
    """
    from remat.runtime import apply

    modules = [stage_submodule(model, name) for name in names]
    n = len(modules)
    found: list[StageForward | None] = [None] * n
    entries: dict[int, tuple[int, torch.Tensor | None]] = {}
    outputs: list[weakref.ref[torch.UntypedStorage] | None] = [None] * n
    kept = [False] * n
    # Saved tensors need no classifying here: the live bytes are the same either way.
    tracker = LiveMemoryTracker(device=device, track_saved=False, cuda_stats=False)

    def alive(j: int) -> bool:
        ref = outputs[j]
        return ref is not None and ref() is not None

    inputs: list[weakref.ref[torch.UntypedStorage] | None] = [None] * n
    # the last stage at whose return each stage's input / output was alive
    input_seen = [-1] * n
    output_seen = [-1] * n

    def seen(k: int, at: int | None = None) -> None:
        """Note, at stage k's return (``at``: after the forward), what is still alive."""
        at = k if at is None else at
        for j in range(k + 1):
            ref = inputs[j]
            if ref is not None and ref() is not None:
                input_seen[j] = at
            if alive(j):
                output_seen[j] = at

    versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
    batch_tensors = list(iter_tensors(batch))
    order: list[int] = []
    previous: dict[int, bool] = {}  # stage -> it got the previous stage's output
    current: list[int] = []  # the stage running now, if any
    offered: list[weakref.ref[torch.UntypedStorage]] = []  # what it asked autograd to save

    # storage id -> (the storage, bytes): what the stages' calls are passed from before
    # the chain besides their input (a 4-D attention mask, position ids; gemma2 passes
    # its sliding-window layers one mask and the others another); which of them each
    # call got; and the ids some stage offered to save
    call_args: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
    stage_args: list[list[int]] = [[] for _ in range(n)]
    args_saved: set[int] = set()
    args_at_return = 0
    args_by_stage: tuple[tuple[CallArg, ...], ...] = ()
    chain_start = [0]  # the tracker's serial when stage 0 was called
    step_start = [0]  # the tracker's serial when loss_fn was called
    # storage id -> [the storage, bytes, marked]: what the step had made and still held
    # when stage 0 was called (no-save pass), marked where some stage's call got it or
    # some code offered to save it; told by identity, as a freed storage's id is reused
    before_chain: dict[int, list[Any]] = {}

    def mark(storage: torch.UntypedStorage) -> None:
        entry = before_chain.get(id(storage))
        if entry is not None and entry[0]() is storage:
            entry[2] = True
    pre_chain_at_return = [0]

    # per stage: the stage inputs the model's code just before it offered to save
    link_saves: list[set[int]] = [set() for _ in range(n)]
    # what the code since the last stage returned offered to save, and per stage whether
    # its input was one of them (an in-place ReLU saves its result)
    link_offered: list[weakref.ref[torch.UntypedStorage]] = []
    input_saved_before = [False] * n

    def drop(t: torch.Tensor) -> None:
        # a tensor without one storage is neither an input nor an output
        with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
            storage = t.untyped_storage()
            mark(storage)
            if current:
                offered.append(weakref.ref(storage))
            elif len(order) < n:  # the code before the next stage, order[-1] + 1
                link_offered.append(weakref.ref(storage))
                for j, ref in enumerate(inputs):
                    if ref is not None and ref() is storage:
                        link_saves[len(order)].add(j)

    def note(t: torch.Tensor) -> torch.Tensor:
        # saving pass: what a stage saves outside a checkpoint frame (a compiled stage's
        # graph, whatever option it was compiled with) reaches this hook
        drop(t)
        return t

    def offered_any(t: torch.Tensor | None) -> bool:
        if t is None:
            return False
        storage = t.untyped_storage()
        return any(ref() is storage for ref in offered)

    def returned(_model: nn.Module, _args: Any, _output: Any) -> None:
        # The model's forward has returned and its loop variables are gone: an earlier
        # stage's output still alive now is in what it returns (a transformers model with
        # output_hidden_states=True returns every layer's output). The last stage's
        # output may be the model's own output.
        for j in range(n - 1):
            kept[j] = kept[j] or alive(j)
        seen(n - 1, at=n)
        pre_chain_at_return[0] = sum(
            nbytes for ref, nbytes, marked in before_chain.values()
            if not marked and ref() is None)

    def pre(i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = main_input(args, kwargs)
        if i > 0 and x is not None:  # (the code before the first stage is the pre-chain)
            with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                if any(ref() is x.untyped_storage() for ref in link_offered):
                    input_saved_before[i] = True
        if i == 0 and not save:  # what the pre-chain made and still holds, and offered to save
            before_chain.update((id(o), [ref, nbytes, False])
                                for ref, nbytes in tracker.live_since(step_start[0])
                                if (o := ref()) is not None)
            for ref in link_offered:
                if (o := ref()) is not None:
                    mark(o)
        link_offered.clear()
        order.append(i)
        for j in range(i - 1):  # the loop holds only the previous stage's output now
            kept[j] = kept[j] or alive(j)
        tracker.reset_peak()
        entries[i] = (tracker.live_bytes, x)
        if i == 0:
            chain_start[0] = tracker.serial
        if not save:
            for t in iter_tensors((args, kwargs)):
                with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                    mark(t.untyped_storage())
            for t in iter_tensors((args, kwargs)):
                with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                    storage = t.untyped_storage()
                    if (x is None or not same_storage(x, t)) and not any(
                            same_storage(t, b) for b in batch_tensors) and (
                            i == 0 or tracker.made_before(t, chain_start[0])):
                        call_args[id(storage)] = (weakref.ref(storage), storage.nbytes())
                        if id(storage) not in stage_args[i]:
                            stage_args[i].append(id(storage))
        previous[i] = i > 0 and x is not None and alive(i - 1) and (
            outputs[i - 1]() is x.untyped_storage()  # type: ignore[misc]
        )
        current[:] = [i]
        offered.clear()
        versions[i] = [(b, b._version) for b in modules[i].buffers()]

    def post(i: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        live, peak = tracker.live_bytes, tracker.peak_bytes
        entry, x = entries.pop(i)
        y = main_output(out)
        found[i] = StageForward(
            entry_bytes=entry,
            exit_bytes=live,
            peak_bytes=max(peak, live),
            boundary_bytes=storage_bytes(x),
            output_bytes=storage_bytes(y),
            output_is_new=y is not None and not same_storage(x, y),
            saves_input=offered_any(x),
            saves_output=offered_any(y),
            gets_previous_output=previous.get(i, False),
            mutated_buffer_bytes=_mutated_bytes(modules[i], versions.pop(i, [])),
        )
        for key, (ref, _) in call_args.items():
            storage = ref()
            if storage is not None and any(o() is storage for o in offered):
                args_saved.add(key)
        current.clear()
        offered.clear()
        if y is not None:
            outputs[i] = weakref.ref(y.untyped_storage())
        if x is not None and not any(same_storage(x, t) for t in batch_tensors):
            # (the batch is alive all step, counted apart)
            inputs[i] = weakref.ref(x.untyped_storage())
        if not save:
            seen(i)

    with buffers_restored(model):
        tracker.register_existing(model)
        tracker.register_existing(list(iter_tensors(batch)))
        handle = apply(model, plan) if plan is not None else None
        # kept_outside is read from the no-save pass only (nothing there is saved, so a
        # live output is a reference from outside the chain)
        root = None if save else model.register_forward_hook(returned)
        try:
            with stage_hooks(modules, pre, post), tracker:
                if save:
                    with torch.autograd.graph.saved_tensors_hooks(note, _same):
                        loss = loss_fn(model, batch)
                else:
                    step_start[0] = tracker.serial
                    with torch.autograd.graph.saved_tensors_hooks(drop, _never):
                        loss = loss_fn(model, batch)
                    # the forward has returned; nothing is saved in this pass
                    gone = [key for key, (ref, _) in call_args.items()
                            if key not in args_saved and ref() is None]
                    args_at_return = sum(call_args[key][1] for key in gone)
                    index = {key: k for k, key in enumerate(gone)}
                    args_by_stage = tuple(
                        tuple(CallArg(index[key], call_args[key][1])
                              for key in keys if key in index)
                        for keys in stage_args)
                loss_storage = (loss.untyped_storage().nbytes()
                                if isinstance(loss, torch.Tensor) else 0)
                if save:  # what the graph holds counts, so before it goes
                    for j in range(n):
                        kept[j] = kept[j] or alive(j)
                del loss
                if not save:
                    for j in range(n):
                        kept[j] = kept[j] or alive(j)
                    seen(n - 1, at=n)
        finally:
            if root is not None:
                root.remove()
            if handle is not None:
                handle.remove()
    missing = [i for i, f in enumerate(found) if f is None]
    if missing:
        raise UsageError(
            f"the forward never called stage {names[missing[0]]!r}; list only stages that "
            "loss_fn(model, batch) runs"
        )
    if order != list(range(n)):
        called = ", ".join(repr(names[i]) for i in order[:4])
        raise UsageError(
            f"the forward calls the stages as {called}, ..., not once each in the order "
            "given; list the stages in the order the forward calls them, once each"
        )
    stages = tuple(f for f in found if f is not None)
    if save:
        return ForwardPass(stages, tuple(kept))
    # The chain holds a stage's input through its call, and its output through the next
    # stage's call when that is its input (else only through its own return).
    own = [i + 1 if i + 1 < n and stages[i + 1].gets_previous_output else i for i in range(n)]
    return ForwardPass(
        stages,
        tuple(kept),
        link_saved_inputs=tuple(frozenset(js) for js in link_saves),
        input_saved_before=tuple(input_saved_before),
        input_held_through=tuple(k if k > i else None for i, k in enumerate(input_seen)),
        output_held_through=tuple(
            k if k > own[i] and i < n - 1 else None for i, k in enumerate(output_seen)
        ),
        loss_storage_bytes=loss_storage,
        args_at_return_bytes=args_at_return,
        call_args=args_by_stage,
        pre_chain_at_return_bytes=pre_chain_at_return[0],
    )
