"""The value check: every op a rebuild runs is compared with what the same op gave in forward.

torch's own determinism check compares only the shapes, dtypes and devices of the
tensors a rebuild saves. This one fingerprints the output of every aten op a stage runs
in forward (op name, shapes, dtypes, three checksums) and, when backward rebuilds
the stage, compares the rebuilt ops one by one with that record. The first difference
says which stage and which op: another op name means the code took another path
(data-dependent control flow), the same op with other values means the rebuild read
other inputs or drew other random numbers.

A debug mode, not for training: every op output of the observed stages is reduced to a
checksum. Use it directly on a model with an applied plan::

    handle = remat.apply(model, plan)
    with ValueCheck(handle) as check:
        loss_fn(model, batch).backward()
    print(check.result().first)

Not compared: ``aten.detach`` (torch's checkpoint detaches saved tensors during a
rebuild only); in a selective stage, the ops its policy saves (torch's selective
checkpoint hands their cached outputs back without running them, so a rebuild may skip
them); the values of ops that update one of the stage's buffers in place (the runtime
undoes those updates after the rebuild, so only what the stage computes from the buffer
matters, and that is compared); the values of ``empty``-like ops. With early stop a
rebuild ends as soon as backward has what it needs, so a rebuilt sequence may be a
prefix of the forward one. A difference in an output that nothing but its own op's
backward reads (a kernel's workspace) is skipped and counted, not reported (Note [What
backward reads]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _python_dispatch

from remat.core.plan_format import Plan, Region
from remat.measure.modes import EagerDispatchMode
from remat.measure.tracker import iter_tensors
from remat.runtime.install import Handle, observe
from remat.runtime.policies import ROUTING_OPS
from remat.runtime.stage_calls import stage_submodule
from remat.verification.tolerance import TolerancePolicy, parse_tolerance
from remat.verification.verify_report import OpMismatch, ValueCheckResult

__all__ = [
    "ROUTING",
    "Fingerprint",
    "OpRecorder",
    "ValueCheck",
    "checksum",
    "compare_call",
    "outside_dispatch_modes",
    "rebuilt_stages",
    "routing_flip",
    "unread_differences",
]

Checksum = tuple[float, float, float]

_PERIOD = 1021  # a prime: position weights repeat with this period
_WEIGHTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_IGNORED = frozenset({"aten.detach.default", "prim.device.default"})
# Ops whose outputs hold whatever memory they got: compare their shapes, not their values.
_UNINITIALIZED = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "resize_",
})


def outside_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """Run bookkeeping ops past every active dispatch mode (ours and torch's selective ones).

    The one private torch function remat.verify calls; selective checkpoint's caching modes
    must not see our checksums, or they would cache or replay them.
    """
    return _python_dispatch._disable_current_modes()


def _position_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    weights = _WEIGHTS.get((device, dtype))
    if weights is None:
        # A private generator: the fingerprints must not move the RNG the model draws from.
        gen = torch.Generator().manual_seed(0x5EED)
        weights = 2 * torch.rand(_PERIOD, generator=gen, dtype=torch.float64) - 1
        weights = weights.to(device=device, dtype=dtype)
        _WEIGHTS[(device, dtype)] = weights
    return weights


def checksum(tensor: torch.Tensor) -> Checksum | None:
    """(sum, sum of squares, weighted sum); None for tensors without strided storage.

    Equal tensors give equal triples (the same reductions on the same values). The
    weights are fixed pseudo-random numbers in [-1, 1) by position, so the weighted sum
    tells apart tensors with the same values in other places (two dropout masks that
    keep as many elements), and a change in a fraction f of the elements moves it by
    about ``sqrt(f)`` times the tensor's norm whatever its size. float32 and float64 are
    reduced in their own precision (sums accumulate in float64), other types in float64.
    """
    x = tensor.detach()
    if x.layout != torch.strided or x.device.type == "meta" or type(x) is not torch.Tensor:
        return None
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float64)
    x = x.reshape(-1)
    n, weights = x.numel(), _position_weights(x.device, x.dtype)
    whole = n - n % _PERIOD
    weighted = (x[whole:] * weights[: n - whole]).sum(dtype=torch.float64)
    if whole:
        weighted = weighted + torch.mv(x[:whole].view(-1, _PERIOD), weights).sum(
            dtype=torch.float64
        )
    stats = torch.stack((x.sum(dtype=torch.float64), torch.dot(x, x).double(), weighted))
    total, squares, weighted_sum = stats.tolist()
    return (total, squares, weighted_sum)


@dataclass(frozen=True)
class Fingerprint:
    """One op's outputs as seen by the value check."""

    op: str  # e.g. "aten.mm.default"
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    sums: tuple[Checksum | None, ...]
    explicit_generator: bool = False  # called with a generator= other than torch's default
    # per output, whether a later op of the stage call reads it or the stage returns it
    # (None: not known, all are read); Note [What backward reads]
    read: tuple[bool, ...] | None = None

    def is_read(self, output: int) -> bool:
        return self.read is None or self.read[output]


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested or opaque tensors have no single storage


def _fingerprint(
    op: str, out: Any, explicit_generator: bool, buffers: frozenset[int]
) -> Fingerprint:
    if isinstance(out, (bool, int, float)):  # e.g. aten._local_scalar_dense from .item()
        value = float(out)
        return Fingerprint(op, ((),), (torch.float64,), ((value, value * value, value),),
                           explicit_generator)
    tensors = list(iter_tensors(out))
    uninitialized = op.split(".")[1 if "." in op else 0] in _UNINITIALIZED
    return Fingerprint(
        op,
        tuple(tuple(t.shape) for t in tensors),
        tuple(t.dtype for t in tensors),
        tuple(
            None if uninitialized or _storage(t) in buffers else checksum(t) for t in tensors
        ),
        explicit_generator,
    )


def _is_default_generator(gen: torch.Generator) -> bool:
    """Whether ``gen`` is the device's default generator (the one torch's checkpoint restores).

    The dispatcher hands over a new Python object for it, so compare the state.
    """
    device = gen.device
    if device.type == "cpu":
        default = torch.default_generator
    elif device.type == "cuda":
        default = torch.cuda.default_generators[device.index or 0]
    else:
        return False
    return bool(torch.equal(gen.get_state(), default.get_state()))


# Note [What backward reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rebuild exists to hand backward the tensors it reads, and the value check compares
# what backward can read. An op's output reaches backward in two ways: a later op reads it
# (its values flow into the stage's output and into what later ops save, and gradients
# flow back through it), or the backward node of the op that made it saved it. An output
# that only the second way reaches (no later op of the stage call reads it, the stage does
# not return it, and it is fresh memory, not an input written in place or viewed) is its
# op's private state for its own backward: a kernel's workspace, a normalization's
# statistics, a dropout mask; or nothing reads it at all (no gradient reaches an op none
# of whose outputs is read, so its backward never runs). What such an output says about
# the result shows in the outputs of the same op that are read, and those are compared:
# the same inputs and random numbers give equal read outputs, other ones give other read
# outputs. A workspace's bytes, though, need not be a function of the inputs: oneDNN's
# LSTM (aten.mkldnn_rnn_layer, output 3, a byte buffer) leaves scratch parts holding
# whatever memory it got, so forward and rebuild differ there while backward computes
# equal gradients from either. So a difference in an output no later op reads is skipped
# and counted (ValueCheckResult.outputs_skipped), never a mismatch.
#
# Whether autograd saved an output cannot tell the two apart: the LSTM's backward node
# saves its workspace as it saves its values, and torch's checkpoint owns the
# saved-tensor hooks during the forward and the rebuild, so no hook of ours sees them.
# Reads are found by storage: the recorder holds each fresh output of a stage's forward
# call until the call ends, so no later tensor takes its address (a freed workspace's
# address handed to a later tensor that is read would make the workspace look read).
# Reads by code outside the call through a side channel (a tensor kept on a module and
# read by a later stage) are not seen: such an output counts as unread.


class _Reads:
    """Which outputs of one forward stage call a later op reads (Note [What backward reads])."""

    def __init__(self, target: list[Fingerprint]) -> None:
        self.target = target
        self.read: list[list[bool]] = []  # per recorded op, per output
        self._where: dict[int, list[tuple[int, int]]] = {}  # storage -> (op, output), unread
        self._held: list[torch.Tensor] = []  # keeps the unread storages' addresses theirs

    def add(self, tensors: Sequence[torch.Tensor | None], inputs: set[int]) -> None:
        op, flags = len(self.read), []
        for j, t in enumerate(tensors):
            address = None if t is None else _storage(t)
            fresh = bool(address) and address not in inputs
            flags.append(not fresh)
            if fresh and t is not None and address is not None:
                self._where.setdefault(address, []).append((op, j))
                self._held.append(t)
        self.read.append(flags)

    def mark(self, addresses: Iterable[int]) -> None:
        for address in addresses:
            for op, j in self._where.pop(address, ()):
                self.read[op][j] = True

    def close(self, output: Any) -> list[Fingerprint]:
        """The call's fingerprints with their outputs' read flags; ``output`` is read."""
        self.mark(_addresses(output))
        self._held.clear()
        return [
            dataclasses.replace(f, read=tuple(flags))
            for f, flags in zip(self.target, self.read, strict=True)
        ]


def _addresses(obj: Any) -> set[int]:
    return {a for t in iter_tensors(obj) if (a := _storage(t)) is not None}


class OpRecorder(EagerDispatchMode):
    """Appends a :class:`Fingerprint` of each op's outputs to ``target`` while it is set.

    Outputs stored in one of ``buffers`` (storage addresses) keep no checksum. Between
    :meth:`open_reads` and :meth:`close_reads` it also notes which outputs of the ops
    recorded into that target a later op reads (Note [What backward reads]).
    """

    def __init__(self) -> None:
        super().__init__()
        self.target: list[Fingerprint] | None = None
        self.buffers: frozenset[int] = frozenset()
        self._reads: list[_Reads] = []  # open forward calls, outermost first

    def open_reads(self, target: list[Fingerprint]) -> None:
        self._reads.append(_Reads(target))

    def close_reads(self, output: Any) -> list[Fingerprint]:
        """The innermost open call's fingerprints, each with its outputs' read flags."""
        return self._reads.pop().close(output)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        target = self.target
        if target is None and not self._reads:
            return func(*args, **kwargs)
        inputs: set[int] = set()
        if self._reads:
            inputs = _addresses((args, kwargs))
            for reads in self._reads:
                reads.mark(inputs)
        if target is None:
            return func(*args, **kwargs)
        gen = kwargs.get("generator")
        explicit = isinstance(gen, torch.Generator) and not _is_default_generator(gen)
        out = func(*args, **kwargs)
        name = str(func)
        if name not in _IGNORED:
            target.append(_fingerprint(name, out, explicit, self.buffers))
            if self._reads and self._reads[-1].target is target:
                tensors = [None] if isinstance(out, (bool, int, float)) else list(
                    iter_tensors(out))
                self._reads[-1].add(tensors, inputs | self.buffers)
        return out


def rebuilt_stages(plan: Plan) -> dict[int, Region | None]:
    """Stages whose code runs again in backward -> their innermost region.

    Stages inside regions are rebuilt, and selective stages outside regions are partly
    rebuilt by torch's selective checkpoint (region None).
    """
    stages: dict[int, Region | None] = {}
    for region in plan.regions:  # parents before children: the last one seen is innermost
        for i in range(region.start, region.stop):
            stages[i] = region
    for i, option in enumerate(plan.parsed_options):
        if option.is_selective:
            stages.setdefault(i, None)
    return stages


def _values_differ(forward: Checksum, rebuilt: Checksum, rtol: float) -> tuple[bool, float, float]:
    """Whether two checksums differ beyond ``rtol``; the largest absolute and relative error.

    Sums are relative to the norm ``sqrt(sum of squares)`` (noise of size ``eps * |x|``
    moves them by about ``eps`` times the norm), the sum of squares relative to itself.
    """
    norm = math.sqrt(max(forward[1], rebuilt[1]))
    scales = (norm, norm**2, norm)
    abs_err = rel_err = 0.0
    for a, b, scale in zip(forward, rebuilt, scales, strict=True):
        if a == b or (math.isnan(a) and math.isnan(b)):
            continue
        diff = abs(a - b)
        diff = math.inf if math.isnan(diff) else diff
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / scale if 0 < scale < math.inf else math.inf)
    return rel_err > rtol, abs_err, rel_err


@dataclass(frozen=True)
class _Difference:
    kind: str
    op_index: int
    forward_op: str | None
    rebuilt_op: str
    output_index: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None


def _aligned(
    forward: Sequence[Fingerprint],
    rebuilt: Sequence[Fingerprint],
    skippable: frozenset[str],
) -> Iterator[tuple[int, Fingerprint | None, Fingerprint]]:
    """``(p, f, r)``: each rebuilt op ``r`` with the forward op ``f`` at position ``p`` it
    lines up with (forward ops named in ``skippable`` may be missing from the rebuild).
    Where the sequences part, one last triple whose ``f`` is the forward op there (None
    past the forward's end) and runs another op than ``r``."""
    p = 0
    for r in rebuilt:
        while p < len(forward) and forward[p].op != r.op and forward[p].op in skippable:
            p += 1
        f = forward[p] if p < len(forward) else None
        yield p, f, r
        if f is None or f.op != r.op:
            return
        p += 1


def compare_call(
    forward: Sequence[Fingerprint],
    rebuilt: Sequence[Fingerprint],
    tolerance: TolerancePolicy,
    skippable: frozenset[str] = frozenset(),
) -> tuple[_Difference | None, _Difference | None]:
    """The first difference of a rebuilt op sequence from the forward one, and the first
    difference in the sequence itself (another op, shape or dtype), or None for each.

    The scan goes on past a value difference to find where the path splits (a branch on
    a value the rebuild computed differently). Forward ops named in ``skippable`` may be
    missing from the rebuild (a selective stage's saved ops); a rebuild that stops early
    is a prefix and matches. An output that no later op read in forward is not compared
    (:func:`unread_differences` counts those that differ; Note [What backward reads]).
    """
    first: _Difference | None = None
    for p, f, r in _aligned(forward, rebuilt, skippable):
        if f is None or f.op != r.op:
            path = _Difference("op", p, None if f is None else f.op, r.op)
            return first or path, path
        if f.shapes != r.shapes or f.dtypes != r.dtypes:
            path = _Difference("metadata", p, f.op, r.op)
            return first or path, path
        for j, (a, b) in enumerate(zip(f.sums, r.sums, strict=True)):
            if first is not None or a is None or b is None or not f.is_read(j):
                continue
            differ, abs_err, rel_err = _values_differ(a, b, tolerance.rebuild_rtol(f.dtypes[j]))
            if differ:
                first = _Difference("value", p, f.op, r.op, j, abs_err, rel_err)
    return first, None


def unread_differences(
    forward: Sequence[Fingerprint],
    rebuilt: Sequence[Fingerprint],
    tolerance: TolerancePolicy,
    skippable: frozenset[str] = frozenset(),
) -> list[tuple[int, str, int]]:
    """``(position, op, output)`` of each output that differs from the forward's beyond the
    tolerance and that no later op read in forward (so :func:`compare_call` skipped it;
    Note [What backward reads]), on the part where the two sequences run the same ops."""
    found = []
    for p, f, r in _aligned(forward, rebuilt, skippable):
        if f is None or f.op != r.op or f.shapes != r.shapes or f.dtypes != r.dtypes:
            break
        for j, (a, b) in enumerate(zip(f.sums, r.sums, strict=True)):
            if a is None or b is None or f.is_read(j):
                continue
            if _values_differ(a, b, tolerance.rebuild_rtol(f.dtypes[j]))[0]:
                found.append((p, f.op, j))
    return found


#: Ops whose integer outputs are routing decisions (the experts a router chose).
ROUTING = frozenset(str(op) for op in ROUTING_OPS)


def routing_flip(
    forward: Sequence[Fingerprint],
    rebuilt: Sequence[Fingerprint],
    skippable: frozenset[str] = frozenset(),
) -> _Difference | None:
    """The first routing op (:data:`ROUTING`) whose chosen indices differ in the rebuild,
    on the part where the two sequences still run the same ops; None if none does. A
    difference anywhere in the indices counts (a near-tie flipped by a difference in the
    logits within any tolerance picks another expert)."""
    for p, f, r in _aligned(forward, rebuilt, skippable):
        if f is None or f.op != r.op:
            return None
        if f.op in ROUTING and f.shapes == r.shapes and f.dtypes == r.dtypes:
            for j, (a, b, dtype) in enumerate(zip(f.sums, r.sums, f.dtypes, strict=True)):
                if not dtype.is_floating_point and a is not None and b is not None and a != b:
                    return _Difference("routing", p, f.op, r.op, j)
    return None


class ValueCheck:
    """Compares every rebuilt op of a model with an applied plan against its forward record.

    As a context manager it observes the model's stages and records ops (see the module
    docstring); ``remat.verify`` instead drives it as one of several observers, entering
    :meth:`recording` itself.
    """

    def __init__(self, handle: Handle, *, tolerance: object = "auto") -> None:
        self._handle = handle
        plan = handle.plan
        self._names = plan.stages
        self._rebuilt = rebuilt_stages(plan)
        self._skippable = handle.rebuilt_without_running()
        self._tolerance = parse_tolerance(tolerance)
        self._stage_modules = {i: stage_submodule(handle.model, plan.stages[i])
                               for i in self._rebuilt}
        self.recorder = OpRecorder()
        self.forward: dict[int, list[Fingerprint]] = {}  # stage -> its last forward's ops
        self._stack: list[tuple[int, bool, list[Fingerprint] | None]] = []
        self._first: dict[int, OpMismatch] = {}  # stage -> its first mismatch
        self._path: dict[int, OpMismatch] = {}  # stage -> where its op sequence split
        self._routing: dict[int, OpMismatch] = {}  # stage -> its first routing flip
        self._rebuilt_calls = 0
        self._ops_compared = 0
        self._unread: dict[str, int] = {}  # "op output j" -> differing outputs skipped
        self._exits: contextlib.ExitStack | None = None

    # -- as a debug mode ------------------------------------------------------------------

    def __enter__(self) -> ValueCheck:
        with contextlib.ExitStack() as stack:
            stack.enter_context(observe(self._handle.model, self))
            stack.enter_context(self.recording())
            self._exits = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        exits, self._exits = self._exits, None
        if exits is not None:
            exits.close()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The dispatch mode that sees the ops; keep it active over forward and backward."""
        with self.recorder:
            yield

    # -- the StageObserver protocol -------------------------------------------------------

    def stage_started(
        self, stage: int, rebuild: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        calls: list[Fingerprint] | None = [] if stage in self._rebuilt else None
        self._stack.append((stage, rebuild, calls))
        if calls is not None:
            self.recorder.buffers = frozenset(
                p for b in self._stage_modules[stage].buffers() if (p := _storage(b)) is not None
            )
        self.recorder.target = calls
        if calls is not None and not rebuild:
            self.recorder.open_reads(calls)

    def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None:
        started, _, calls = self._stack.pop()
        assert started == stage, (started, stage)
        self.recorder.target = self._stack[-1][2] if self._stack else None
        if calls is None:
            return
        if not rebuild:
            self.forward[stage] = self.recorder.close_reads(output)
            return
        forward = self.forward.get(stage)
        if forward is None:  # the check started after this stage's forward
            return
        self._rebuilt_calls += 1
        self._ops_compared += len(calls)
        skippable = self._skippable.get(stage, frozenset())
        first, path = compare_call(forward, calls, self._tolerance, skippable)
        flip = routing_flip(forward, calls, skippable)
        for _, op, j in unread_differences(forward, calls, self._tolerance, skippable):
            key = f"{op} output {j}"
            self._unread[key] = self._unread.get(key, 0) + 1
        for store, diff in ((self._first, first), (self._path, path), (self._routing, flip)):
            if diff is not None and stage not in store:
                store[stage] = self._mismatch(stage, diff)

    def _mismatch(self, stage: int, diff: _Difference) -> OpMismatch:
        region = self._rebuilt.get(stage)
        return OpMismatch(
            stage=self._names[stage],
            stage_index=stage,
            region=None if region is None else str(region),
            kind=diff.kind,
            op_index=diff.op_index,
            forward_op=diff.forward_op,
            rebuilt_op=diff.rebuilt_op,
            output_index=diff.output_index,
            max_abs_error=diff.max_abs_error,
            max_rel_error=diff.max_rel_error,
        )

    # -- the result -----------------------------------------------------------------------

    def result(self) -> ValueCheckResult:
        return ValueCheckResult(
            rebuilt_calls=self._rebuilt_calls,
            ops_compared=self._ops_compared,
            mismatches=tuple(self._first[i] for i in sorted(self._first)),
            control_flow=tuple(self._path[i] for i in sorted(self._path)),
            routing=tuple(self._routing[i] for i in sorted(self._routing)),
            outputs_skipped=sum(self._unread.values()),
            skipped_outputs=tuple(sorted(self._unread)),
        )
