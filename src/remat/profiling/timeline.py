"""Cutting the tracker's timeline of a whole training step into chain pieces.

``measure_step(..., timeline=True)`` records every op, free and registration with the
live bytes after it, its phase and the module that ran it (in backward: the module whose
forward made the autograd node). A stage's forward is the run of forward events inside its
module; its backward the run of backward events tagged with it. What lies before the first
stage is the pre-chain (embeddings), what follows the last one the post-chain (head, loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.core.errors import RematError, UsageError
from remat.core.maxima import largest, maximum_of
from remat.measure import Event, Phase, StepMemory

__all__ = ["Span", "StageNotRun", "StepSpans", "rebuild_starts", "split_step"]


@dataclass(frozen=True)
class Span:
    """A run of consecutive events: live bytes before it, at its highest, and after it."""

    entry_bytes: int
    peak_bytes: int
    exit_bytes: int

    @property
    def rise_bytes(self) -> int:
        """How far the span rose above what was live when it began."""
        return largest(0, self.peak_bytes - self.entry_bytes)


@dataclass(frozen=True)
class StepSpans:
    start_bytes: int
    pre_forward: Span
    stage_forward: tuple[Span, ...]
    post_forward: Span
    post_backward: Span
    stage_backward: tuple[Span, ...]
    pre_backward: Span
    optimizer: Span
    # modules that ran ops in the pre- and post-chain forward
    pre_modules: frozenset[str]
    post_modules: frozenset[str]
    stage_ops: tuple[frozenset[str], ...]  # aten ops each stage's forward ran
    # Per stage: the backward of the model's code before it, the events between its
    # backward and the previous stage's (an empty span for the first stage)
    link_backward: tuple[Span, ...] = ()


class StageNotRun(UsageError):
    """A stage ran no op in a phase of the measured step (``stage``: its path); the
    profiler says why where it can (frozen parameters)."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


def _inside(path: str, stage: str) -> bool:
    return path == stage or path.startswith(stage + ".")


def _span(events: Sequence[Event], start: int, stop: int, before: int,
          terms: bool = False) -> Span:
    """Events ``start..stop-1``; ``before`` is the live total when ``start`` began. With
    ``terms``, the peak keeps every live total while a range is profiled
    (remat.core.maxima)."""
    if stop <= start:
        return Span(before, before, before)
    lives = [e.live_bytes for e in events[start:stop]]
    return Span(before, maximum_of((before, *lives)) if terms else max(before, *lives),
                lives[-1])


class _Timeline:
    """A step's events with the chain's stages: where each stage ran, and the spans, ops
    and modules of a run of events."""

    def __init__(self, events: Sequence[Event], start_bytes: int, stages: Sequence[str]
                 ) -> None:
        self.events = events
        self.start_bytes = start_bytes
        self.stages = stages
        self.owner: dict[str, int] = {}

    def live_before(self, k: int) -> int:
        return self.events[k - 1].live_bytes if k > 0 else self.start_bytes

    def stage_of(self, path: str) -> int:
        owner = self.owner
        if path not in owner:
            owner[path] = next((i for i, s in enumerate(self.stages) if _inside(path, s)), -1)
        return owner[path]

    def windows(self, lo: int, hi: int, phase: Phase) -> list[tuple[int, int]]:
        events, stages = self.events, self.stages
        # A selective stage's replay runs in its backward (phase REBUILD, same module).
        phases = (phase, Phase.REBUILD) if phase is Phase.BACKWARD else (phase,)
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k in range(lo, hi):
            if events[k].phase in phases:
                i = self.stage_of(events[k].module_path)
                if i >= 0:
                    first.setdefault(i, k)
                    last[i] = k + 1
        for i, name in enumerate(stages):
            if i not in first:
                raise StageNotRun(
                    f"stage {name!r} ran no {phase.value} op in the measured step; "
                    "list only stages the forward runs with grad", name
                )
        return [(first[i], last[i]) for i in range(len(stages))]

    def span(self, start: int, stop: int, terms: bool = False) -> Span:
        """Events ``start..stop-1``, from the live total when ``start`` began."""
        return _span(self.events, start, stop, self.live_before(start), terms)

    def spans(self, win: list[tuple[int, int]], terms: bool = False) -> tuple[Span, ...]:
        return tuple(self.span(a, b, terms) for a, b in win)

    def ops(self, lo: int, hi: int) -> frozenset[str]:
        return frozenset(e.name for e in self.events[lo:hi]
                         if e.name not in ("free", "register"))

    def modules(self, lo: int, hi: int) -> frozenset[str]:
        events = self.events
        return frozenset(events[k].module_path for k in range(lo, hi) if events[k].name != "free")


def split_step(step: StepMemory, stages: Sequence[str]) -> StepSpans:
    """Cut a measured step (with timeline) into pre-chain, stages, post-chain and optimizer."""
    events = step.timeline
    if events is None:
        raise RematError("internal error: the step was measured without a timeline")
    t = _Timeline(events, step.start_bytes, stages)
    n_events = len(events)
    bwd_start = next((k for k, e in enumerate(events) if e.phase is Phase.BACKWARD), n_events)
    opt_start = next((k for k, e in enumerate(events) if e.phase is Phase.OPTIMIZER), n_events)
    fwd = t.windows(0, bwd_start, Phase.FORWARD)
    bwd = t.windows(bwd_start, opt_start, Phase.BACKWARD)
    first_fwd, last_fwd = fwd[0][0], fwd[-1][1]
    first_bwd, last_bwd = bwd[-1][0], bwd[0][1]
    return StepSpans(
        start_bytes=step.start_bytes,
        pre_forward=_span(events, 0, first_fwd, step.start_bytes),
        stage_forward=t.spans(fwd),
        # the post-chain's peaks are maxima over the head's and the loss's ops (the
        # logits' several copies at short sequences, another op's at long ones)
        post_forward=t.span(last_fwd, bwd_start, terms=True),
        post_backward=t.span(bwd_start, first_bwd, terms=True),
        stage_backward=t.spans(bwd, terms=True),  # transients: maxima over the ops
        pre_backward=t.span(last_bwd, opt_start),
        optimizer=t.span(opt_start, n_events),
        pre_modules=t.modules(0, first_fwd),
        post_modules=t.modules(last_fwd, bwd_start),
        stage_ops=tuple(t.ops(a, b) for a, b in fwd),
        link_backward=tuple(
            t.span(bwd[i][1], bwd[i - 1][0]) if i else Span(0, 0, 0)
            for i in range(len(stages))
        ),
    )


def rebuild_starts(step: StepMemory, stages: Sequence[str]) -> tuple[int, ...]:
    """Per stage, in a step with one region per stage: what its backward had made when its
    rebuild began, beyond what was alive when its backward began (at least 0).

    A stage's backward begins at its first backward or rebuild op (the gradient of its
    output is alive then, and all the previous stage's backward let go of is gone); its
    rebuild at its first rebuild op. The ops between are the backward's nodes that need
    no saved tensor: under autocast, the cast of the incoming gradient to the branch's
    dtype at a mixed-dtype residual add (Note [What a rebuild starts with] in
    ``remat.core.solve.simulator``). A stage whose rebuild ran no op (nothing to rebuild)
    gets 0.
    """
    events = step.timeline
    if events is None:
        raise RematError("internal error: the step was measured without a timeline")
    bwd_start = next((k for k, e in enumerate(events) if e.phase is Phase.BACKWARD),
                     len(events))
    first: dict[int, int] = {}
    rebuild: dict[int, int] = {}
    for k in range(bwd_start, len(events)):
        e = events[k]
        if e.phase not in (Phase.BACKWARD, Phase.REBUILD):
            continue
        i = next((j for j, s in enumerate(stages) if _inside(e.module_path, s)), -1)
        if i < 0:
            continue
        first.setdefault(i, k)
        if e.phase is Phase.REBUILD:
            rebuild.setdefault(i, k)

    def live_before(k: int) -> int:
        return events[k - 1].live_bytes if k > 0 else step.start_bytes

    return tuple(
        max(0, live_before(rebuild[i]) - live_before(first[i])) if i in rebuild else 0
        for i in range(len(stages))
    )
