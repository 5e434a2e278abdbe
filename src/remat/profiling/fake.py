"""Fake-tensor profiles: a model sized without its memory (docs/fake.md).

``remat.fake_mode()`` is a ``FakeTensorMode``: a model and batch built inside it have fake
tensors (shapes, dtypes and devices, no data), so a model of any size costs the memory
of its Python objects. ``remat.profile(model, batch, loss_fn, fake=True)`` runs the usual
profile inside the same mode with the tracker counting fake storages (Note [Fake
storages] in :mod:`remat.measure.tracker`): every byte figure is the real step's, through
the same code path as a real profile; no kernel runs, so its times are only the fake
run's dispatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode

from remat.core.errors import UsageError
from remat.core.profile_format import Profile, StageProfile
from remat.measure.tracker import iter_tensors

__all__ = ["chain_container", "cut_to", "expanded", "fake_mode", "fake_mode_of"]


def fake_mode() -> FakeTensorMode:
    """A mode to build a model and its batch in with fake tensors::

        with remat.fake_mode() as mode:
            model, batch, loss_fn = make_model()
        profile = remat.profile(model, batch, loss_fn, fake=True)
    """
    return FakeTensorMode(allow_non_fake_inputs=False)


def fake_mode_of(model: nn.Module, batch: Any) -> FakeTensorMode:
    """The one fake mode ``model``'s parameters and buffers and ``batch`` belong to;
    UsageError naming the first tensor that is real or of another mode."""
    found: FakeTensorMode | None = None
    named = [*((f"parameter {n}", t) for n, t in model.named_parameters()),
             *((f"buffer {n}", t) for n, t in model.named_buffers()),
             *((f"batch tensor {k}", t) for k, t in enumerate(iter_tensors(batch)))]
    for name, t in named:
        mode = maybe_get_fake_mode(t) if isinstance(t, torch.Tensor) else None
        if mode is None:
            raise UsageError(
                f"fake=True needs the model and batch built under remat.fake_mode(), but "
                f"{name} is a real tensor; build them inside `with remat.fake_mode():`")
        if found is not None and mode is not found:
            raise UsageError(f"{name} belongs to another fake mode than the first tensor; "
                             "build the model and batch under one remat.fake_mode()")
        found = mode
    if found is None:
        raise UsageError("fake=True needs a model with parameters built under "
                         "remat.fake_mode()")
    return found


# Note [Depth under fake tensors]
# A fake step costs the dispatch of every op, so an 80-layer model's profile takes
# minutes though its layers are one computation repeated. When the chain is a whole
# container (ModuleList or Sequential) of identical stages (class, parameter and buffer
# shapes), the fake profile runs on the container cut to 3 and to 4 of them, and the
# profile of all n is built from those two: the first stage, the last and n - 2 copies of
# a middle one; every fixed figure extended along the line through its values at 3 and
# 4 (parameters, gradients and optimizer state grow by one stage's worth per stage; what
# is outside the chain does not grow); a stage index that stays put between the two
# (0) stays, one that moves with the end (the last stage, past the chain) moves to n's
# end. Anything else (the middle stages not equal, a read of a tensor made inside the
# chain, an index that does neither) and the whole model is profiled instead. The step
# without checkpointing is then the cost model's prediction (measured_peak_bytes too).
MIN_EXPANDED_STAGES = 6
_CUTS = (3, 4)


def chain_container(model: nn.Module, names: Sequence[str]) -> tuple[nn.Module, str, str] | None:
    """``(parent, attribute, prefix)`` when ``names`` are all of one ModuleList or
    Sequential's children, in order, and identical stages; else None."""
    from remat.runtime.identity import stage_identity

    prefix = names[0].rpartition(".")[0]
    if list(names) != [f"{prefix}.{i}" if prefix else str(i) for i in range(len(names))]:
        return None
    container = model.get_submodule(prefix) if prefix else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not prefix:
        return None
    if len(container) != len(names):
        return None
    identities = {stage_identity(m).fingerprint + type(m).__name__ for m in container}
    if len(identities) != 1:
        return None
    parent_path, _, attribute = prefix.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attribute, prefix


@contextlib.contextmanager
def cut_to(parent: nn.Module, attribute: str, k: int) -> Iterator[None]:
    """``parent.<attribute>`` holds only its first ``k`` modules inside."""
    whole = getattr(parent, attribute)
    cut = (nn.Sequential(*list(whole)[:k]) if isinstance(whole, nn.Sequential)
           else nn.ModuleList(list(whole)[:k]))
    setattr(parent, attribute, cut)
    try:
        yield
    finally:
        setattr(parent, attribute, whole)


_INDEX_FIELDS = ("input_held_through", "output_held_through")
_IGNORED = {"name", "same_as", *_INDEX_FIELDS}


def _bytes_equal(a: StageProfile, b: StageProfile) -> bool:
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a)
               if f.name not in _IGNORED and not f.name.endswith("_s")
               and f.name != "time_spread")


def _index(small: int | None, large: int | None, n: int) -> int | None:
    """A stage index at 3 and at 4 stages, at ``n`` (None where neither has one);
    :class:`_NotLinear` where it neither stays put nor moves with the chain's end."""
    if small is None and large is None:
        return None
    if small == large:
        return small
    if small is not None and large is not None and large - small == 1:
        return n - (_CUTS[1] - large)
    raise _NotLinear


class _NotLinear(Exception):
    pass


def expanded(small: Profile, large: Profile, n: int, prefix: str) -> Profile | None:
    """The profile of all ``n`` stages from those of the first 3 and 4 (Note [Depth under
    fake tensors]); None where they do not line up."""
    s, m = small.stages, large.stages
    if not _bytes_equal(m[1], m[2]) or not _bytes_equal(s[1], m[1]):
        return None
    if not (_bytes_equal(s[0], m[0]) and _bytes_equal(s[-1], m[-1])):
        return None
    if any(r.made_after != 0 for stage in m for r in stage.reads):
        return None
    try:
        roles = [(s[0], m[0]), (s[1], m[1]), (s[-1], m[-1])]
        index: list[dict[str, Any]] = [
            {f: _index(getattr(a, f), getattr(b, f), n) for f in _INDEX_FIELDS}
            for a, b in roles]
    except _NotLinear:
        return None
    stages = []
    # the attention kernels noted per stage (a profile for a device) follow the stages
    kernels = None if large.kernels is None else {
        name: calls for name, calls in large.kernels.items()
        if not name.startswith(f"{prefix}.")}
    for i in range(n):
        role = 0 if i == 0 else 2 if i == n - 1 else 1
        template = roles[role][1]
        stages.append(dataclasses.replace(
            template, name=f"{prefix}.{i}", **index[role]))
        calls = None if large.kernels is None else large.kernels.get(template.name)
        if kernels is not None and calls is not None:
            kernels[f"{prefix}.{i}"] = calls

    def line(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else b + (n - _CUTS[1]) * (b - a)

    grown: dict[str, Any] = {
        f.name: line(getattr(small.fixed, f.name), getattr(large.fixed, f.name))
        for f in dataclasses.fields(large.fixed)}
    fixed = dataclasses.replace(large.fixed, **grown)
    result = dataclasses.replace(
        large, stages=tuple(stages), fixed=fixed, kernels=kernels,
        step_s=max(0.0, large.step_s + (n - _CUTS[1]) * (large.step_s - small.step_s)),
        model_stages=(None if large.model_stages is None
                      else large.model_stages + n - _CUTS[1]),
        model=f"{large.model} ({_CUTS[1]} of {n} identical stages profiled)")
    from remat.core.solve.from_profile import predict_no_checkpoint_peak

    peak = predict_no_checkpoint_peak(result)
    return dataclasses.replace(result, measured_peak_bytes=peak, predicted_peak_bytes=peak)
