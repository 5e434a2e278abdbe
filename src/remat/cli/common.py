"""Options and steps several subcommands share: naming a model, profiling it with a bar."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remat.core.errors import UsageError
from remat.core.units import first_names

if TYPE_CHECKING:
    from remat.core.profile_format import Profile


def add_model_options(p: argparse.ArgumentParser, *, default: str | None = "gpt") -> None:
    p.add_argument(
        "--model",
        default=default,
        help=(
            "gpt, mlp-hetero, convnet-bn, resnet, convnext, encdec, unet, hf:gpt2, hf:llama, "
            "hf:<model_type> "
            "(transformers from a config, random weights; pip install 'remat[hf]') "
            "or package.module:factory" + (f" (default {default})" if default else "")
        ),
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a model option, e.g. --set n_layer=4; for hf: models a config field, e.g. "
            "--set num_hidden_layers=8 (repeatable)"
        ),
    )
    p.add_argument("--batch-size", type=int, default=None, help="the model's batch_size option")
    p.add_argument(
        "--stages",
        default=None,
        metavar="PATH,...",
        help="module paths of the stages, comma-separated (default: discovered)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help=(
            "compile each stage's forward with torch.compile (inductor) and measure, plan "
            "and run the compiled program (docs/compile.md)"
        ),
    )
    p.add_argument(
        "--malloc",
        choices=("keep", "system"),
        default="keep",
        help=(
            "keep: glibc keeps freed memory for reuse, which steadies CPU step times "
            "(docs/bench.md); system: leave the C allocator alone (default keep)"
        ),
    )


def add_optimizer_option(p: argparse.ArgumentParser, *, help: str | None = None) -> None:
    from remat.core.profile_format import OPTIMIZERS

    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help=help or "default adamw; adamw-fused: its fused kernel, no temporaries")


def stage_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    stages = [s.strip() for s in text.split(",")]
    if not all(stages):
        raise UsageError(
            f"--stages {text!r} has an empty entry; give module paths separated by commas, "
            "e.g. --stages blocks.0,blocks.1"
        )
    return stages


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The factory options from ``--set`` and ``--batch-size``."""
    from remat.models import parse_set_options

    options = parse_set_options(args.sets)
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UsageError(f"--batch-size {args.batch_size} is below 1; give 1 or more")
        options["batch_size"] = args.batch_size
    return options


def describe(spec: str, options: dict[str, Any]) -> str:
    return " ".join([spec, *(f"{k}={v}" for k, v in options.items())])


MAX_THREADS = 1024


def runs_one_thread(threads: int | None = None) -> bool:
    """Whether torch runs (or the run ran, under ``--threads``) on one intra-op thread."""
    import torch

    return threads == 1 or (threads is None and torch.get_num_threads() == 1)


def torchrun_rank(distributed: str | None, command: str) -> int | None:
    """This process's rank under ``--distributed`` (None without it); a usage error when
    torchrun did not start it."""
    if distributed is None:
        return None
    from remat.parallel.ranks import env_rank

    info = env_rank()
    if info is None:
        raise UsageError(
            "--distributed needs the RANK and WORLD_SIZE torchrun sets; run torchrun "
            f"--nproc-per-node 2 -m remat {command} ... --distributed {distributed}"
        )
    return info.rank


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads} is below 1; give 1 or more")
    if threads is not None and threads > MAX_THREADS:
        raise UsageError(f"--threads {threads} is above {MAX_THREADS}; give at most the cores "
                         "you have")


def load(
    args: argparse.Namespace, *, check_step: bool = True
) -> tuple[Any, Any, Any, list[str] | None, str]:
    """``(model, batch, loss_fn, stages, description)`` from the model options.

    A factory that raises, or (``check_step``) a model whose plain training step fails
    (forward, ``loss_fn``, backward, a loss that is not a scalar), is the user's code
    failing: one line naming the step, exit 3. The step leaves the parameters as they
    were, not what the forward changed (batch-norm statistics, Python-side state). A
    transformers model's key/value cache is switched off for training, with a note.
    """
    from remat.benchmarking.stopping import first_step, step
    from remat.models import load_model
    from remat.runtime.install import cache_off_for_training
    from remat.runtime.stages import resolve_stages

    options = model_options(args)
    with step("loading the model"):
        model, batch, loss_fn = load_model(args.model, **options)
    cache_off_for_training(model)
    if check_step:
        first_step(model, batch, loss_fn)
    stages = stage_list(args.stages)
    if stages is not None:
        resolve_stages(model, stages)  # a wrong path fails before any measuring
    if getattr(args, "compile", False):
        from remat.runtime.compiled_stages import compile_stages
        from remat.runtime.stages import discover_stages

        with step("compiling the stages"):
            compile_stages(model, stages or discover_stages(model, batch, loss_fn))
    return model, batch, loss_fn, stages, describe(args.model, options)


def add_fake_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fake",
        action="store_true",
        help=(
            "build the model and batch as fake tensors (no weights allocated, no kernel "
            "runs) and profile its memory, as exact as a real profile; times are not the "
            "machine's (docs/fake.md)"
        ),
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="NAME",
        help=(
            "with --fake: size the step for this device (h100-sxm, h200, a100-80gb, "
            "mi300x, cpu, or one remat calibrate added): its attention and dropout kernels "
            "keep what they keep there (docs/fake.md)"
        ),
    )

    p.add_argument(
        "--padded-batches",
        action="store_true",
        help=(
            "with --device: the real batches have padding, so transformers' attention "
            "masks stay masks on the device (by default a causal mask runs as is_causal, "
            "as transformers runs an unpadded batch there; docs/fake.md)"
        ),
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help=(
            "with --fake: build the model with this default dtype (parameters, gradients "
            "and optimizer state in it too: pure 16-bit training)"
        ),
    )


def fake_device(args: argparse.Namespace) -> Any:
    """The ``--device`` named, checked: None without it; UsageError without ``--fake``."""
    name = getattr(args, "device", None)
    if name is None:
        return None
    if not getattr(args, "fake", False):
        raise UsageError("--device sizes the step for another device and needs --fake (a "
                         "real profile measures this machine)")
    from remat.core.devices import get_device

    return get_device(name)


def device_note(device: Any) -> str | None:
    """The note a command prints when ``--device`` names an entry of the user's device
    table (``remat calibrate`` wrote it), not a built-in one; None otherwise."""
    if device is None:
        return None
    from remat.core.devices import source_note

    return source_note(device)


def padded_batches(args: argparse.Namespace) -> bool:
    """``--padded-batches``, checked: it needs ``--device`` of an accelerator."""
    padded = bool(getattr(args, "padded_batches", False))
    if padded:
        target = fake_device(args)
        if target is None or not target.is_accelerator:
            raise UsageError("--padded-batches says how an accelerator's attention runs and "
                             "needs --fake --device NAME of an accelerator")
    return padded


def kernel_lines(result: Profile) -> list[str]:
    """What a fake profile for a device assumed its attention calls ran, in one line."""
    if result.kernels is None:
        return []
    by_kernel: dict[str, list[str]] = {}
    for stage, calls in result.kernels.items():
        for kernel, n in calls.items():
            by_kernel.setdefault(kernel, []).append(f"{stage} x{n}" if n > 1 else stage)
    if not by_kernel:
        return [f"device {result.device}: no attention calls; dropout keeps a 1-byte mask"]
    parts = [f"{kernel} in {first_names(stages)}" for kernel, stages in by_kernel.items()]
    return [f"device {result.device}: attention assumed to run {'; '.join(parts)} "
            "(keeps its output and log-sum-exp, no S x S matrix; docs/fake.md)"]


def load_for_profile(
    args: argparse.Namespace,
) -> tuple[Any, Any, Any, list[str] | None, str]:
    """:func:`load`, under :func:`remat.fake_mode` with ``--fake`` (then no compiling)."""
    if not getattr(args, "fake", False):
        if getattr(args, "dtype", None) is not None:
            raise UsageError("--dtype builds a fake model in that dtype and needs --fake; a "
                             "real model's dtype is its factory's")
        return load(args)
    if getattr(args, "compile", False):
        raise UsageError("--fake and --compile do not go together: a fake profile runs no "
                         "compiled code")
    import torch

    from remat.profiling.fake import fake_mode

    dtype = getattr(args, "dtype", None)
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(getattr(torch, dtype))
    try:
        with fake_mode():  # only the building: the profile enters the mode itself
            model, batch, loss_fn, stages, description = load(args)
    finally:
        torch.set_default_dtype(before)
    return model, batch, loss_fn, stages, description + " (fake)"


def profile_with_progress(
    model: Any,
    batch: Any,
    loss_fn: Any,
    stages: list[str] | None,
    *,
    optimizer: str = "adamw",
    repeats: int = 2,
    description: str | None = None,
    malloc: str = "keep",
    fresh: Callable[[], tuple[Any, Any, Any]] | None = None,
    fake: bool = False,
    device: Any = None,
    padded_batches: bool = False,
) -> Profile:
    """``remat.profile`` with a progress bar on stderr (shown only on a terminal).

    A rebuild torch rejects stops it with the hazard ``remat verify`` finds on a fresh
    ``(model, batch, loss_fn)`` from ``fresh()`` (default: the profiled model itself).
    """
    from remat.benchmarking.stopping import hazard_reason, step
    from remat.cli.progress import progress_bar
    from remat.measure.malloc import set_malloc
    from remat.profiling.profiler import profile

    if repeats < 1:
        raise UsageError(f"--repeats {repeats} is below 1; give 1 or more")
    set_malloc(malloc)

    def diagnose(err: BaseException) -> str:
        # verify copies the model it is given, if what profiling left in it allows
        return hazard_reason(err, fresh or (lambda: (model, batch, loss_fn)), stages)

    with progress_bar("profiling") as progress, step("profiling", diagnose=diagnose):
        return profile(
            model,
            batch,
            loss_fn,
            stages,
            optimizer,
            repeats=repeats,
            description=description,
            progress=progress,
            fake=fake,
            device=device,
            padded_batches=padded_batches,
        )
