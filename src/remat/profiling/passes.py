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
from remat.core.maxima import is_collecting, largest, maximum_of
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
        return largest(0, self.peak_bytes - self.entry_bytes - self.new_output_bytes)


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
    # No-save pass, per stage: what the code between the previous stage's return and its
    # call made and still held at the call, that no code offered to save, no stage was
    # passed, and is gone once loss_fn has returned (a vision tower's last hidden state,
    # kept in the model's output while the text tower runs; Note [What the code between
    # stages holds to the return] in remat.profiling.assemble)
    link_at_return_bytes: tuple[int, ...] = ()
    # Per stage: the model's code just after it offered to save its output (a norm of a
    # vision tower's last hidden state, while the next stage's input is made apart);
    # read from the no-save pass only.
    output_saved_after: tuple[bool, ...] = ()


def _gone_unmarked(made: dict[int, list[Any]]) -> int:
    """The bytes of what ``made`` lists that is gone now and was never marked."""
    return sum(nbytes for ref, nbytes, marked in made.values() if not marked and ref() is None)


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


class _Offers:
    """Autograd's saved-tensor hook of a pass: what the running stage, or the code before
    the next stage, offers to save, and which of the pre-chain's storages some code did.

    Apart from the rest of a pass's state: a graph that outlives the pass (a model that
    keeps its outputs) holds the hook, and so only these lists of weak references.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.order: list[int] = []
        self.current: list[int] = []  # the stage running now, if any
        # what it asked autograd to save
        self.offered: list[weakref.ref[torch.UntypedStorage]] = []
        self.inputs: list[weakref.ref[torch.UntypedStorage] | None] = [None] * n
        self.outputs: list[weakref.ref[torch.UntypedStorage] | None] = [None] * n
        # per stage: the code just after it offered to save its output
        self.output_saved_after = [False] * n
        # per stage, storage id -> [the storage, bytes, marked]: what the code just before
        # it made (since stage i - 1 returned; for stage 0, since loss_fn was called: the
        # pre-chain) and still held at its call (no-save pass), marked where some stage's
        # call got it or some code offered to save it; told by identity, as a freed
        # storage's id is reused
        self.made_in_link: list[dict[int, list[Any]]] = [{} for _ in range(n)]
        # per stage: the stage inputs the model's code just before it offered to save
        self.link_saves: list[set[int]] = [set() for _ in range(n)]
        # what the code since the last stage returned offered to save, and per stage whether
        # its input was one of them (an in-place ReLU saves its result)
        self.link_offered: list[weakref.ref[torch.UntypedStorage]] = []

    def mark(self, storage: torch.UntypedStorage) -> None:
        for made in self.made_in_link:
            entry = made.get(id(storage))
            if entry is not None and entry[0]() is storage:
                entry[2] = True

    def drop(self, t: torch.Tensor) -> None:
        # a tensor without one storage is neither an input nor an output
        with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
            storage = t.untyped_storage()
            self.mark(storage)
            if self.current:
                self.offered.append(weakref.ref(storage))
            elif len(self.order) < self.n:  # the code before the next stage, order[-1] + 1
                self.link_offered.append(weakref.ref(storage))
                last = self.order[-1] if self.order else None
                out = None if last is None else self.outputs[last]
                if out is not None and out() is storage:
                    self.output_saved_after[last] = True  # type: ignore[index]
                for j, ref in enumerate(self.inputs):
                    if ref is not None and ref() is storage:
                        self.link_saves[len(self.order)].add(j)

    def note(self, t: torch.Tensor) -> torch.Tensor:
        # saving pass: what a stage saves outside a checkpoint frame (a compiled stage's
        # graph, whatever option it was compiled with) reaches this hook
        self.drop(t)
        return t


class _Recorder:
    """What one forward pass notes at its stages' calls and returns, and in autograd's
    saved-tensor hook: the state the hooks share, one method per hook.

    The hooks keep the same references the pass always kept (weak ones to storages, the
    stage's input only from its call to its return), so the live bytes read are the same.
    """

    def __init__(self, model: nn.Module, batch: Any, names: Sequence[str],
                 device: torch.device | None, save: bool) -> None:
        self.names = names
        self.save = save
        self.modules = [stage_submodule(model, name) for name in names]
        n = self.n = len(self.modules)
        self.found: list[StageForward | None] = [None] * n
        self.entries: dict[int, tuple[int, torch.Tensor | None]] = {}
        self.kept = [False] * n
        # Saved tensors need no classifying here: the live bytes are the same either way.
        # While a range of shapes is profiled, each stage's peak keeps every live total
        # it is the largest of (remat.core.maxima): the tracker records them.
        self.tracker = LiveMemoryTracker(device=device, track_saved=False, cuda_stats=False,
                                         timeline=is_collecting())
        self.marks: dict[int, int] = {}
        # the saved-tensor hook's lists, shared (changed in place only)
        self.offers = offers = _Offers(n)
        self.inputs = offers.inputs
        self.outputs = offers.outputs
        # the last stage at whose return each stage's input / output was alive
        self.input_seen = [-1] * n
        self.output_seen = [-1] * n
        self.versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.batch_tensors = list(iter_tensors(batch))
        self.order = offers.order
        self.previous: dict[int, bool] = {}  # stage -> it got the previous stage's output
        self.current = offers.current  # the stage running now, if any
        self.offered = offers.offered  # what it asked autograd to save
        # storage id -> (the storage, bytes): what the stages' calls are passed from before
        # the chain besides their input (a 4-D attention mask, position ids; gemma2 passes
        # its sliding-window layers one mask and the others another); which of them each
        # call got; and the ids some stage offered to save
        self.call_args: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self.stage_args: list[list[int]] = [[] for _ in range(n)]
        self.args_saved: set[int] = set()
        self.args_at_return = 0
        self.args_by_stage: tuple[tuple[CallArg, ...], ...] = ()
        self.chain_start = 0  # the tracker's serial when stage 0 was called
        self.stage_end = [0] * n  # the tracker's serial when each stage returned
        self.link_at_return: tuple[int, ...] = ()
        self.step_start = 0  # the tracker's serial when loss_fn was called
        self.pre_chain_at_return = 0
        self.link_saves = offers.link_saves
        self.link_offered = offers.link_offered
        self.input_saved_before = [False] * n
        self.output_saved_after = offers.output_saved_after

    def alive(self, j: int) -> bool:
        ref = self.outputs[j]
        return ref is not None and ref() is not None

    def seen(self, k: int, at: int | None = None) -> None:
        """Note, at stage k's return (``at``: after the forward), what is still alive."""
        at = k if at is None else at
        for j in range(k + 1):
            ref = self.inputs[j]
            if ref is not None and ref() is not None:
                self.input_seen[j] = at
            if self.alive(j):
                self.output_seen[j] = at

    def offered_any(self, t: torch.Tensor | None) -> bool:
        if t is None:
            return False
        storage = t.untyped_storage()
        return any(ref() is storage for ref in self.offered)

    def returned(self, _model: nn.Module, _args: Any, _output: Any) -> None:
        # The model's forward has returned and its loop variables are gone: an earlier
        # stage's output still alive now is in what it returns (a transformers model with
        # output_hidden_states=True returns every layer's output). The last stage's
        # output may be the model's own output.
        for j in range(self.n - 1):
            self.kept[j] = self.kept[j] or self.alive(j)
        self.seen(self.n - 1, at=self.n)
        self.pre_chain_at_return = _gone_unmarked(self.offers.made_in_link[0])

    def pre(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tracker = self.tracker
        x = main_input(args, kwargs)
        if i > 0 and x is not None:  # (the code before the first stage is the pre-chain)
            with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                if any(ref() is x.untyped_storage() for ref in self.link_offered):
                    self.input_saved_before[i] = True
        if not self.save:  # what the code just before the stage made and still holds
            since = self.step_start if i == 0 else self.stage_end[i - 1]
            self.offers.made_in_link[i].update(
                (id(o), [ref, nbytes, False])
                for ref, nbytes in tracker.live_since(since) if (o := ref()) is not None)
            for ref in self.link_offered:  # and of it, what that code offered to save
                if (o := ref()) is not None:
                    self.offers.mark(o)
        self.link_offered.clear()
        self.order.append(i)
        for j in range(i - 1):  # the loop holds only the previous stage's output now
            self.kept[j] = self.kept[j] or self.alive(j)
        tracker.reset_peak()
        self.entries[i] = (tracker.live_bytes, x)
        self.marks[i] = tracker.events_recorded
        if i == 0:
            self.chain_start = tracker.serial
        if not self.save:
            for t in iter_tensors((args, kwargs)):
                with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                    self.offers.mark(t.untyped_storage())
            for t in iter_tensors((args, kwargs)):
                with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                    storage = t.untyped_storage()
                    if (x is None or not same_storage(x, t)) and not any(
                            same_storage(t, b) for b in self.batch_tensors) and (
                            i == 0 or tracker.made_before(t, self.chain_start)):
                        self.call_args[id(storage)] = (weakref.ref(storage), storage.nbytes())
                        if id(storage) not in self.stage_args[i]:
                            self.stage_args[i].append(id(storage))
        self.previous[i] = i > 0 and x is not None and self.alive(i - 1) and (
            self.outputs[i - 1]() is x.untyped_storage()  # type: ignore[misc]
        )
        self.current[:] = [i]
        self.offered.clear()
        self.versions[i] = [(b, b._version) for b in self.modules[i].buffers()]

    def _peak(self, i: int, entry: int, peak: int, live: int) -> int:
        """Stage ``i``'s peak: the largest of the live totals since its call, with them as
        its terms while a range is profiled (where they account for the peak exactly)."""
        mark = self.marks.pop(i, None)
        lives = None if mark is None else self.tracker.lives_since(mark)
        if lives is None or max(entry, live, *lives) != peak:
            return peak
        return maximum_of((entry, *lives, live))

    def post(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        live, peak = self.tracker.live_bytes, self.tracker.peak_bytes
        entry, x = self.entries.pop(i)
        y = main_output(out)
        self.found[i] = StageForward(
            entry_bytes=entry,
            exit_bytes=live,
            peak_bytes=self._peak(i, entry, max(peak, live), live),
            boundary_bytes=storage_bytes(x),
            output_bytes=storage_bytes(y),
            output_is_new=y is not None and not same_storage(x, y),
            saves_input=self.offered_any(x),
            saves_output=self.offered_any(y),
            gets_previous_output=self.previous.get(i, False),
            mutated_buffer_bytes=_mutated_bytes(self.modules[i], self.versions.pop(i, [])),
        )
        for key, (ref, _) in self.call_args.items():
            storage = ref()
            if storage is not None and any(o() is storage for o in self.offered):
                self.args_saved.add(key)
        self.current.clear()
        self.offered.clear()
        if y is not None:
            self.outputs[i] = weakref.ref(y.untyped_storage())
        if x is not None and not any(same_storage(x, t) for t in self.batch_tensors):
            # (the batch is alive all step, counted apart)
            self.inputs[i] = weakref.ref(x.untyped_storage())
        if not self.save:
            self.seen(i)
            self.stage_end[i] = self.tracker.serial

    def run(self, model: nn.Module, batch: Any,
            loss_fn: Callable[[nn.Module, Any], Any]) -> int:
        """Run ``loss_fn(model, batch)`` under the hooks and the tracker, drop the graph;
        the bytes of the storage behind the loss."""
        n = self.n
        with stage_hooks(self.modules, self.pre, self.post), self.tracker:
            if self.save:
                with torch.autograd.graph.saved_tensors_hooks(self.offers.note, _same):
                    loss = loss_fn(model, batch)
            else:
                self.step_start = self.tracker.serial
                with torch.autograd.graph.saved_tensors_hooks(self.offers.drop, _never):
                    loss = loss_fn(model, batch)
                # the forward has returned; nothing is saved in this pass
                self.args_gone()
                # (the pre-chain's, gone at the model's return, is pre_chain_at_return)
                self.link_at_return = (0, *map(_gone_unmarked, self.offers.made_in_link[1:]))
            loss_storage = (loss.untyped_storage().nbytes()
                            if isinstance(loss, torch.Tensor) else 0)
            if self.save:  # what the graph holds counts, so before it goes
                for j in range(n):
                    self.kept[j] = self.kept[j] or self.alive(j)
            del loss
            if not self.save:
                for j in range(n):
                    self.kept[j] = self.kept[j] or self.alive(j)
                self.seen(n - 1, at=n)
        return loss_storage

    def args_gone(self) -> None:
        """No-save pass, once the forward has returned: the call arguments no stage
        offered to save that are gone, their bytes and which of them each call got."""
        call_args = self.call_args
        gone = [key for key, (ref, _) in call_args.items()
                if key not in self.args_saved and ref() is None]
        self.args_at_return = sum(call_args[key][1] for key in gone)
        index = {key: k for k, key in enumerate(gone)}
        self.args_by_stage = tuple(
            tuple(CallArg(index[key], call_args[key][1])
                  for key in keys if key in index)
            for keys in self.stage_args)

    def stages(self) -> tuple[StageForward, ...]:
        """Each stage's reading; UsageError where the forward did not call the stages
        once each in the order given."""
        names = self.names
        missing = [i for i, f in enumerate(self.found) if f is None]
        if missing:
            raise UsageError(
                f"the forward never called stage {names[missing[0]]!r}; list only stages that "
                "loss_fn(model, batch) runs"
            )
        if self.order != list(range(self.n)):
            called = ", ".join(repr(names[i]) for i in self.order[:4])
            raise UsageError(
                f"the forward calls the stages as {called}, ..., not once each in the order "
                "given; list the stages in the order the forward calls them, once each"
            )
        return tuple(f for f in self.found if f is not None)

    def result(self, loss_storage: int) -> ForwardPass:
        stages = self.stages()
        if self.save:
            return ForwardPass(stages, tuple(self.kept))
        n = self.n
        # The chain holds a stage's input through its call, and its output through the next
        # stage's call when that is its input (else only through its own return).
        own = [i + 1 if i + 1 < n and stages[i + 1].gets_previous_output else i
               for i in range(n)]
        return ForwardPass(
            stages,
            tuple(self.kept),
            link_saved_inputs=tuple(frozenset(js) for js in self.link_saves),
            input_saved_before=tuple(self.input_saved_before),
            input_held_through=tuple(k if k > i else None
                                     for i, k in enumerate(self.input_seen)),
            output_held_through=tuple(
                k if k > own[i] and i < n - 1 else None for i, k in enumerate(self.output_seen)
            ),
            loss_storage_bytes=loss_storage,
            args_at_return_bytes=self.args_at_return,
            call_args=self.args_by_stage,
            pre_chain_at_return_bytes=self.pre_chain_at_return,
            link_at_return_bytes=self.link_at_return,
            output_saved_after=tuple(self.output_saved_after),
        )


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

    recorder = _Recorder(model, batch, names, device, save)
    with buffers_restored(model):
        recorder.tracker.register_existing(model)
        recorder.tracker.register_existing(list(iter_tensors(batch)))
        handle = apply(model, plan) if plan is not None else None
        # kept_outside is read from the no-save pass only (nothing there is saved, so a
        # live output is a reference from outside the chain)
        root = None if save else model.register_forward_hook(recorder.returned)
        try:
            loss_storage = recorder.run(model, batch, loss_fn)
        finally:
            if root is not None:
                root.remove()
            if handle is not None:
                handle.remove()
    return recorder.result(loss_storage)
