"""``remat.profile``: measure what each stage of a model's chain costs, into a Profile.

The measuring is in :mod:`remat.profiling` (what runs, in which order, and what it costs
is described in :mod:`remat.profiling.measurements`); this module checks the arguments, builds the
:class:`~remat.core.profile_format.Profile` and asks the simulator for its prediction of the
step without checkpointing. The profiling steps train the model (the optimizer's state is
part of what is measured); everything they change, parameters, buffers, gradients,
``requires_grad`` flags, every module's training mode, a given optimizer's state, and the
caller's RNG state, is put back bitwise afterwards, also when a step raises (Note [The
user's model is the user's] in :mod:`remat.measure.model_state`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.core.devices import Device, get_device
from remat.core.errors import UsageError
from remat.core.plan_format import Option
from remat.core.profile_format import (
    COMPILED_OPTIONS,
    OPTIONS,
    LinearFit,
    Profile,
    Scaling,
    numeric_paths,
)
from remat.core.solve.from_profile import predict_no_checkpoint_peak
from remat.core.units import first_names
from remat.measure.model_state import check_batch, model_restored, refuse_meta
from remat.measure.step import (
    checked_loss,
    checking_loss,
    make_optimizer,
    trainable_parameters,
)
from remat.measure.tracker import counting_fake_storages, iter_tensors
from remat.profiling._tensors import buffers_restored
from remat.profiling.assemble import fixed_bytes, gradient_owners, stage_profiles
from remat.profiling.backward_surplus import calibrated
from remat.profiling.device_kernels import DeviceKernels
from remat.profiling.estimated_times import with_estimated_times
from remat.profiling.fake import fake_mode_of
from remat.profiling.measurements import Measurements, measure_all, part_names
from remat.profiling.noise import timing_noise
from remat.profiling.op_costs import count_work
from remat.profiling.optimes import (
    link_s,
    region_link_s,
    region_overhead_rounds,
    region_overhead_s,
)
from remat.profiling.option_twins import merge_twin_options
from remat.profiling.rounds import measured_link_rounds, timed_rounds
from remat.profiling.timeline import StageNotRun
from remat.runtime.compiled_stages import compile_stages, compiled_flags
from remat.runtime.existing import refuse_checkpoint_calls, without_own_checkpointing
from remat.runtime.identity import model_stages, stage_identity
from remat.runtime.install import applied
from remat.runtime.stage_calls import stage_submodule
from remat.runtime.stages import discover_stages, resolve_stages

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["Progress", "default_loss", "fit_scaling", "most_over_ranks", "notes", "profile",
           "profile_scaling"]

#: ``progress(what, done, total)``: called before each part of a profile and at the end.
Progress = Callable[[str, int, int], None]
LossFn = Callable[[nn.Module, Any], Any]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's output if it is a scalar, else the sum of its main output."""
    out = model(batch)
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise UsageError(
            f"the model returned {type(out).__name__}; pass loss_fn(model, batch) that "
            "runs the forward and returns the scalar loss"
        )
    return out if out.numel() == 1 else out.sum()


def _no_progress(_what: str, _done: int, _total: int) -> None:
    return None


def most_over_ranks(count: int) -> int:
    """The largest ``count`` any rank of the default process group has."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return count
    most = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _check_options(options: Sequence[str]) -> tuple[Option, ...]:
    found = tuple(dict.fromkeys(map(Option, options)))
    if not any(option.is_keep for option in found):
        raise UsageError("options must include 'keep'; the simulator needs it for every stage")
    for option in found:
        if option.is_offload:
            raise UsageError(
                f"option {option!r} cannot be profiled; give keep or selective:<policy>"
            )
    return found


def _device_name(device: torch.device | None) -> str:
    if device is None:
        return "cpu"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _stage_comms(model: nn.Module, batch: Any, loss_fn: Any, names: Sequence[str]
                 ) -> list[Any]:
    from remat.parallel.tensor import stage_comms

    comms = stage_comms(model, batch, loss_fn, names)
    model.zero_grad(set_to_none=True)
    return comms


def _tp_ranks(model: nn.Module) -> int | None:
    """The ranks a DTensor parameter is spread over (its mesh's size), or None where no
    parameter is a DTensor (no tensor parallelism: the stages do not communicate, and
    ``selective:save-collectives`` is not worth measuring)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if type(p).__name__ == "DTensor" and mesh is not None:
            return int(mesh.size())
    return None


@without_own_checkpointing  # flags and checkpoint_wrapper off while profiling, with a warning
def profile(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    stages: Sequence[str] | None = None,
    optimizer: str | torch.optim.Optimizer = "adamw",
    *,
    repeats: int = 2,
    options: Sequence[str] | None = None,
    batch_size: int | None = None,
    description: str | None = None,
    lr: float = 1e-3,
    progress: Progress | None = None,
    ranks_agree: bool = False,
    compile: bool = False,
    fake: bool = False,
    device: str | Device | None = None,
    padded_batches: bool = False,
    _timed: bool = True,
) -> Profile:
    """Profile one training step of ``model`` on ``batch`` into a :class:`Profile`.

    Args:
        loss_fn: ``loss_fn(model, batch)`` runs the forward and returns the scalar loss;
            by default the model's output (summed if it is not a scalar).
        stages: module paths of the chain, in call order; by default the repeated-block
            container the forward runs (:func:`remat.runtime.stages.discover_stages`).
        optimizer: ``"adamw"``, ``"adamw-fused"``, ``"sgd"`` (momentum 0.9) or an
            optimizer of the model.
        repeats: timed steps of each kind (plain, per-stage regions) after one warm-up
            step of each; times are medians.
        options: ``keep`` and the selective options to measure saved bytes for; by
            default :data:`~remat.core.profile_format.OPTIONS`, and on compiled stages
            :data:`~remat.core.profile_format.COMPILED_OPTIONS` too
            (``selective:budget=<fraction>`` needs compiled stages), and on a model with
            DTensor parameters (tensor parallelism) ``selective:save-collectives``.
        batch_size: recorded in the profile; by default the first tensor's first dimension.
        description: the model's name in the profile (default: its class name).
        progress: ``progress(what, done, total)`` before each part and once at the end.
        ranks_agree: under torchrun, a model whose steps communicate (wrapped by FSDP2 or
            DDP) must run the same steps on every rank: the rounds a noisy profile adds
            are then the most any rank asks for (a collective over the default group, so
            every rank must call this together).
        compile: compile each stage's forward first (:func:`remat.compile_stages`; the
            stages stay compiled) and measure the compiled program; stages the caller
            compiled are measured compiled without it. A selective option on a
            compiled stage is compiled into the stage (docs/compile.md).
        fake: the model and batch were built under :func:`remat.fake_mode` (fake tensors:
            no weights allocated, no kernel runs); the step is measured in that mode, the
            bytes as the real step's, and the profile says ``fake`` (its times are only
            the fake run's dispatch: docs/fake.md).
        device: with ``fake``, the target device (a name from ``remat.core.devices`` or a
            ``Device``): its kernels stand in where they save other tensors than this
            machine's (attention, dropout), and the profile records which kernel each
            attention call was assumed to run (``kernels``). Default: this machine's.
            On an accelerator the optimizer runs torch's multi-tensor (``foreach``)
            implementation, torch's default there, and transformers' causal masks run as
            ``is_causal`` (below).
        padded_batches: with an accelerator ``device``: the batches the real run will see
            have padding. transformers cannot read a fake batch, so it builds a causal
            mask where on the device, for a batch without padding, it passes
            ``is_causal`` and no mask to a flash kernel; by default such a mask (boolean,
            ``(batch or 1, 1, s, s)``, under a model's sliding window if it has one) runs
            as ``is_causal``. True keeps every mask, as a padded batch runs
            (docs/fake.md).
        _timed: internal (the fake profile): False runs only the steps its byte figures
            and the times the format needs take, no rounds for timing alone.
    """
    target, mode = _checked_arguments(model, batch, repeats, compile, fake, device,
                                      padded_batches)
    asked = _Asked(optimizer=optimizer, options=options, batch_size=batch_size,
                   description=description, lr=lr, progress=progress,
                   ranks_agree=ranks_agree)
    # the steps train the model: it is put back as it was, also after an error
    # (Note [The user's model is the user's])
    with model_restored(model, optimizer if isinstance(optimizer, torch.optim.Optimizer)
                        else None):
        if mode is not None:
            with mode, counting_fake_storages():
                return _fake_profile(model, batch, loss_fn, stages, target, padded_batches,
                                     asked)
        return _measured(model, batch, loss_fn, stages, asked, repeats=repeats,
                         compile=compile, timed=_timed)


@dataclass(frozen=True)
class _Asked:
    """The options of ``profile`` that go on, unchanged, to its real and fake measuring
    (the fake one passes them to ``profile`` again for each cut of the chain)."""

    optimizer: str | torch.optim.Optimizer
    options: Sequence[str] | None
    batch_size: int | None
    description: str | None
    lr: float
    progress: Progress | None
    ranks_agree: bool

    def again(self, optimizer: str | torch.optim.Optimizer) -> dict[str, Any]:
        """``profile``'s keyword arguments for these options, with ``optimizer``."""
        return {"optimizer": optimizer, "options": self.options,
                "batch_size": self.batch_size, "description": self.description,
                "lr": self.lr, "progress": self.progress, "ranks_agree": self.ranks_agree}


def _checked_arguments(model: nn.Module, batch: Any, repeats: int, compile: bool,
                       fake: bool, device: str | Device | None, padded_batches: bool
                       ) -> tuple[Device | None, FakeTensorMode | None]:
    """``profile``'s arguments checked before anything runs; the target device, and with
    ``fake`` the fake mode the model and batch were built under."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"repeats={repeats!r} is invalid; give a whole number >= 1")
    for name, flag in (("compile", compile), ("fake", fake)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name}={flag!r} is not a bool; pass True or False")
    if device is not None and not fake:
        raise UsageError("device= sizes a step for another device and needs fake=True (a "
                         "real profile measures this machine)")
    if not isinstance(padded_batches, bool):
        raise UsageError(f"padded_batches={padded_batches!r} is not a bool; pass True or False")
    target = get_device(device) if isinstance(device, str) else device
    if padded_batches and (target is None or not target.is_accelerator):
        raise UsageError("padded_batches=True says how an accelerator's attention runs and "
                         "needs fake=True and device=<an accelerator>")
    mode = None
    if fake:
        mode = fake_mode_of(model, batch)
        if compile:
            raise UsageError("compile=True and fake=True do not go together: a fake profile "
                             "runs no compiled code; profile the compiled model for real")
    else:
        refuse_meta(model, batch)
    check_batch(batch)
    trainable_parameters(model)  # before anything runs
    return target, mode


@dataclass(frozen=True)
class _Chain:
    """What ``_measured`` settles before the steps run: the stages, the options measured,
    and what the profile records of the model and batch."""

    names: list[str]
    options: tuple[Option, ...]
    loss_fn: LossFn
    compiled: bool
    tensor_parallel: bool
    # what plans made from this profile record, so apply can tell another model
    identities: list[Any]
    batch_shapes: tuple[tuple[int, ...], ...]
    device: torch.device | None
    dtype: torch.dtype
    batch_size: int | None


def _chain(model: nn.Module, batch: Any, loss_fn: LossFn | None,
           stages: Sequence[str] | None, asked: _Asked, compile: bool) -> _Chain:
    """The stages and options of a real profile, checked, the stages compiled if asked."""
    given = asked.options
    tensor_parallel = _tp_ranks(model) is not None
    options = given
    if options is None and tensor_parallel:
        options = (*OPTIONS, Option.selective("save-collectives"))
    checked = _check_options(OPTIONS if options is None else options)
    loss = checking_loss(loss_fn or default_loss)  # a wrong loss named, not torch's error
    names = (
        resolve_stages(model, stages)
        if stages is not None
        else discover_stages(model, batch, loss)
    )
    compiled = compile or any(compiled_flags(model, names))
    partitioned = next((o for o in checked if o.is_partitioned), None)
    if partitioned is not None and not compiled:
        raise UsageError(f"option {partitioned!r} needs compiled stages; pass compile=True "
                         "(--compile) or leave it out")
    if given is None and compiled:
        checked = (*checked, *COMPILED_OPTIONS)
    if compiled:
        compile_stages(model, names)  # the rest compiled, the caller's own wrapped
    if not applied(model):  # with a plan applied, remat's own rebuilds would count
        refuse_checkpoint_calls(model, batch, loss, names)  # checkpoint calls in code
    first = next(model.parameters(), None)
    dtypes = Counter(p.dtype for p in model.parameters() if p.is_floating_point())
    batch_size = asked.batch_size
    if batch_size is None:
        tensor = next(iter_tensors(batch), None)
        batch_size = int(tensor.shape[0]) if tensor is not None and tensor.dim() else None
    return _Chain(
        names=names, options=checked, loss_fn=loss, compiled=compiled,
        tensor_parallel=tensor_parallel,
        identities=[stage_identity(stage_submodule(model, name)) for name in names],
        batch_shapes=tuple(tuple(t.shape) for t in iter_tensors(batch)),
        device=first.device if first is not None else None,
        dtype=dtypes.most_common(1)[0][0] if dtypes else torch.float32,
        batch_size=batch_size,
    )


def _measured(model: nn.Module, batch: Any, loss_fn: LossFn | None,
              stages: Sequence[str] | None, asked: _Asked, *, repeats: int, compile: bool,
              timed: bool) -> Profile:
    """``profile``'s real (not fake) measuring, on arguments it checked."""
    chain = _chain(model, batch, loss_fn, stages, asked, compile)
    progress = asked.progress or _no_progress
    began = time.perf_counter()
    m, comms = _run_steps(model, batch, chain, asked, repeats=repeats, progress=progress,
                          timed=timed, stages_given=stages is not None)
    result = _assembled(model, m, chain, comms, asked.optimizer,
                        description=asked.description, timed=timed,
                        profile_s=time.perf_counter() - began)
    transformers_model = type(model).__module__.startswith("transformers.")
    for note in notes(result, transformers_model=transformers_model):
        warnings.warn(note, stacklevel=4)  # _measured, profile, its wrapper: the caller
    total = len(part_names(chain.options))
    progress("done", total, total)
    return result


def _run_steps(model: nn.Module, batch: Any, chain: _Chain, asked: _Asked, *, repeats: int,
               progress: Progress, timed: bool, stages_given: bool
               ) -> tuple[Measurements, list[Any] | None]:
    """Every measured step of the profile, under a forked RNG and in training mode (both
    put back after); with tensor parallelism, what each stage communicates."""
    on = chain.device
    with ExitStack() as stack:
        devices = [on] if on is not None and on.type == "cuda" else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.callback(model.train, model.training)
        model.train()
        opt = make_optimizer(model, asked.optimizer, lr=asked.lr)
        if chain.compiled:  # compile forward and backward before anything is measured
            with buffers_restored(model):
                checked_loss(model, batch, chain.loss_fn).backward()
            model.zero_grad(set_to_none=True)
        try:
            m = measure_all(
                model,
                batch,
                chain.loss_fn,
                chain.names,
                opt,
                options=chain.options,
                repeats=repeats,
                device=on,
                dtype=chain.dtype,
                progress=progress,
                agree=most_over_ranks if asked.ranks_agree else None,
                timed=timed,
            )
        except StageNotRun as err:
            raise _not_run(model, chain.names, err, given=stages_given) from err
        # tensor parallelism: what each stage communicates, and again in a rebuild
        comms = (_stage_comms(model, batch, chain.loss_fn, chain.names)
                 if chain.tensor_parallel else None)
    return m, comms


def _assembled(model: nn.Module, m: Measurements, chain: _Chain, comms: list[Any] | None,
               optimizer: str | torch.optim.Optimizer, *, description: str | None,
               timed: bool, profile_s: float) -> Profile:
    """The Profile made of the measurements, its twin options merged, its backward
    calibrated and its no-checkpoint peak predicted."""
    post_grads, grads, pre_grads = gradient_owners(model, chain.names, m.spans.post_modules)
    stage_list = [
        replace(s, identity=identity, comms=None if comms is None else comms[i])
        for i, (s, identity) in enumerate(zip(stage_profiles(m, grads), chain.identities,
                                              strict=True))
    ]
    floor = m.overhead.time_s
    residuals = region_overhead_rounds(m.plain_steps, m.per_stage_steps)
    noise = timing_noise(
        m.plain_steps, m.per_stage_steps, m.same_as, extra=m.extra_rounds,
        region_overhead_range_s=(max(floor, min(residuals)), max(floor, max(residuals))),
    )
    # an untimed (fake) step's times are its dispatch's: a region costs what one
    # checkpoint frame measured on the tiny chain costs (host-side, on any device)
    overhead_s = (region_overhead_s(m.plain_steps, m.per_stage_steps, floor) if timed
                  else floor)
    # per round, so that one slow round's step is not set against another's stages
    outside = statistics.median(m.outside_rounds)
    dtype = chain.dtype
    result = Profile(
        model=description or type(model).__name__,
        batch_size=chain.batch_size,
        stages=tuple(stage_list),
        # the loss (its whole storage: CPU mse_loss returns a view of its elementwise
        # losses) and its gradient, a scalar of the model's dtype or float32 above it
        fixed=fixed_bytes(m, stage_list[0].boundary_bytes, post_grads, pre_grads,
                          loss_bytes=m.nosave.loss_storage_bytes + max(dtype.itemsize, 4)),
        region_overhead_s=overhead_s,
        region_link_s=(region_link_s(m.plain_steps, m.per_stage_steps, m.spanning_steps,
                                     m.spanning, ceiling_s=overhead_s - floor)
                       if m.spanning else None),
        region_overhead_bytes=m.overhead.memory_bytes,
        outside_chain_s=max(0.0, outside),
        step_s=float(statistics.median(m.plain_step_s)),
        measured_peak_bytes=m.step.peak_bytes,
        optimizer=optimizer if isinstance(optimizer, str) else type(optimizer).__name__.lower(),
        device=_device_name(chain.device),
        torch_version=str(torch.__version__),
        dtype=str(dtype).removeprefix("torch."),
        profile_s=profile_s,
        model_stages=len(model_stages(model, chain.names)),
        batch_shapes=chain.batch_shapes,
        timing_noise=noise,
        compiled=chain.compiled,
    )
    links = link_s(measured_link_rounds(m), len(chain.names))
    if links is not None:
        result = replace(result, stages=tuple(replace(s, link_s=t) for s, t in
                                              zip(result.stages, links, strict=True)))
    result = merge_twin_options(calibrated(result, m), m)
    result = replace(result, timed_rounds=timed_rounds(m))
    return replace(result, predicted_peak_bytes=predict_no_checkpoint_peak(result))


def _not_run(model: nn.Module, names: Sequence[str], err: StageNotRun, *, given: bool
             ) -> UsageError:
    """Why a stage ran no op in a phase: its parameters frozen, or a discovered stage the
    forward does not run with grad."""
    def trainable(name: str) -> bool:
        return any(p.requires_grad for p in stage_submodule(model, name).parameters())

    own = list(stage_submodule(model, err.stage).parameters())
    if own and not any(p.requires_grad for p in own):
        train = [n for n in names if trainable(n)]
        fix = (f"profile only the stages that train: stages={train} (--stages "
               f"{','.join(train)})" if train else
               "no stage has a parameter that requires grad, so there is nothing to "
               "checkpoint: unfreeze what you train")
        return UsageError(f"stage {err.stage!r} ran no backward op because its parameters are "
                          "frozen (requires_grad=False) and no gradient flows into it, so it "
                          f"saves nothing for backward; {fix}")
    if not given:
        return UsageError(f"{err}, and stage {err.stage!r} was found by stage discovery; pass "
                          "stages= (--stages) listing only the stages that train")
    return err


def _kv_groups(model: nn.Module) -> int:
    """A transformers model's query heads per key/value head (1 without grouping)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or kv_heads < 1 \
            or heads % kv_heads:
        return 1
    return heads // kv_heads


def _sliding_window(model: nn.Module) -> int | None:
    """A transformers model's sliding attention window, if its config sets one in use."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or not getattr(config, "use_sliding_window", True):
        return None
    return window


def _fake_profile(model: nn.Module, batch: Any, loss_fn: LossFn | None,
                  stages: Sequence[str] | None, device: Device | None,
                  padded_batches: bool, asked: _Asked) -> Profile:
    """``profile`` inside the fake mode; a long chain of identical stages by its first 3 and
    4 (Note [Depth under fake tensors] in :mod:`remat.profiling.fake`); on ``device``'s
    kernels (:mod:`remat.profiling.device_kernels`) where it has its own."""
    import remat.profiling.fake as fake_profiles

    loss = loss_fn or default_loss
    optimizer = asked.optimizer
    accelerator = device is not None and device.is_accelerator
    window = None if padded_batches else _sliding_window(model)
    kv_groups = _kv_groups(model)

    def stand_ins(names: Sequence[str], *, counting: bool = False) -> Any:
        if device is None or not accelerator:
            return contextlib.nullcontext()
        return DeviceKernels(device, names, counting=counting,
                             masks_as_causal=not padded_batches, window=window,
                             kv_groups=kv_groups)

    def run(names: Sequence[str]) -> Profile:
        # on an accelerator torch's optimizers default to their multi-tensor kernels,
        # which hold a parameter-sized temporary through the step (AdamW's square roots)
        # where the CPU's per-parameter loop holds one parameter's; made here, after a cut
        # of the chain, so that it holds the cut model's parameters
        def opt() -> str | torch.optim.Optimizer:
            if accelerator and optimizer in ("adamw", "sgd"):
                return make_optimizer(model, optimizer, lr=asked.lr, foreach=True)
            return optimizer

        with stand_ins(names):
            found = replace(profile(model, batch, loss_fn, names, repeats=1, _timed=False,
                                    **asked.again(opt())),
                            fake=True, timing_noise=None, timed_rounds=None)
            if device is None:
                return found
            # times: the roofline's for the device, from the step's counted work (with
            # an optimizer of its own: the profile's has state, which fakes cannot copy)
            work = count_work(model, batch, loss, names, opt())
        kernels = None
        if accelerator:
            with stand_ins(names, counting=True) as counter, torch.no_grad():
                loss(model, batch)  # one forward, to note each attention call's kernel
            kernels = counter.per_stage()
        return replace(with_estimated_times(found, work, device, _tp_ranks(model)),
                       times_estimated=True, device=device.name, kernels=kernels)

    names = (resolve_stages(model, stages) if stages is not None
             else discover_stages(model, batch, loss_fn or default_loss))
    found = (fake_profiles.chain_container(model, names)
             if len(names) >= fake_profiles.MIN_EXPANDED_STAGES else None)
    if found is None:
        return run(names)
    parent, attribute, prefix = found
    cuts = []
    for k in (3, 4):
        with fake_profiles.cut_to(parent, attribute, k):
            cuts.append(run([f"{prefix}.{i}" for i in range(k)]))
    whole = fake_profiles.expanded(cuts[0], cuts[1], len(names), prefix)
    return whole if whole is not None else run(names)


def notes(result: Profile, *, transformers_model: bool = False) -> tuple[str, ...]:
    """Things about the profiled model that make checkpointing free less than planned.

    ``profile`` also issues each as a warning (``use_cache=True`` is warned about by
    ``remat.apply``, which profiling runs). ``transformers_model``: the model is a
    transformers one, whose ``output_hidden_states=True`` is the usual cause of outputs
    the model returns.
    """

    n = len(result.stages)
    returned = [s.name for s in result.stages if s.output_held_through == n]
    during = [
        s.name
        for s in result.stages
        if s.output_held_through is not None and s.output_held_through < n
    ]
    # A profile from before the held-through fields knows only that the output was kept.
    other = [
        s.name
        for s in result.stages
        if s.output_kept_outside and s.name not in returned and s.name not in during
    ]
    found = []
    if returned:
        cause = (
            "output_hidden_states=True returns every layer's output: turn it off for training"
            if transformers_model
            else "return only what the loss needs"
        )
        found.append(
            f"the outputs of stages {first_names(returned)} are still referenced after the model's "
            f"forward returns (in what it returns), so checkpointing them frees less than "
            f"planned ({cause})"
        )
    if during:
        found.append(
            f"the outputs of stages {first_names(during)} stay referenced by the model's own code "
            "while later stages run (a caller holding the input of a container it called, "
            "as nested nn.Sequential calls do, or a skip connection kept for a later block), "
            "so a region frees them only after that; the predicted peak counts it "
            "(docs/cost-model.md, \"Held outside the chain\")"
        )
    if other:
        found.append(
            f"the outputs of stages {first_names(other)} stay referenced outside the chain, so "
            "checkpointing them frees less than planned"
        )
    return tuple(found)


# -- batch scaling -------------------------------------------------------------------------

# Not fitted: bookkeeping, the prediction (recomputed), and the region's fixed cost, a
# residual of a few per-stage steps (or the tiny chain's figure) whose two values differ
# mostly by noise: a line through them would extrapolate the noise.
_NOT_FITTED = frozenset(
    {
        "schema_version",
        "batch_size",
        "predicted_peak_bytes",
        "profile_s",
        "region_overhead_s",
        "region_overhead_bytes",
    }
)


def fit_scaling(first: Profile, second: Profile) -> Scaling:
    """Lines through every quantity of two profiles of one model at two batch sizes."""
    if first.stage_names != second.stage_names:
        raise UsageError(
            "the two profiles have different stages; profile the same model at both sizes"
        )
    n1, n2 = first.batch_size, second.batch_size
    if n1 is None or n2 is None or n1 == n2:
        raise UsageError(
            f"batch sizes {n1} and {n2} cannot be fitted; profile at two different batch sizes"
        )
    y1, y2 = numeric_paths(first.to_dict()), numeric_paths(second.to_dict())
    fits = {
        path: LinearFit.through(n1, y1[path], n2, y2[path])
        for path in y1
        if path in y2
        and path not in _NOT_FITTED
        and not path.startswith(("scaling.", "timing_noise."))
        and ".time_spread." not in path
        and not path.endswith(".same_as")
        and y1[path] != y2[path]
    }
    return Scaling((n1, n2), fits)


def profile_scaling(
    factory: Callable[[int], tuple[nn.Module, Any, LossFn]],
    batch_sizes: Sequence[int],
    stages: Sequence[str] | None = None,
    optimizer: str = "adamw",
    *,
    progress: Progress | None = None,
    **kwargs: Any,
) -> Profile:
    """Profile at two batch sizes and fit every quantity linearly in the batch size.

    ``factory(batch_size)`` returns ``(model, batch, loss_fn)``, a fresh model each time.
    The result is the profile at ``batch_sizes[0]`` with :class:`Scaling` fits through
    both, so ``remat.core.transforms.at_batch_size(result, n)`` predicts other batch sizes.
    Other keyword arguments go to :func:`profile`.
    """
    sizes = list(batch_sizes)
    if len(sizes) != 2 or len(set(sizes)) != 2:
        raise UsageError(f"batch_sizes={batch_sizes!r} must be two different batch sizes")
    report = progress or _no_progress
    found = []
    for k, n in enumerate(sizes):
        model, batch, loss_fn = factory(n)

        def part(what: str, done: int, total: int, k: int = k, n: int = n) -> None:
            report(f"batch {n}: {what}", k * total + done, 2 * total)

        found.append(
            profile(model, batch, loss_fn, stages, optimizer, batch_size=n, progress=part, **kwargs)
        )
        del model, batch, loss_fn
    return replace(found[0], scaling=fit_scaling(found[0], found[1]))
