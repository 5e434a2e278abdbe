"""LiveMemoryTracker: exact live-storage accounting at the dispatcher, on CPU and CUDA alike.

Note [Counting storages]
~~~~~~~~~~~~~~~~~~~~~~~~
Memory belongs to storages, not tensors: views, ``detach()``, in-place results and
``t.data`` all share one storage. The tracker keeps one record per storage, keyed by the
identity of its Python ``UntypedStorage`` object, and counts ``nbytes`` (rounded up to the
caching allocator's 512-byte block on CUDA) once.

That key is sound because torch preserves a storage's Python object the way it preserves a
tensor's: while the C++ StorageImpl lives, every ``t.untyped_storage()`` on any tensor or view
of it returns the same object, and that object is destroyed exactly when the StorageImpl is.
A ``weakref.ref`` on it therefore fires its callback synchronously at the moment the memory
goes back to the allocator (refcount zero, or the garbage collector breaking a cycle), and
that callback subtracts the bytes. ``tests/test_tracker.py::test_storage_object_is_preserved``
guards this torch behaviour.

A storage is new, and counted, when it appears in an op's outputs, is not yet recorded, and
is not the storage of one of that op's inputs (a view of a tensor the tracker was not told
about stays uncounted). ``lift_fresh`` is the exception: it returns a tensor ``torch.tensor``
built outside the dispatcher, so its storage is new although it is also the input's.
A storage that grows in place (``resize_``, ``set_``, an ``out=`` argument) is seen the same
way: those ops return the tensor they grew, and a counted output's ``nbytes`` is re-read.
Live bytes only grow when a storage is counted or grows, so sampling the peak after each
op's outputs are counted sees every maximum; frees happen in between and only lower it.

Note [Saved tensors]
~~~~~~~~~~~~~~~~~~~~
Which storages are activations is learnt from ``saved_tensors_hooks``: pack increments the
storage's saved count and returns a holder; autograd drops the holder when it releases the
saved tensor (after backward, or with the graph), and the holder's ``__del__`` decrements the
count before the holder lets go of its tensor. The holder keeps ``t.detach()`` rather than
``t``: for an op's own output ``t.grad_fn`` is the node that owns the holder, and keeping
``t`` would make a reference cycle that frees the graph only at the next garbage collection,
changing the very thing being measured. With hooks installed autograd no longer checks
saved tensors' version counters, so unpack repeats that check to keep in-place errors.
Inside a non-reentrant checkpoint region the checkpoint's own hooks take precedence, which
is right: what the region does not save is not saved.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
from torch.utils.hooks import RemovableHandle

from remat.core.errors import UsageError
from remat.measure.modes import (
    EagerDispatchMode,
    compiled_code_runs_eagerly,
    without_compiled_insides,
)
from remat.measure.records import (
    Category,
    CategoryBytes,
    Event,
    MemoryReport,
    Phase,
    PhasePeaks,
)

__all__ = ["LiveMemoryTracker", "active_tracker", "counting_fake_storages", "local_shard",
           "storage_key"]

_CUDA_BLOCK_BYTES = 512
_MODULE_KEY = "remat.module_path"
_FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
_ORDERED_CATEGORIES = tuple(Category)
_ACTIVE: list[LiveMemoryTracker] = []  # trackers inside their with-block, innermost last


# Note [Fake storages]
# Under FakeTensorMode a tensor's storage is a meta storage of the right size: nothing is
# allocated, but the storage is an object that lives and dies as the real one would, so
# the tracker's accounting (one record per storage, freed by a weakref callback) holds
# unchanged. Meta storages are otherwise ignored (meta tensors allocate nothing); inside
# counting_fake_storages() they are counted, whatever device the fake tensor reports.
_COUNT_FAKE = [False]


@contextmanager
def counting_fake_storages() -> Iterator[None]:
    """Count meta storages (a fake-tensor run's) as the memory they stand for."""
    before = _COUNT_FAKE[0]
    _COUNT_FAKE[0] = True
    try:
        yield
    finally:
        _COUNT_FAKE[0] = before


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds; its own storage is a placeholder of
    the whole tensor's size), any other tensor itself."""
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        with torch.no_grad():
            return cast(torch.Tensor, t.to_local())
    return t


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """What identifies ``t``'s storage among live tensors (views share it): its device and
    address; for a meta storage (a fake tensor's, all at address 0) the storage object's
    own; a DTensor's local shard's. None for a tensor without one storage, or an empty
    one."""
    t = local_shard(t)
    try:
        storage = t.untyped_storage()
        if not storage.nbytes():
            return None
        if storage.device.type == "meta":
            return ("meta", int(storage._cdata))
        return (str(t.device), int(storage.data_ptr()))
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, opaque
        return None


def active_tracker() -> LiveMemoryTracker | None:
    """The innermost tracker whose ``with`` block is running, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class _Record:
    __slots__ = ("base", "nbytes", "ref", "saved", "serial")

    def __init__(self, nbytes: int, base: Category) -> None:
        self.nbytes = nbytes
        self.base = base
        self.saved = 0
        self.serial = 0
        self.ref: weakref.ref[torch.UntypedStorage] | None = None

    def category(self) -> Category:
        if self.base is Category.TEMPORARIES and self.saved > 0:
            return Category.ACTIVATIONS
        return self.base


class _Saved:
    """What autograd keeps in place of a saved tensor while tracking (Note [Saved tensors])."""

    __slots__ = ("record", "tensor", "tracker", "version")

    def __init__(
        self,
        tensor: torch.Tensor,
        version: int,
        record: _Record | None,
        tracker: weakref.ref[LiveMemoryTracker],
    ) -> None:
        self.tensor = tensor
        self.version = version
        self.record = record
        self.tracker = tracker

    def __del__(self) -> None:
        tracker = self.tracker()
        if tracker is not None and self.record is not None:
            tracker._unsave(self.record)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in obj: a tensor, or lists, tuples and dicts of them, nested."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return local_shard(t).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested or opaque tensors have no single storage to count


def _as_category(category: Category | str) -> Category:
    try:
        return Category(category)
    except ValueError:
        names = ", ".join(c.value for c in Category)
        raise UsageError(f"category {category!r} is unknown; use one of {names}") from None


def _as_phase(phase: Phase | str) -> Phase:
    try:
        return Phase(phase)
    except ValueError:
        names = ", ".join(p.value for p in Phase)
        raise UsageError(f"phase {phase!r} is unknown; use one of {names}") from None


class _DispatchCounter(EagerDispatchMode):
    # A compiled backward can call higher-order operators (run_with_rng_state, replaying
    # a dropout it recomputes): they come here with this mode off, run as they are, and
    # their outputs are counted like an op's (Note [Compiled calls under the tracker]).
    supports_higher_order_operators = True

    def __init__(self, tracker: LiveMemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let the subclass unwrap; its inner ops come back here
        tracker = self.tracker
        if tracker._internal:
            return func(*args, **kwargs)
        # Holding the input storages (not just their ids) keeps an id from being reused by
        # an output's storage should the op free an input's (set_).
        inputs = [
            *(_storage(t) for t in (*iter_tensors(args), *iter_tensors(kwargs))),
            *(a for a in (*args, *kwargs.values()) if isinstance(a, torch.UntypedStorage)),
        ]
        out = func(*args, **kwargs)
        tracker._count_op(func, {id(s) for s in inputs if s is not None}, out)
        return out


class _NodeTagger(TorchFunctionMode):
    """Tags each autograd node with the module whose forward made it, for backward's paths."""

    def __init__(self, tracker: LiveMemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        first = _next_sequence_nr()
        out = func(*args, **(kwargs or {}))
        stack = self.tracker._module_stack
        if stack and stack[-1] and torch.is_grad_enabled():
            _tag_nodes(out, stack[-1], first)
        return out


def _next_sequence_nr() -> int | None:
    """The sequence number autograd gives the next node this thread makes (None where
    torch does not say)."""
    get = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return int(get()) if get is not None else None


# Note [Nodes made below the op]
# A function the tagger sees can make several autograd nodes: nn.LSTM's one call makes
# the transposes of batch_first and, behind them, the recurrent kernel's node (whose
# backward makes the weights' gradients); F.linear on a 3-D input a view, the matmul and
# a view back. Only the output's own node was tagged, so the rest ran in backward with no
# module, outside their stage's span: an LSTM stack's no-checkpoint peak, in the
# kernel's backward, was predicted 1.3% under. So every node the call made (its sequence
# number at or past the one autograd would have given next when the call began) is
# tagged, walking back from the outputs; nodes from before the call (the inputs', the
# model's code between stages) and parameters' AccumulateGrad nodes (numbered last) are
# not: they belong to whoever made them.
_LAST_SEQUENCE_NR = 2**64 - 1


def _tag_nodes(out: Any, path: str, first: int | None) -> None:
    seen: set[int] = set()
    todo = [t.grad_fn for t in iter_tensors(out) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        metadata = cast("dict[str, Any]", node.metadata)  # a property, typed as a method
        metadata.setdefault(_MODULE_KEY, path)
        if first is None:
            continue  # the output's own node only, as before torch numbered them
        for child, _ in node.next_functions:
            if child is not None and first <= child._sequence_nr() < _LAST_SEQUENCE_NR:
                todo.append(child)


class LiveMemoryTracker:
    """Counts every live storage exactly, by category, phase and module, inside a ``with`` block.

    Storages made by ops inside the block are counted once each and subtracted when freed
    (Note [Counting storages]). Tensors that existed before must be registered with
    ``register_existing`` (a module's parameters, buffers and gradients, an optimizer's
    state, the batch); anything else that existed before is not counted. ``watch(model)``
    adds module paths and classifies gradients; ``watch(optimizer)`` classifies optimizer
    state and marks its step as the optimizer phase. Hooks live only inside the block.

    Args:
        device: count only storages on this device (all non-meta devices when None).
        timeline: record an ``Event`` per op, free and registration, up to ``max_events``.
        track_saved: classify storages autograd saves as activations (installs
            ``saved_tensors_hooks``; turn off inside ``disable_saved_tensors_hooks``).
        cuda_stats: on CUDA, also read the allocator's allocated and reserved peaks.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        timeline: bool = False,
        max_events: int = 1_000_000,
        track_saved: bool = True,
        cuda_stats: bool = True,
    ) -> None:
        if max_events < 0:
            raise UsageError(f"max_events={max_events} is negative; give 0 or more")
        self._device = torch.device(device) if device is not None else None
        self._record_timeline = timeline
        self._max_events = max_events
        self._track_saved = track_saved
        self._cuda_stats = cuda_stats
        self._lock = threading.RLock()
        self._records: dict[int, _Record] = {}
        self._live: dict[Category, int] = dict.fromkeys(_ORDERED_CATEGORIES, 0)
        self._live_total = 0
        # Peak bookkeeping; _epoch counts growths of the live set, see _recategorize.
        self._epoch = 0
        self._peak_epoch = 0
        self._peak_total = 0
        self._peak: dict[Category, int] = dict(self._live)
        self._peak_phase: Phase | None = None
        self._peak_module = ""
        self._peak_event: int | None = None
        self._phase_peaks: dict[Phase, int] = {}
        self._start_total = 0
        self._events: list[Event] = []
        self._event_count = 0
        self._truncated = False
        self._phase_stack: list[Phase] = []
        self._module_stack: list[str] = []
        # calls named apart (watch's call_names): by module id, and the calls running now,
        # as (the module's path, the call's name), innermost last
        self._call_names: dict[int, Callable[[], str]] = {}
        self._calls: list[tuple[str, str]] = []
        self._optimizer_depth = 0
        self._internal = False
        self._watched_modules: list[nn.Module] = []
        self._watched_optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._exit_stack: ExitStack | None = None
        self._cuda_allocated: int | None = None
        self._cuda_reserved: int | None = None
        # A compiled call in progress (remat.measure.compiled_calls): the frees it sees,
        # timed, and what stops its allocator events should a compiled backward raise
        # between its two hooks.
        self._window: Any = None  # compiled_calls._Window while one is open
        self._backward_events: ExitStack | None = None
        self._serial = 0  # counts records made; a window frees only older ones by hand

    # ----------------------------------------------------------------- public API

    def register_existing(self, obj: Any, category: Category | str | None = None) -> int:
        """Count storages that already exist; return the bytes newly counted.

        A module contributes its parameters, buffers and existing gradients, an optimizer
        its state; tensors (or lists, tuples, dicts of them) go under ``category``, by
        default ``inputs``. A storage already counted moves to the given category.
        """
        with self._lock:
            added = 0
            if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
                if category is not None:
                    raise UsageError(
                        "register_existing takes no category for a module or an optimizer; "
                        "their tensors are classified automatically"
                    )
                if isinstance(obj, nn.Module):
                    for p in obj.parameters():
                        added += self._count_existing(p, Category.PARAMETERS)
                        if p.grad is not None:
                            added += self._count_existing(p.grad, Category.GRADIENTS)
                    for b in obj.buffers():
                        added += self._count_existing(b, Category.BUFFERS)
                else:
                    added += self._count_optimizer_state(obj)
            else:
                target = Category.INPUTS if category is None else _as_category(category)
                tensors = list(iter_tensors(obj))
                if not tensors and not isinstance(obj, (list, tuple, dict)):
                    raise UsageError(
                        f"register_existing got a {type(obj).__name__}; give a module, an "
                        "optimizer, a tensor, or a list, tuple or dict of tensors"
                    )
                for t in tensors:
                    added += self._count_existing(t, target)
            self._emit("register")
            return added

    def watch(self, obj: nn.Module | torch.optim.Optimizer, *,
              call_names: Mapping[nn.Module, Callable[[], str]] | None = None) -> None:
        """Hook ``obj`` while the tracker is active.

        For a module: module paths in the timeline (forward hooks, and autograd nodes tagged
        with the module that made them for backward) and gradients classified as they
        accumulate. For an optimizer: its step is the optimizer phase and the state it
        creates is classified as optimizer state.

        ``call_names`` names each call of the modules it holds apart: a call of such a
        module is the path ``call_names[module]()`` returns when the call begins
        (``layer#2``, the stage it is), and the modules inside it run under that name
        (``layer#2.attn``), in forward and in backward.
        """
        if isinstance(obj, nn.Module):
            self._watched_modules.append(obj)
            self._call_names.update({id(m): f for m, f in (call_names or {}).items()})
        elif isinstance(obj, torch.optim.Optimizer):
            self._watched_optimizers.append(obj)
        else:
            raise UsageError(
                f"watch got a {type(obj).__name__}; give a torch.nn.Module or a "
                "torch.optim.Optimizer"
            )
        if self._exit_stack is not None:
            self._install(obj)

    @contextmanager
    def phase(self, phase: Phase | str) -> Iterator[None]:
        """Label ops in the block with ``phase``; inside autograd's engine the phase is
        detected instead (backward, or rebuild for forward ops a checkpoint replays)."""
        self._phase_stack.append(_as_phase(phase))
        try:
            yield
        finally:
            self._phase_stack.pop()

    def reset_peak(self) -> None:
        """Forget the peak so far: the peak restarts from what is live now."""
        with self._lock:
            self._set_peak(None, "", None)
            self._phase_peaks.clear()

    @property
    def serial(self) -> int:
        """How many storages the tracker has counted so far (see :meth:`made_before`)."""
        return self._serial

    def made_before(self, t: torch.Tensor, serial: int) -> bool:
        """Whether ``t``'s storage is a counted one the tracker saw before it had counted
        ``serial`` storages (a tensor the model made before some point of its forward)."""
        record = self._lookup(t)
        return record is not None and record.serial < serial

    def live_since(self, serial: int) -> list[tuple[weakref.ref[torch.UntypedStorage], int]]:
        """The counted storages still alive that the tracker saw from ``serial`` on (made
        after some point of the step), each as a weak reference and its bytes."""
        with self._lock:
            return [(r.ref, r.nbytes) for r in self._records.values()
                    if r.serial >= serial and r.ref is not None and r.ref() is not None]

    @property
    def live_bytes(self) -> int:
        return self._live_total

    @property
    def peak_bytes(self) -> int:
        return self._peak_total

    @property
    def live_by_category(self) -> CategoryBytes:
        with self._lock:
            return CategoryBytes.from_counts(self._live)

    @property
    def peak_by_category(self) -> CategoryBytes:
        with self._lock:
            return CategoryBytes.from_counts(self._peak)

    @property
    def phase_peaks(self) -> PhasePeaks:
        with self._lock:
            return PhasePeaks.from_counts(self._phase_peaks)

    @property
    def timeline(self) -> tuple[Event, ...] | None:
        return tuple(self._events) if self._record_timeline else None

    @property
    def events_recorded(self) -> int:
        """How many events the timeline holds so far (a mark for :meth:`lives_since`)."""
        return len(self._events)

    def lives_since(self, mark: int) -> tuple[int, ...] | None:
        """The live total after each event recorded from ``mark`` on; None without a
        timeline or where it ran past ``max_events`` (the peak's terms are not all known)."""
        if not self._record_timeline or self._truncated:
            return None
        with self._lock:
            return tuple(e.live_bytes for e in self._events[mark:])

    def report(self) -> MemoryReport:
        with self._lock:
            return MemoryReport(
                peak_bytes=self._peak_total,
                live_bytes=self._live_total,
                start_bytes=self._start_total,
                peak_by_category=CategoryBytes.from_counts(self._peak),
                live_by_category=CategoryBytes.from_counts(self._live),
                phase_peaks=PhasePeaks.from_counts(self._phase_peaks),
                peak_phase=self._peak_phase,
                peak_module_path=self._peak_module,
                peak_event_index=self._peak_event,
                timeline=self.timeline,
                timeline_truncated=self._truncated,
                cuda_allocated_peak_bytes=self._cuda_allocated,
                cuda_reserved_peak_bytes=self._cuda_reserved,
            )

    def __enter__(self) -> LiveMemoryTracker:
        if self._exit_stack is not None:
            raise UsageError(
                "this LiveMemoryTracker is already active; leave its with-block first or "
                "use a second tracker"
            )
        stack = ExitStack()
        try:
            stack.enter_context(compiled_code_runs_eagerly())
            stack.callback(self._remove_hooks)
            for module in self._watched_modules:
                self._install(module)
            for optimizer in self._watched_optimizers:
                self._install(optimizer)
            if self._watched_modules:
                stack.enter_context(_NodeTagger(self))
            if self._track_saved:
                stack.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                )
            if self._cuda_device() is not None:
                torch.cuda.reset_peak_memory_stats(self._cuda_device())
            stack.enter_context(_DispatchCounter(self))
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack
        _ACTIVE.append(self)
        with self._lock:
            self._start_total = self._live_total
            self.reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._exit_stack = self._exit_stack, None
        assert stack is not None, "__exit__ without __enter__"
        pending, self._backward_events = self._backward_events, None
        if pending is not None:  # a compiled backward raised between its two hooks
            pending.close()
        self._window = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        stack.close()
        device = self._cuda_device()
        if device is not None:
            self._cuda_allocated = int(torch.cuda.max_memory_allocated(device))
            self._cuda_reserved = int(torch.cuda.max_memory_reserved(device))

    # ----------------------------------------------------------------- hooks

    def _install(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        if isinstance(obj, torch.optim.Optimizer):
            self._handles.append(obj.register_step_pre_hook(self._optimizer_enter))
            self._handles.append(obj.register_step_post_hook(self._optimizer_exit))
            return
        for name, module in without_compiled_insides(obj):
            self._handles.append(
                module.register_forward_pre_hook(partial(self._module_enter, name))
            )
            self._handles.append(
                module.register_forward_hook(partial(self._module_exit, name), always_call=True)
            )
        for p in obj.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._module_stack.clear()
        self._calls.clear()
        self._optimizer_depth = 0

    def _module_enter(self, name: str, module: nn.Module, args: Any) -> None:
        named = self._call_names.get(id(module))
        if named is not None:
            call = named()
            self._calls.append((name, call))
            self._module_stack.append(call)
            return
        self._module_stack.append(self._in_call(name))

    def _in_call(self, name: str) -> str:
        """``name`` as it runs: inside a call named apart, under the call's name."""
        for path, call in reversed(self._calls):
            if name.startswith(path + "."):
                return call + name[len(path):]
        return name

    def _module_exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls and self._calls[-1][0] == name and id(module) in self._call_names:
            name = self._calls.pop()[1]
        else:
            name = self._in_call(name)
        stack = self._module_stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] == name:
                del stack[i:]
                return

    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            with self._lock:
                if self._count_existing(param.grad, Category.GRADIENTS):
                    self._emit("register")

    def _optimizer_enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1

    def _optimizer_exit(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        with self._lock:
            if self._count_optimizer_state(optimizer):
                self._emit("register")

    def _pack(self, t: torch.Tensor) -> _Saved:
        with self._lock:
            record = self._lookup(t)
            if record is not None:
                self._recategorize(record, saved_delta=1)
            self._internal = True  # the detach is ours, not the program's: keep it off the timeline
            try:
                detached = t.detach()
            finally:
                self._internal = False
            return _Saved(detached, t._version, record, weakref.ref(self))

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        t = saved.tensor
        if t._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                f"{t._version}; expected version {saved.version} instead (checked by "
                "remat's LiveMemoryTracker, as autograd would without saved-tensor hooks)"
            )
        return t

    def _unsave(self, record: _Record) -> None:
        with self._lock:
            if record.ref is not None and record.ref() is not None:
                self._recategorize(record, saved_delta=-1)

    # ----------------------------------------------------------------- accounting

    def _cuda_device(self) -> torch.device | None:
        if not self._cuda_stats or not torch.cuda.is_available():
            return None
        if self._device is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self._device if self._device.type == "cuda" else None

    def _counted_bytes(self, storage: torch.UntypedStorage) -> int | None:
        device = storage.device
        if device.type == "meta":  # Note [Fake storages]
            return int(storage.nbytes()) if _COUNT_FAKE[0] else None
        wanted = self._device
        if wanted is not None and (
            device.type != wanted.type
            or (wanted.index is not None and device.index != wanted.index)
        ):
            return None
        nbytes = int(storage.nbytes())
        if device.type == "cuda" and nbytes > 0:
            # the caching allocator hands out whole 512-byte blocks; memory_allocated agrees
            nbytes = -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES
        return nbytes

    def _lookup(self, t: torch.Tensor) -> _Record | None:
        storage = _storage(t)
        if storage is None:
            return None
        record = self._records.get(id(storage))
        if record is None or record.ref is None or record.ref() is not storage:
            return None
        return record

    def _add(self, storage: torch.UntypedStorage, nbytes: int, category: Category) -> None:
        key = id(storage)
        stale = self._records.get(key)
        if stale is not None and stale.ref is not None:
            self._on_free(key, stale.ref)
        record = _Record(nbytes, category)
        record.serial = self._serial
        self._serial += 1
        tracker_ref = weakref.ref(self)

        def on_free(ref: weakref.ref[torch.UntypedStorage]) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                tracker._on_free(key, ref)

        record.ref = weakref.ref(storage, on_free)
        self._records[key] = record
        self._live[category] += nbytes
        self._live_total += nbytes
        self._epoch += 1

    def _on_free(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        with self._lock:
            record = self._records.get(key)
            if record is None or record.ref is not ref:
                return
            del self._records[key]
            self._live[record.category()] -= record.nbytes
            self._live_total -= record.nbytes
            window = self._window
            if window is not None and record.serial < window.first_serial:
                # made before the window's allocator events began: they miss its free
                window.frees.append((time.time_ns(), -record.nbytes))
            self._emit("free")

    def _resized(self, record: _Record, storage: torch.UntypedStorage) -> None:
        nbytes = self._counted_bytes(storage)
        if nbytes is None or nbytes == record.nbytes:
            return
        delta = nbytes - record.nbytes
        record.nbytes = nbytes
        self._live[record.category()] += delta
        self._live_total += delta
        if delta > 0:
            self._epoch += 1

    def _recategorize(
        self, record: _Record, base: Category | None = None, saved_delta: int = 0
    ) -> None:
        old = record.category()
        if base is not None:
            record.base = base
        record.saved += saved_delta
        new = record.category()
        if old is new:
            return
        self._live[old] -= record.nbytes
        self._live[new] += record.nbytes
        # A temporary that becomes an activation, gradient or optimizer state before the
        # live set grows again was already that at the peak (autograd saves an op's output,
        # AccumulateGrad adopts a gradient, right after the op that made it): credit the peak
        # breakdown too. Demotions (an activation released) happen after the fact and do not.
        if old is Category.TEMPORARIES and self._epoch == self._peak_epoch:
            self._peak[old] -= record.nbytes
            self._peak[new] += record.nbytes

    def _count_existing(self, t: torch.Tensor, category: Category) -> int:
        storage = _storage(t)
        if storage is None:
            return 0
        record = self._lookup(t)
        if record is not None:
            self._resized(record, storage)
            self._recategorize(record, base=category)
            return 0
        nbytes = self._counted_bytes(storage)
        if nbytes is None:
            return 0
        self._add(storage, nbytes, category)
        return nbytes

    def _count_optimizer_state(self, optimizer: torch.optim.Optimizer) -> int:
        added = 0
        for state in optimizer.state.values():
            for t in iter_tensors(state):
                added += self._count_existing(t, Category.OPTIMIZER_STATE)
        return added

    def _count_op(self, func: Any, input_keys: set[int], out: Any) -> None:
        with self._lock:
            self._adopt(out, skip=frozenset() if func in _FRESH_OPS else input_keys)
            self._emit(str(func))

    def _adopt(self, tensors: Any, skip: Collection[int] = ()) -> int:
        """Count the storages of ``tensors`` not yet counted, except those whose id is in
        ``skip`` (an op's inputs); return the bytes newly counted. Also for storages made
        where the dispatcher was not watching (a compiled call)."""
        with self._lock:
            category = (
                Category.ACTIVATIONS
                if self._current_phase() is Phase.REBUILD
                else Category.TEMPORARIES
            )
            added = 0
            for t in iter_tensors(tensors):
                storage = _storage(t)
                if storage is None:
                    continue
                record = self._records.get(id(storage))
                if record is not None and record.ref is not None and record.ref() is storage:
                    self._resized(record, storage)
                    continue
                if id(storage) in skip:
                    continue
                nbytes = self._counted_bytes(storage)
                if nbytes is not None:
                    self._add(storage, nbytes, category)
                    added += nbytes
            return added

    def _transient(self, nbytes: int, name: str) -> None:
        """Record a moment ``nbytes`` above the live set (a compiled call's own buffers,
        freed before it returned) as temporaries, on the timeline and in the peaks."""
        with self._lock:
            if nbytes > 0:
                self._live[Category.TEMPORARIES] += nbytes
                self._live_total += nbytes
                self._epoch += 1
            try:
                self._emit(name)
            finally:
                if nbytes > 0:
                    self._live[Category.TEMPORARIES] -= nbytes
                    self._live_total -= nbytes
            if nbytes > 0:
                self._emit("free")  # the call's own buffers went before it returned

    # ----------------------------------------------------------------- phases, paths, events

    def _current_phase(self) -> Phase:
        if torch._C._current_graph_task_id() != -1:
            # autograd's engine runs backward formulas with grad off; a non-reentrant
            # checkpoint replays its forward with grad on
            return Phase.REBUILD if torch.is_grad_enabled() else Phase.BACKWARD
        if self._phase_stack:
            return self._phase_stack[-1]
        if self._optimizer_depth:
            return Phase.OPTIMIZER
        return Phase.FORWARD

    def _current_module_path(self) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        current_node: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)
        if current_node is not None and torch._C._current_graph_task_id() != -1:
            node = current_node()
            if node is not None:
                return str(node.metadata.get(_MODULE_KEY, ""))
        return ""

    def _emit(self, name: str) -> None:
        index = self._event_count
        self._event_count += 1
        if self._exit_stack is None:
            return  # frees after the block still update live bytes, not the record of the block
        phase = self._current_phase()
        path = self._current_module_path()
        if self._record_timeline:
            if len(self._events) < self._max_events:
                self._events.append(Event(index, name, self._live_total, path, phase))
            else:
                self._truncated = True
        if name != "free" and self._live_total > self._phase_peaks.get(phase, -1):
            self._phase_peaks[phase] = self._live_total
        if self._live_total > self._peak_total:
            self._set_peak(phase, path, index)

    def _set_peak(self, phase: Phase | None, path: str, index: int | None) -> None:
        self._peak_total = self._live_total
        self._peak = dict(self._live)
        self._peak_epoch = self._epoch
        self._peak_phase = phase
        self._peak_module = path
        self._peak_event = index
