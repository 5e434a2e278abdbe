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

Activation memory is what autograd saves during the forward (distinct storages,
parameters and the batch excluded), credited to the innermost module running when it
is saved. Without a batch there is nothing to measure: the children of the largest
same-class container are the stages.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.measure.modes import without_compiled_insides
from remat.measure.tracker import storage_key

__all__ = [
    "SPLIT_SHARE",
    "Chain",
    "discover_chain",
    "discover_stages",
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
    for path, module in without_compiled_insides(model):

        def pre(_m: nn.Module, _args: Any, path: str = path) -> None:
            calls[path] = calls.get(path, 0) + 1
            start.setdefault(path, events[0])
            events[0] += 1
            stack.append(path)

        def post(_m: nn.Module, _args: Any, _out: Any, path: str = path) -> None:
            if stack and stack[-1] == path:
                stack.pop()
            end.setdefault(path, events[0])
            events[0] += 1

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return _Trace(calls, start, end, own, total[0])


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


def _choose(model: nn.Module, trace: _Trace) -> list[str]:
    """The stages: blocks of called containers, split where inner blocks hold enough."""
    containers: dict[str, list[str]] = {}  # container path -> its blocks
    for path, children in _same_class_containers(model, families=True):
        counts = [trace.calls.get(c, 0) for c in children]
        if max(counts) == 1 and sum(counts) >= 2:
            containers[path] = [c for c, n in zip(children, counts, strict=True) if n == 1]
    sub = _subtree_bytes(model, trace.own_bytes)

    def leftovers(path: str, module: nn.Module, held: bool = False) -> list[tuple[str, bool]]:
        """A split block's child as stages: itself if it is called once and saves, else
        the children of a container of one class (``held``) or of a module never called."""
        kids = _children(path, module)
        n = trace.calls.get(path, 0)
        one_class = len({type(m) for _, m in kids}) == 1
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and one_class:
            return [p for c, m in kids for p in leftovers(c, m, True)]
        if n == 0:
            return [p for c, m in kids for p in leftovers(c, m, held)]
        return [(path, held)] if n == 1 and sub.get(path, 0) > 0 else []

    def best(path: str, module: nn.Module) -> list[str]:
        if path not in containers:
            return [p for c, m in _children(path, module) for p in best(c, m)]
        # One decision for all blocks of a container, so the chain keeps one level: split
        # them when blocks inside them (counting a container of one) hold enough memory.
        blocks = containers[path]
        split: list[tuple[str, bool]] = []
        nested = False  # some block holds a container of two or more called blocks
        for b in blocks:
            for c, m in _children(b, model.get_submodule(b)):
                chosen = best(c, m)
                nested = nested or bool(chosen)
                split += [(p, True) for p in chosen] if chosen else leftovers(c, m)
        held = sum(sub[p] for p, inner in split if inner)
        if not nested or held < SPLIT_SHARE * sum(sub[b] for b in blocks):
            return blocks
        return [p for p, _ in split]

    def interleaved(stages: list[str]) -> list[str]:
        """What a container's parent calls between two of its blocks that are stages
        (diffusers' mid-block attention between its two resnets, rule 3): stages too."""
        chosen_set = set(stages)
        extra: list[str] = []
        for path, blocks in containers.items():
            inside = [b for b in blocks if b in chosen_set]
            if len(inside) < 2:
                continue
            first, last = min(inside, key=trace.start.__getitem__), max(
                inside, key=trace.start.__getitem__)
            parent = path.rpartition(".")[0]
            for c, m in _children(parent, model.get_submodule(parent)):
                if c == path:
                    continue
                extra += [p for p, _ in leftovers(c, m) if p not in chosen_set
                          and not any(s.startswith(f"{p}.") for s in stages)
                          and trace.end[first] < trace.start[p]
                          and trace.end[p] < trace.start[last]]
        return extra

    found = best("", model)
    chosen = sorted(found + interleaved(found), key=trace.start.__getitem__)
    # Calls of modules that are not nested can still overlap (one module called from
    # inside another it does not own); keep the heavier of two overlapping stages.
    result: list[str] = []
    for path in chosen:
        if result and trace.start[path] < trace.end[result[-1]]:
            if sub[path] > sub[result[-1]]:
                result[-1] = path
            continue
        result.append(path)
    return result


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
    stages = _choose(model, trace)
    if len(stages) < 2:
        raise UsageError(
            f"found no repeated blocks in {type(model).__name__} that its forward calls once "
            "each (an nn.ModuleList or nn.Sequential of two or more modules of one class); "
            "name the stages with stages=[module paths] (--stages on the command line)"
        )
    sub = _subtree_bytes(model, trace.own_bytes)
    return Chain(tuple(stages), tuple(sub[p] for p in stages), trace.total_bytes)


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
        if not isinstance(path, str) or path not in known or path == "":
            raise UsageError(unknown_path_message(model, path))
    if len(set(stages)) != len(stages):
        dup = next(p for p in stages if stages.count(p) > 1)
        raise UsageError(f"stage {dup!r} is named twice; each stage must be a distinct module")
    return stages


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
