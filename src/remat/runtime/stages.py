"""Finding the chain of stages in a model: the repeated blocks its forward runs, in call order.

With an example batch, :func:`discover_stages` runs one training forward with hooks on
every module and picks, over the whole model, the sequence of block-like modules that
holds most of the activation memory (docs/stages.md gives the rules and their reasons):

1. A *candidate container* is an ``nn.ModuleList`` or ``nn.Sequential`` whose children
   all share one class (or one block family: class names with a common suffix containing
   ``Block``, as diffusers' ``DownBlock2D`` and ``AttnDownBlock2D``); the forward must call
   at least two of them, and none more than once. Its called children are *blocks*.
2. Every block is a stage, unless the blocks nested inside the blocks of its container
   (of candidate containers within them) hold at least :data:`SPLIT_SHARE` of their
   activation memory: then each block of the container is replaced by its inner blocks
   plus its other called children that save memory (a ConvNeXt stage becomes its
   downsample layer and its blocks). The decision is one per container, so a chain
   keeps one level. Containers on different
   branches of the module tree all contribute, so ResNet's ``layer1..layer4`` give one
   chain of eight blocks and an encoder-decoder its encoder then its decoder blocks.
3. A module the parent of such a container calls once between two of its blocks that
   are stages, and that saves memory, is a stage too (diffusers' mid-block attention
   between its two resnets): inside a region it would be glue, replayed call by call.
4. The stages are ordered by their call; stages whose calls overlap are dropped
   (the one holding less memory goes).
5. In a container of several classes (outside blocks), two or more children in a row,
   in call order, of one class, block family or module tree are a *run*, and a run's
   children are blocks as a container's are (MobileNetV2's inverted residuals between
   its stem and head; EfficientNet's stages, split into their blocks by 2). A block
   that is a container itself is looked into as that container.
6. Only where 1 to 5 find no two stages: the leaf layers of containers of layers
   (VGG's ``features``) with parameters or saved bytes, in-place activations left as glue.

``Chain.rejected`` says, one line each, which candidates gave no stage and why.

Activation memory is what autograd saves during the forward (distinct storages,
parameters and the batch excluded), credited to the innermost module running when it
is saved. Without a batch there is nothing to measure: the children of the largest
same-class container are the stages.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.stage_names import call_name, split_stage_name
from remat.measure.modes import without_compiled_insides
from remat.measure.tracker import storage_key

__all__ = [
    "REJECTED_LINES",
    "SPLIT_SHARE",
    "Chain",
    "discover_chain",
    "discover_stages",
    "last_chain",
    "resolve_stages",
    "unknown_path_message",
]

#: A block is split into the blocks nested in it when they hold at least this share of it.
SPLIT_SHARE = 0.75


@dataclass(frozen=True)
class Chain:
    """The stages discovery chose, with what the forward it ran saved.

    ``stage_bytes[i]`` is what autograd saved while stage i ran (its inner modules
    included); ``total_bytes`` what the whole forward saved; both count each storage once,
    parameters and the batch excluded.
    """

    stages: tuple[str, ...]
    stage_bytes: tuple[int, ...]
    total_bytes: int
    #: one line per candidate container or run that gave no stage, and why (``remat profile``)
    rejected: tuple[str, ...] = ()

    @property
    def share(self) -> float:
        """The share of the forward's saved bytes that the stages saved (1.0 if none)."""
        return sum(self.stage_bytes) / self.total_bytes if self.total_bytes else 1.0


def _common_suffix(names: list[str]) -> str:
    suffix = names[0]
    for name in names[1:]:
        while not name.endswith(suffix):
            suffix = suffix[1:]
    return suffix


def _one_family(children: list[nn.Module]) -> bool:
    """One class, or classes of one block family: names ending alike in ``...Block...``.

    diffusers mixes ``DownBlock2D`` and ``AttnDownBlock2D`` in one ``down_blocks``.
    """
    classes = {type(child) for child in children}
    return len(classes) == 1 or "Block" in _common_suffix([c.__name__ for c in classes])


def _same_class_containers(
    model: nn.Module, *, families: bool = False
) -> list[tuple[str, list[str]]]:
    """Containers of two or more modules of one class (or ``families``), with child paths."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        kids = [child for _, child in children]
        if not (_one_family(kids) if families else len({type(k) for k in kids}) == 1):
            continue
        prefix = f"{path}." if path else ""
        found.append((path, [prefix + name for name, _ in children]))
    return found


@dataclass
class _Trace:
    """What one forward did, per module path."""

    calls: dict[str, int]
    start: dict[str, int]  # event index of the first call's start
    end: dict[str, int]  # event index of the first call's end
    own_bytes: dict[str, int]  # saved while the module was the innermost one running
    total_bytes: int
    # per module, each call's (start event, end event, bytes saved while it ran)
    call_spans: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):  # a dict, or transformers' BatchEncoding
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Restore the RNG, the buffers (BatchNorm statistics) and the training flag afterwards."""
    was_training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted(
        {b.device.index or 0 for b in (*model.parameters(), *model.buffers()) if b.is_cuda}
    )
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        model.train(was_training)


def _trace(model: nn.Module, batch: Any, run: Callable[[], Any]) -> _Trace:
    """Run ``run()`` once with grad and hooks on every module of ``model``."""
    calls: dict[str, int] = {}
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    own: dict[str, int] = {}
    stack: list[str] = []
    events = [0]
    excluded = {storage_key(p) for p in model.parameters()}
    excluded |= {storage_key(t) for t in _tensors(batch)}
    seen: set[tuple[str, int]] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in excluded and key not in seen:
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            total[0] += nbytes
            if stack:
                own[stack[-1]] = own.get(stack[-1], 0) + nbytes
        return t

    handles = []
    spans: dict[str, list[tuple[int, int, int]]] = {}
    began: dict[str, list[tuple[int, int]]] = {}  # calls running: (start event, bytes then)
    for path, module in without_compiled_insides(model):

        def pre(_m: nn.Module, _args: Any, path: str = path) -> None:
            calls[path] = calls.get(path, 0) + 1
            start.setdefault(path, events[0])
            began.setdefault(path, []).append((events[0], total[0]))
            events[0] += 1
            stack.append(path)

        def post(_m: nn.Module, _args: Any, _out: Any, path: str = path) -> None:
            if stack and stack[-1] == path:
                stack.pop()
            end.setdefault(path, events[0])
            if began.get(path):
                at, before = began[path].pop()
                spans.setdefault(path, []).append((at, events[0], total[0] - before))
            events[0] += 1

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return _Trace(calls, start, end, own, total[0], spans)


def _subtree_bytes(model: nn.Module, own: dict[str, int]) -> dict[str, int]:
    """Bytes saved in each module's subtree (its own plus its descendants')."""
    sub: dict[str, int] = {}
    for path, _ in reversed(list(model.named_modules())):
        sub[path] = own.get(path, 0)
    for path in sorted(sub, key=lambda p: -p.count(".") if p else 1):
        if path:
            parent = path.rpartition(".")[0]
            sub[parent] = sub.get(parent, 0) + sub[path]
    return sub


def _shape(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """The module tree below ``module``: each descendant's relative path and class name."""
    return tuple((name, type(m).__name__) for name, m in module.named_modules() if name)


def _same_kind(a: nn.Module, b: nn.Module) -> bool:
    """One class, one block family, or one module tree below them (rule 7)."""
    if _one_family([a, b]):
        return True
    shape = _shape(a)
    return bool(shape) and shape == _shape(b)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


@dataclass
class _Candidates:
    """The containers of a traced forward, sorted by the rules of docs/stages.md."""

    blocks: dict[str, list[str]]  # one-class container -> its blocks (rules 1, 2)
    segments: dict[str, list[list[str]]]  # mixed container -> runs and singles (rule 7)
    flat: dict[str, list[str]]  # container of leaf layers -> its layers as blocks (rule 8)
    rejected: dict[str, str]  # container -> why it contributes nothing


def _candidates(model: nn.Module, trace: _Trace, sub: dict[str, int]) -> _Candidates:
    found = _Candidates({}, {}, {}, {})
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kids = _children(path, module)
        if len(kids) < 2:
            continue
        called = sorted((c for c, _ in kids if trace.calls.get(c, 0)),
                        key=trace.start.__getitem__)
        twice = next((c for c in called if trace.calls[c] > 1), None)
        if twice is not None:
            found.rejected[path] = (f"its child {twice} runs {trace.calls[twice]} times (a "
                                    "block must run once per step)")
            continue
        if _one_family([m for _, m in kids]):
            if len(called) >= 2:
                found.blocks[path] = [c for c, _ in kids if c in set(called)]
            elif called:
                kind = type(kids[0][1]).__name__
                found.rejected[path] = (f"the forward calls one of its {_plural(len(kids), kind)}"
                                        " (a chain needs two)")
            continue
        if not called:
            continue
        segments: list[list[str]] = []
        for c in called:
            if segments and _same_kind(model.get_submodule(segments[-1][0]),
                                       model.get_submodule(c)):
                segments[-1].append(c)
            else:
                segments.append([c])
        if any(_is_run(s, sub) for s in segments):
            found.segments[path] = segments
            continue
        leaves = [model.get_submodule(c) for c in called]
        if all(not list(m.children()) for m in leaves):
            counts: dict[type, list[str]] = {}  # the layers with weights, by class
            for c, m in zip(called, leaves, strict=True):
                if any(True for _ in m.parameters(recurse=False)):
                    counts.setdefault(type(m), []).append(c)
            if max(map(len, counts.values()), default=0) >= 2:
                found.flat[path] = [
                    c for c, m in zip(called, leaves, strict=True)
                    if any(True for _ in m.parameters(recurse=False))
                    or (sub.get(c, 0) > 0 and not getattr(m, "inplace", False))
                ]
                continue
        found.rejected[path] = "no two children in a row of one class or one structure"
    return found


def _is_run(segment: list[str], sub: dict[str, int]) -> bool:
    return len(segment) >= 2 and sum(sub.get(c, 0) for c in segment) > 0


def _choose(model: nn.Module, trace: _Trace) -> tuple[list[str], list[str]]:
    """The stages: blocks of called containers, split where inner blocks hold enough; and
    one line for each candidate container or run that contributed nothing, and why."""
    sub = _subtree_bytes(model, trace.own_bytes)
    found = _candidates(model, trace, sub)
    chooser = _Chooser(model, trace, sub, found)
    found_stages = chooser.best("", model)
    chosen = found_stages + chooser.interleaved(found_stages)
    used_flat: list[str] = []
    if len(chosen) < 2:  # no repeated blocks anywhere: the layers of flat containers (rule 8)
        for path, layers in found.flat.items():
            if not any(path.startswith(f"{s}.") for s in chosen):
                chosen += layers
                used_flat.append(path)
    chosen = sorted(chosen, key=trace.start.__getitem__)
    result, why = _without_overlaps(chosen, trace, sub)
    return result, _rejected(model, trace, sub, found, result, chooser.singles, used_flat, why)


@dataclass
class _Chooser:
    """The steps of :func:`_choose` over one traced forward, which call each other: the
    stages inside a module (:meth:`best`), one decision per container whether its blocks
    split (:meth:`decide`), what a block splits into (:meth:`contents`), and the modules
    called between a container's blocks (:meth:`interleaved`)."""

    model: nn.Module
    trace: _Trace
    sub: dict[str, int]
    found: _Candidates
    # the singles of mixed containers whose runs are stages (``best`` adds them)
    singles: list[str] = field(default_factory=list)

    @property
    def containers(self) -> dict[str, list[str]]:
        return self.found.blocks

    def leftovers(self, path: str, module: nn.Module,
                  held: bool = False) -> list[tuple[str, bool]]:
        """A split block's child as stages: itself if it is called once and saves, else
        the children of a container of one class (``held``) or of a module never called."""
        kids = _children(path, module)
        n = self.trace.calls.get(path, 0)
        one_class = len({type(m) for _, m in kids}) == 1
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and one_class:
            return [p for c, m in kids for p in self.leftovers(c, m, True)]
        if n == 0:
            return [p for c, m in kids for p in self.leftovers(c, m, held)]
        return [(path, held)] if n == 1 and self.sub.get(path, 0) > 0 else []

    def best(self, path: str, module: nn.Module, top: bool = True) -> list[str]:
        """The stages inside ``path``; ``top``: not inside a block (rule 7's runs count)."""
        if path in self.containers:
            return self.decide(self.containers[path])
        if top and path in self.found.segments:
            out: list[str] = []
            for segment in self.found.segments[path]:
                if _is_run(segment, self.sub):
                    out += self.decide(segment)
                    continue
                for c in segment:
                    inside = self.best(c, self.model.get_submodule(c), top)
                    self.singles.extend([] if inside else [c])
                    out += inside
            return out
        return [p for c, m in _children(path, module) for p in self.best(c, m, top)]

    def piece(self, path: str, module: nn.Module) -> tuple[list[tuple[str, bool]], bool]:
        """A part of a block being split: the blocks inside it, or it as a leftover."""
        chosen = self.best(path, module, False)
        return ([(p, True) for p in chosen], True) if chosen else (
            self.leftovers(path, module), False)

    def contents(self, block: str) -> tuple[list[tuple[str, bool]], bool]:
        """What a block splits into, and whether blocks nest inside it. A block that is a
        container itself (EfficientNet's stages in ``features``) splits into its own blocks
        and runs; a block of another class into the blocks inside its children."""
        module = self.model.get_submodule(block)
        if block in self.containers:
            return [(p, True) for p in self.decide(self.containers[block])], True
        if block in self.found.segments:
            parts: list[tuple[str, bool]] = []
            nested = False
            for segment in self.found.segments[block]:
                if _is_run(segment, self.sub):
                    parts += [(p, True) for p in self.decide(segment)]
                    nested = True
                    continue
                for c in segment:
                    more, inner = self.piece(c, self.model.get_submodule(c))
                    parts, nested = parts + more, nested or inner
            return parts, nested
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(
                {type(m) for m in module.children()}) == 1:
            return self.leftovers(block, module), False  # a container of one called block
        parts, nested = [], False
        for c, m in _children(block, module):
            more, inner = self.piece(c, m)
            parts, nested = parts + more, nested or inner
        return parts, nested

    def decide(self, blocks: list[str]) -> list[str]:
        # One decision for all blocks of a container, so the chain keeps one level: split
        # them when blocks inside them (counting a container of one) hold enough memory.
        split: list[tuple[str, bool]] = []
        nested = False  # some block holds a container of two or more called blocks
        for b in blocks:
            parts, inner = self.contents(b)
            split += parts
            nested = nested or inner
        held = sum(self.sub[p] for p, inner in split if inner)
        if not nested or held < SPLIT_SHARE * sum(self.sub[b] for b in blocks):
            return blocks
        return [p for p, _ in split]

    def interleaved(self, stages: list[str]) -> list[str]:
        """What a container's parent calls between two of its blocks that are stages
        (diffusers' mid-block attention between its two resnets, rule 5): stages too."""
        trace = self.trace
        chosen_set = set(stages)
        extra: list[str] = []
        for path, blocks in self.containers.items():
            inside = [b for b in blocks if b in chosen_set]
            if len(inside) < 2:
                continue
            first, last = min(inside, key=trace.start.__getitem__), max(
                inside, key=trace.start.__getitem__)
            parent = path.rpartition(".")[0]
            for c, m in _children(parent, self.model.get_submodule(parent)):
                if c == path:
                    continue
                extra += [p for p, _ in self.leftovers(c, m) if p not in chosen_set
                          and not any(s.startswith(f"{p}.") for s in stages)
                          and trace.end[first] < trace.start[p]
                          and trace.end[p] < trace.start[last]]
        return extra


def _without_overlaps(chosen: list[str], trace: _Trace,
                      sub: dict[str, int]) -> tuple[list[str], dict[str, str]]:
    """``chosen`` (in call order) less the lighter of each two stages whose calls overlap,
    and why each dropped one went."""
    # Calls of modules that are not nested can still overlap (one module called from
    # inside another it does not own); keep the heavier of two overlapping stages.
    result: list[str] = []
    why: dict[str, str] = {}
    for path in chosen:
        if result and trace.start[path] < trace.end[result[-1]]:
            light, heavy = ((result[-1], path) if sub[path] > sub[result[-1]]
                            else (path, result[-1]))
            why[light] = f"dropped, its call overlaps {heavy}'s, which saves more"
            result[-1] = heavy
            continue
        result.append(path)
    return result, why


#: At most this many lines of rejected candidates (``Chain.rejected``), then a count.
REJECTED_LINES = 8


def _rejected(model: nn.Module, trace: _Trace, sub: dict[str, int], found: _Candidates,
              stages: list[str], singles: list[str], used_flat: list[str],
              why: dict[str, str]) -> list[str]:
    """One line per candidate that gave no stage and saved memory outside the stages."""

    def covered(path: str) -> bool:
        return any(path == s or path.startswith(f"{s}.") or s.startswith(f"{path}.")
                   for s in stages)

    reasons = dict(why)
    for c in singles:
        if sub.get(c, 0) > 0 and not covered(c):
            reasons[c] = f"rejected, a single {type(model.get_submodule(c)).__name__} (a run " \
                         "needs two)"
    for path, reason in found.rejected.items():
        if (sub.get(path, 0) > 0 and not covered(path) and path not in used_flat
                and not any(path == c or path.startswith(f"{c}.") for c in singles)):
            reasons[path] = f"rejected, {reason}"
    for path, layers in found.flat.items():
        if path not in used_flat and sub.get(path, 0) > 0 and not covered(path):
            reasons[path] = (f"rejected, its {_plural(len(layers), 'layer')} are taken as "
                             "stages only where the model has no repeated blocks")
    order = sorted(reasons, key=lambda p: trace.start.get(p, len(trace.start) * 2))
    lines = [f"{p}: {reasons[p]}" for p in order[:REJECTED_LINES]]
    if len(order) > REJECTED_LINES:
        lines.append(f"... and {len(order) - REJECTED_LINES} more rejected candidates")
    return lines


def _children(path: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    prefix = f"{path}." if path else ""
    return [(prefix + name, child) for name, child in module.named_children()]


def discover_chain(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> Chain:
    """The stages of ``model`` found by one forward on ``batch``, with what they saved.

    ``loss_fn(model, batch)`` runs the forward (default ``model(batch)``). The model's
    RNG state, buffers and training flag are restored afterwards. Raises UsageError when
    the model has no two blocks to chain.
    """

    def run() -> Any:
        return loss_fn(model, batch) if loss_fn is not None else model(batch)

    with _untouched(model):
        trace = _trace(model, batch, run)
    stages, rejected = _choose(model, trace)
    sub = _subtree_bytes(model, trace.own_bytes)
    stages, call_bytes, more = _with_calls(model, trace, sub, stages)
    rejected = [*rejected, *more]
    if len(stages) < 2:
        raise UsageError(
            f"found no repeated blocks in {type(model).__name__} that its forward calls once "
            "each (two or more modules of one class in a row in an nn.ModuleList or "
            "nn.Sequential), nor a block it calls several times that holds most of the "
            "activation memory; name the stages with stages=[module paths] (--stages on the "
            "command line)"
        )
    chain = Chain(tuple(stages), tuple(call_bytes.get(p, sub.get(p, 0)) for p in stages),
                  trace.total_bytes, tuple(rejected))
    _LAST[model] = chain
    return chain


#: The modules the forward calls several times become stages, one per call, when their
#: calls together hold at least this share of the activation memory (rule 2).
CALLS_SHARE = 0.5


def _with_calls(model: nn.Module, trace: _Trace, sub: dict[str, int], stages: list[str]
                ) -> tuple[list[str], dict[str, int], list[str]]:
    """``stages`` with the calls of looped blocks as stages (rule 2, docs/stages.md); the
    bytes each call saved; and a line for each looped block that gave no stage.

    A looped block is a module with children that the forward calls two or more times and
    no module around it calls more than once (ALBERT's shared layer group, not the layers
    inside it). When the looped blocks hold at least :data:`CALLS_SHARE` of what the
    forward saved, and more than the stages found in or around them, each of their calls
    is a stage ``path#k`` (Note [Stages that are calls of one module] in
    remat.core.stage_names), and those stages go.
    """
    modules = dict(without_compiled_insides(model))

    def repeated(path: str) -> bool:
        return trace.calls.get(path, 0) >= 2

    def outermost(path: str) -> bool:
        parts = path.split(".")
        return not any(repeated(".".join(parts[:k])) for k in range(1, len(parts)))

    looped = [p for p, m in modules.items() if p and repeated(p) and outermost(p)
              and any(True for _ in m.children()) and sub.get(p, 0) > 0]
    if not looped:
        return stages, {}, []

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")

    held = sum(sub[p] for p in looped)
    displaced = sum(sub.get(s, 0) for s in stages if any(related(s, p) for p in looped))
    share = held / trace.total_bytes if trace.total_bytes else 0.0
    if share < CALLS_SHARE or held <= displaced:
        why = (f"holds {share:.0%} of the activation memory (its calls are stages from "
               f"{CALLS_SHARE:.0%})" if share < CALLS_SHARE
               else "the blocks found inside or around it hold more")
        return stages, {}, [f"{p}: rejected, called {trace.calls[p]} times and the calls "
                            f"of such blocks {why}" for p in looped
                            if not any(related(p, s) for s in stages)][:REJECTED_LINES]
    kept = [s for s in stages if not any(related(s, p) for p in looped)]
    starts = {s: trace.start[s] for s in kept}
    call_bytes: dict[str, int] = {}
    for p in looped:
        for k, (at, _, nbytes) in enumerate(sorted(trace.call_spans[p])):
            name = call_name(p, k)
            starts[name] = at
            call_bytes[name] = nbytes
    return sorted(starts, key=starts.__getitem__), call_bytes, []


_LAST: weakref.WeakKeyDictionary[nn.Module, Chain] = weakref.WeakKeyDictionary()


def last_chain(model: nn.Module) -> Chain | None:
    """The chain :func:`discover_chain` last found on ``model`` (``None`` if it found none),
    so a command can print what discovery rejected without tracing the forward again."""
    return _LAST.get(model)


def discover_stages(
    model: nn.Module,
    batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> list[str]:
    """Module paths of the model's stages, in call order.

    Given an example ``batch`` (and the ``loss_fn(model, batch)`` that runs the forward),
    the chain :func:`discover_chain` finds over the whole model. Without one, the
    children of the largest ``nn.ModuleList`` or ``nn.Sequential`` whose children all
    share one class (ties go to the container with more parameters), in its order.
    """
    if batch is not None:
        return list(discover_chain(model, batch, loss_fn).stages)
    candidates = _same_class_containers(model)
    if not candidates:
        raise UsageError(
            f"found no repeated-block container in {type(model).__name__} (an nn.ModuleList "
            "or nn.Sequential of two or more modules of one class on the forward path); "
            "name the stages with stages=[module paths]"
        )

    def size(item: tuple[str, list[str]]) -> tuple[int, int]:
        path, children = item
        params = sum(p.numel() for p in model.get_submodule(path).parameters())
        return len(children), params

    return max(candidates, key=size)[1]


def resolve_stages(model: nn.Module, stages: Sequence[str] | None = None) -> list[str]:
    """``stages`` checked against the model, or the discovered stages when ``None``."""
    if stages is None:
        return discover_stages(model)
    stages = list(stages)
    if not stages:
        raise UsageError("stages=[] names no module; give module paths or leave stages unset")
    known = dict(model.named_modules())
    for path in stages:
        if isinstance(path, str) and path and f"module.{path}" in known:
            # DataParallel and DistributedDataParallel hold the model as .module
            raise UsageError(
                f"the model has no submodule {path!r}: it is wrapped ({type(model).__name__}), "
                f"so its paths start with 'module.'; give 'module.{path}' (or name the "
                "stages on the model before wrapping it)"
            )
        # path#k: the k-th call of the module at path (Note [Stages that are calls of one
        # module] in remat.core.stage_names)
        module = split_stage_name(path)[0] if isinstance(path, str) else path
        if not isinstance(path, str) or module not in known or module == "":
            raise UsageError(unknown_path_message(model, module))
    if len(set(stages)) != len(stages):
        dup = next(p for p in stages if stages.count(p) > 1)
        raise UsageError(f"stage {dup!r} is named twice; each stage must be a distinct module")
    _check_calls(stages)
    return stages


def _check_calls(stages: Sequence[str]) -> None:
    """UsageError unless the stages naming calls of one module (``path#k``) name all of them
    in call order, ``path#0, path#1, ...``, and no other stage names that module."""
    calls: dict[str, list[str]] = {}
    for name in stages:
        calls.setdefault(split_stage_name(name)[0], []).append(name)
    for path, names in calls.items():
        if len(names) == 1 and split_stage_name(names[0])[1] is None:
            continue
        expected = [call_name(path, k) for k in range(len(names))]
        if names != expected:
            raise UsageError(
                f"the stages name the calls of module {path!r} as {', '.join(names)}; name "
                f"every call of it in one forward, in call order: {', '.join(expected)}")


def unknown_path_message(model: nn.Module, path: object) -> str:
    """One sentence naming a module path the model lacks, with the closest real ones."""
    known = [name for name, _ in model.named_modules() if name]
    close = difflib.get_close_matches(str(path), known, n=3)
    hint = (
        "did you mean " + " or ".join(repr(c) for c in close) + "?"
        if close
        else "list the paths with model.named_modules()"
    )
    return f"the model has no submodule {path!r}; {hint}"
