"""Transforms of a planning problem, in one place: another batch size, one rank under data
parallelism, a later micro-step of gradient accumulation.

Torch-free. Each takes a profile or a :class:`Problem` and returns a new one with some
fields rewritten and nothing else; the profiler, the planner, bench and distributed all
call these rather than keeping their own copies.

* :func:`at_batch_size`: a profile fitted at two batch sizes (``Profile.scaling``),
  evaluated at another one; its no-checkpoint peak is predicted again by the simulator.
* :func:`accumulating`: a later micro-step of gradient accumulation.
* :func:`with_times_of`: a problem's times taken from another problem of the same chain
  (a per-rank problem timed as the wrapped model runs: its collectives included).
* :func:`per_rank_problem`: one rank's problem under DDP or FSDP2. The simulator
  (:mod:`remat.core.solve.simulator`) knows one device; a data-parallel rank is one device
  whose problem differs from the single-process one in what the wrapper keeps:

* Start from the problem of **one rank's micro-batch** (profile the plain model on its
  shard of the global batch): activations, boundaries and transients are already per rank.
* ``ddp``: parameters, gradients and optimizer state are replicated, unchanged. DDP's
  gradient buckets (``bucket_bytes``; by default a copy of every gradient, as with
  ``gradient_as_bucket_view=False``) are allocated when the model is wrapped and stay
  all step: they join ``params_bytes``.
* ``fsdp`` (``fully_shard`` on every stage, then on the root, the default
  ``reshard_after_forward=True``): the sharded parameters, the stages' gradients, the
  optimizer state and the optimizer step's temporaries are divided by the world size
  (``ceil``; FSDP pads each parameter's dim 0 to a multiple of it, up to ``W - 1`` rows
  more). Buffers (``replicated_bytes``) are not sharded. Each stage is a unit of its own
  parameters (``unit_bytes``: what it takes gathered, its all-gather's flat buffer as
  much) reduce-scattering its gradients (``reduce_bytes``); the simulator keeps them as
  FSDP2 does, in forward, rebuilds and backward, with its prefetches (Note [FSDP2 units]
  in :mod:`remat.core.solve.simulator`). The root unit (everything outside the stages:
  embeddings, head) is gathered in its forward (``root_unit_bytes``) and not resharded
  until the end of backward: its unsharded parameters join ``pre_chain_bytes``, alive
  until then, and its gradients stay unsharded to then too (the pre- and post-chain's
  gradients are not divided; counted so through the optimizer step, an upper bound
  there). ``backend="gloo"`` sets ``collective_copies`` (gloo copies an all-gather's output
  and a reduce-scatter's input while it runs).
* time: each stage's ``fwd_s`` and ``bwd_s`` gain one all-gather (``gather_s``, FSDP) and
  its ``bwd_s`` one gradient reduction (``reduce_s``: FSDP's reduce-scatter, DDP's
  all-reduce; serial with compute, an upper bound). A rebuild that gathers again adds
  ``rebuild_gathers * gather_s`` to the stage's ``rebuild_s``, which the simulator
  charges once per rebuild run. ``remat.parallel.gathers.count_all_gathers`` measures it:
  with torch 2.13 neither wrap order gathers again (``docs/distributed.md``), so the
  default is 0. Each stage keeps its ``gather_s`` (``StageCost.gather_s``): a plan that
  reshards units after rebuilds pays it per reshard (Note [Resharding after a rebuild]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from remat.core.errors import UsageError
from remat.core.plan_format import Option
from remat.core.profile_format import Profile, set_path
from remat.core.solve.from_profile import predict_no_checkpoint_peak
from remat.core.solve.problem import Problem

__all__ = ["accumulating", "at_batch_size", "per_rank_problem", "with_times_of"]

_STRATEGIES = ("ddp", "fsdp")


def _per_stage(
    value: float | Mapping[str, float] | Sequence[float], problem: Problem, what: str
) -> tuple[float, ...]:
    if isinstance(value, bool):
        raise UsageError(f"{what}={value!r} is not seconds; give a number >= 0")
    if isinstance(value, (int, float)):
        values: tuple[float, ...] = (float(value),) * problem.n
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(problem.stage_names))
        if unknown:
            raise UsageError(
                f"{what} names unknown stage(s) {', '.join(unknown)}; use the problem's stage names"
            )
        values = tuple(float(value.get(name, 0.0)) for name in problem.stage_names)
    else:
        values = tuple(float(v) for v in value)
        if len(values) != problem.n:
            raise UsageError(
                f"{what} has {len(values)} entries for {problem.n} stages; give one per stage"
            )
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise UsageError(f"{what}={value!r} has a negative or non-finite entry; give >= 0")
    return values


def per_rank_problem(
    problem: Problem,
    *,
    world_size: int,
    strategy: str,
    stage_params_bytes: Mapping[str, int] | Sequence[int] | None = None,
    replicated_bytes: int = 0,
    bucket_bytes: int | None = None,
    gather_s: float | Mapping[str, float] | Sequence[float] = 0.0,
    reduce_s: float | Mapping[str, float] | Sequence[float] = 0.0,
    rebuild_gathers: int = 0,
    backend: str = "gloo",
) -> Problem:
    """The problem one rank of a ``strategy`` (``ddp`` or ``fsdp``) job of ``world_size`` solves.

    ``problem`` describes one rank's micro-batch. ``stage_params_bytes``: each stage's own
    parameters (default: its ``grad_bytes``, equal when every parameter trains and none is
    shared). ``replicated_bytes``: the part of ``params_bytes`` FSDP does not shard
    (buffers). ``bucket_bytes``: DDP's gradient buckets (default ``grads_bytes``; 0 with
    ``gradient_as_bucket_view=True``). ``gather_s``, ``reduce_s``: one all-gather and one
    gradient reduction per stage, seconds (a number for every stage, a mapping by name or a
    sequence). ``rebuild_gathers``: all-gathers each rebuild run of a stage makes again.
    ``backend``: the collectives' (``gloo`` copies an all-gather's output and a
    reduce-scatter's input while the collective runs; ``nccl`` does not).
    """
    _check_rank_arguments(strategy, world_size, rebuild_gathers)
    collectives = _Collectives(
        gather_s=_per_stage(gather_s, problem, "gather_s"),
        reduce_s=_per_stage(reduce_s, problem, "reduce_s"),
        rebuild_gathers=rebuild_gathers,
    )
    if strategy == "ddp":
        return _ddp_rank(problem, world_size, bucket_bytes, collectives)
    params = _stage_params(problem, stage_params_bytes)
    return _fsdp_rank(problem, world_size, params, replicated_bytes, collectives, backend)


@dataclass(frozen=True)
class _Collectives:
    """Each stage's collectives under a data-parallel wrapper, in seconds: one all-gather
    (FSDP) and one gradient reduction; and the all-gathers each rebuild run makes again."""

    gather_s: tuple[float, ...]
    reduce_s: tuple[float, ...]
    rebuild_gathers: int


def _check_rank_arguments(strategy: str, world_size: int, rebuild_gathers: int) -> None:
    if strategy not in _STRATEGIES:
        raise UsageError(f"strategy {strategy!r} is unknown; use one of {', '.join(_STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size={world_size!r} is invalid; give a whole number >= 1")
    if (
        isinstance(rebuild_gathers, bool)
        or not isinstance(rebuild_gathers, int)
        or rebuild_gathers < 0
    ):
        raise UsageError(
            f"rebuild_gathers={rebuild_gathers!r} is invalid; give a whole number >= 0"
        )


def _ddp_rank(problem: Problem, w: int, bucket_bytes: int | None,
              collectives: _Collectives) -> Problem:
    """A DDP rank: the gradient buckets join the parameters, each backward its reduction."""
    buckets = problem.grads_bytes if bucket_bytes is None else bucket_bytes
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 0:
        raise UsageError(f"bucket_bytes={bucket_bytes!r} is invalid; give bytes >= 0")
    stages = tuple(
        replace(s, bwd_s=s.bwd_s + r)
        for s, r in zip(problem.stages, collectives.reduce_s, strict=True)
    )
    return replace(
        problem,
        stages=stages,
        params_bytes=problem.params_bytes + buckets,
        measured_no_checkpoint_peak_bytes=None,
        description=_described(problem, f"ddp rank of {w}"),
    )


def _stage_params(
    problem: Problem, stage_params_bytes: Mapping[str, int] | Sequence[int] | None
) -> tuple[int, ...]:
    """Each stage's own parameter bytes, checked; by default its ``grad_bytes``."""
    if stage_params_bytes is None:
        return tuple(s.grad_bytes for s in problem.stages)
    if isinstance(stage_params_bytes, Mapping):
        missing = [n for n in problem.stage_names if n not in stage_params_bytes]
        if missing:
            raise UsageError(
                f"stage_params_bytes lacks stage(s) {', '.join(missing)}; give "
                "every stage's parameter bytes"
            )
        return tuple(int(stage_params_bytes[n]) for n in problem.stage_names)
    params = tuple(int(p) for p in stage_params_bytes)
    if len(params) != problem.n:
        raise UsageError(
            f"stage_params_bytes has {len(params)} entries for {problem.n} "
            "stages; give one per stage"
        )
    return params


def _fsdp_rank(problem: Problem, w: int, params: tuple[int, ...], replicated_bytes: int,
               collectives: _Collectives, backend: str) -> Problem:
    """An FSDP2 rank: each stage a unit of its own parameters, the rest the root unit."""

    def share(nbytes: int) -> int:
        return -(-nbytes // w)

    sharded = problem.params_bytes - replicated_bytes
    root = sharded - sum(params)
    if replicated_bytes < 0 or any(p < 0 for p in params) or root < 0:
        raise UsageError(
            f"the stages' parameters ({sum(params)} bytes) plus replicated_bytes="
            f"{replicated_bytes} exceed params_bytes={problem.params_bytes}; give the "
            "problem's own parameter split"
        )
    sharded_stages = [
        replace(
            s,
            unit_bytes=p,
            reduce_bytes=s.grad_bytes,
            gather_s=g,
            grad_bytes=share(s.grad_bytes),
            fwd_s=s.fwd_s + g,
            bwd_s=s.bwd_s + g + r,
            rebuild_s=s.rebuild_s + collectives.rebuild_gathers * g,
        )
        for s, p, g, r in zip(problem.stages, params, collectives.gather_s,
                              collectives.reduce_s, strict=True)
    ]
    # The root's gradients stay unsharded until its post-backward, at the end of backward
    # (counted so through the optimizer step: an upper bound there).
    parts = (
        sum(s.grad_bytes for s in sharded_stages)
        + problem.pre_chain_grads_bytes
        + problem.post_chain_grads_bytes
    )
    return replace(
        problem,
        stages=tuple(sharded_stages),
        params_bytes=replicated_bytes + share(sharded),
        grads_bytes=max(share(problem.grads_bytes), parts),
        optimizer_state_bytes=share(problem.optimizer_state_bytes),
        optimizer_step_bytes=share(problem.optimizer_step_bytes),
        pre_chain_bytes=problem.pre_chain_bytes + root,
        root_unit_bytes=root,
        collective_copies=backend == "gloo",
        measured_no_checkpoint_peak_bytes=None,
        description=_described(problem, f"fsdp rank of {w}"),
    )


def _described(problem: Problem, what: str) -> str:
    return f"{problem.description} ({what})" if problem.description else what


def at_batch_size(profile: Profile, batch_size: int) -> Profile:
    """``profile`` with every fitted quantity evaluated at ``batch_size``.

    The no-checkpoint peak is predicted again by the simulator; ``measured_peak_bytes``
    (and the timed rounds) are kept only at the batch size that was measured. At the
    profile's own batch size every quantity keeps its measured value: the fits pass
    through it, and evaluating ``a + b * n`` there would only add float rounding.
    """
    if profile.scaling is None:
        raise UsageError(
            "this profile has no batch scaling; profile it at two batch sizes first with "
            "remat.profiling.profiler.profile_scaling"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"batch_size={batch_size!r} must be a whole number >= 1")
    data = profile.to_dict()
    if batch_size != profile.batch_size:
        for path, fit in profile.scaling.fits.items():
            set_path(data, path, fit(batch_size))
        data["measured_peak_bytes"] = None
        data.pop("timed_rounds", None)  # measured at the profile's own batch size
    data["batch_size"] = batch_size
    scaled = Profile.from_dict(data)
    return replace(scaled, predicted_peak_bytes=predict_no_checkpoint_peak(scaled))


def accumulating(problem: Problem) -> Problem:
    """A later micro-step of gradient accumulation, for the simulator: every parameter
    gradient exists from the start (the earlier micro-steps made it) and backward adds
    to it in place rather than creating it."""
    return replace(
        problem,
        params_bytes=problem.params_bytes + problem.grads_bytes,
        grads_bytes=0,
        pre_chain_grads_bytes=0,
        post_chain_grads_bytes=0,
        stages=tuple(replace(s, grad_bytes=0) for s in problem.stages),
    )


def with_times_of(problem: Problem, timed: Problem) -> Problem:
    """``problem`` with every time taken from ``timed``, a problem of the same chain timed
    another way: what a profile of the model as the engine runs it measures (one rank
    of an FSDP2 or DDP job, its all-gathers, reduce-scatters and all-reduces inside each
    stage's forward and backward and the root's outside the chain). Memory stays
    ``problem``'s. Stages are matched by position (a DDP wrapper prefixes their names).
    """
    if timed.n != problem.n:
        raise UsageError(
            f"the timed problem has {timed.n} stages and this one {problem.n}; time the same "
            "chain of stages"
        )
    stages = tuple(
        replace(s, fwd_s=t.fwd_s, bwd_s=t.bwd_s, rebuild_s=t.rebuild_s, link_s=t.link_s,
                extra_bwd_s={o: x for o, x in t.extra_bwd_s.items()
                             if o in s.saved_bytes or Option(o).is_offload})
        for s, t in zip(problem.stages, timed.stages, strict=True)
    )
    return replace(problem, stages=stages, outside_chain_s=timed.outside_chain_s,
                   region_overhead_s=timed.region_overhead_s)
