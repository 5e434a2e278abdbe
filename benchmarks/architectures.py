"""``remat auto`` on the architectures users bring, at 75% and at the minimum it names.

For each model: the stages discovery finds and the share of the activation memory they
cover, then the main job (profile, plan, apply, verify, measure) at ``--budget 75%`` and
at the smallest budget any plan reaches (read from the first run's profile, exactly as
the planning error names it). Per run: the plan, predicted against measured peak (the
live-storage tracker, a whole training step), whether it stayed within the budget,
whether gradients were equal and verify passed, and ``auto``'s verdict (exit 0 or 1).

Models: the built-ins (``resnet``, ``convnext``, ``encdec``, ``unet``, ``gpt``,
``mlp-hetero``, ``convnet-bn``), transformers families from configs (``hf:bert``,
``hf:t5``, ``hf:gpt_neox``, ``hf:mixtral``, ``hf:mamba``, ``hf:llama``) and a diffusers
``UNet2DModel`` (``diffusers-unet``, skipped without diffusers), and three loops with
code between their blocks, written here (``loop-add``: ``x = x + block(x)`` over
LayerNorm-MLP blocks; ``loop-relu-add``: the blocks end in a ReLU; ``loop-gate``:
``x = x * sigmoid(block(x))``). Random weights, nothing downloaded.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/architectures.py [--models resnet unet ...]

Prints a table and writes it to ``benchmarks/architectures.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from remat.benchmarking.main_job import AutoReport, Stopped, auto
from remat.core.coverage import coverage
from remat.core.solve import solvers
from remat.core.solve.from_profile import problem_from_profile

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/architectures.py"
BUILTINS = ["resnet", "convnext", "encdec", "unet", "gpt", "mlp-hetero", "convnet-bn"]
HF = ["hf:bert", "hf:t5", "hf:gpt_neox", "hf:mixtral", "hf:mamba", "hf:llama"]


def diffusers_unet(*, batch_size: int = 4, seed: int = 0) -> tuple[Any, Any, Callable]:
    """A small diffusers UNet2DModel (two levels, attention in the lower one)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(32, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    noisy, noise = torch.randn(batch_size, 3, 16, 16), torch.randn(batch_size, 3, 16, 16)
    t = torch.randint(0, 1000, (batch_size,))

    def loss_fn(m: Any, batch: Any) -> torch.Tensor:
        x, steps, target = batch
        return torch.nn.functional.mse_loss(m(x, steps).sample, target)

    return model, (noisy, t, noise), loss_fn


class _LoopBlock(torch.nn.Module):
    def __init__(self, d: int, relu: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return torch.relu(y) if self.relu else y


class _Loop(torch.nn.Module):
    """A user's loop with code between the blocks: ``x = x + block(x)`` or a gate."""

    def __init__(self, glue: str, relu: bool, d: int = 128, n: int = 6) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(64, d), torch.nn.Linear(d, 10)
        self.blocks = torch.nn.ModuleList(_LoopBlock(d, relu) for _ in range(n))
        self.glue = glue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x) if self.glue == "add" else x * torch.sigmoid(block(x))
        return self.out(x)


def _loop(glue: str, relu: bool) -> Callable[..., Any]:
    def make(*, batch_size: int = 16, seed: int = 0) -> tuple[Any, Any, Callable]:
        torch.manual_seed(seed)
        batch = torch.randn(batch_size, 128, 64), torch.randint(0, 10, (batch_size, 128))

        def loss_fn(m: Any, b: Any) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

        return _Loop(glue, relu), batch, loss_fn

    return make


EXTRA: dict[str, Callable[..., Any]] = {
    "diffusers-unet": diffusers_unet,
    "loop-add": _loop("add", relu=False),
    "loop-relu-add": _loop("add", relu=True),
    "loop-gate": _loop("gate", relu=False),
}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _plan_text(report: AutoReport) -> str:
    plan = report.plan
    regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) or "none"
    counts: dict[str, int] = {}
    for o in plan.options:
        counts[o.removeprefix("selective:")] = counts.get(o.removeprefix("selective:"), 0) + 1
    return f"{regions}; " + ", ".join(f"{o} x{c}" for o, c in counts.items())


def _row(name: str, budget: str, report: AutoReport) -> str:
    err = 100 * (report.measured_peak_bytes - report.predicted_peak_bytes) / max(
        1, report.predicted_peak_bytes)
    return (
        f"| `{name}` | {budget} ({_mib(report.budget_bytes)}) | {_plan_text(report)} | "
        f"{_mib(report.baseline_peak_bytes)} | {_mib(report.predicted_peak_bytes)} | "
        f"{_mib(report.measured_peak_bytes)} ({err:+.2f}%) | "
        f"{'yes' if report.within_budget else 'NO'} | "
        f"{'equal' if report.grads_match else 'DIFFER'}, verify "
        f"{'passed' if report.verify_ok else 'FAILED'} | {0 if report.ok else 1} |"
    )


def run_model(name: str, repeats: int) -> tuple[list[str], str]:
    target: Any = EXTRA.get(name, name)
    kwargs: dict[str, Any] = {"repeats": repeats, "verify_steps": 2, "threads": 1}
    rows: list[str] = []
    try:
        first = auto(target, budget="75%", **kwargs)
    except Stopped as err:
        return [f"| `{name}` | 75% | stopped: {err} | | | | | | {err.exit_code} |"], ""
    assert first.profile is not None
    cov = coverage(first.profile)
    chain = (f"| `{name}` | {len(cov.stages)}: `{cov.stages[0]}` .. `{cov.stages[-1]}` | "
             f"{100 * cov.share:.0f}% |")
    rows.append(_row(name, "75%", first))
    least = solvers.minimum_budget(problem_from_profile(first.profile))
    try:
        rows.append(_row(name, "minimum", auto(target, budget=least, **kwargs)))
    except Stopped as err:
        rows.append(f"| `{name}` | minimum ({_mib(least)}) | stopped: {err} | | | | | | "
                    f"{err.exit_code} |")
    return rows, chain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*BUILTINS, *HF, *EXTRA])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = parser.parse_args(argv)
    default_out = str(Path(__file__).with_suffix(".md"))
    out_flag = "" if args.out == default_out else f" --out {args.out}"
    chains = ["| model | stages found | covered |", "| --- | --- | --- |"]
    runs = ["| model | budget (MiB) | plan | no checkpointing | predicted | measured | "
            "within budget | gradients | exit |", "| --- | --- | --- | --- | --- | --- | --- | "
            "--- | --- |"]
    started = time.time()
    for name in args.models:
        t0 = time.time()
        try:
            rows, chain = run_model(name, args.repeats)
        except ImportError as err:
            rows, chain = [f"| `{name}` | skipped: {err} | | | | | | | |"], ""
        except Exception as err:  # a benchmark records failures, it does not stop at one
            traceback.print_exc()
            failed = f"failed: {type(err).__name__}: {err}"
            rows, chain = [f"| `{name}` | {failed} | | | | | | | 1 |"], ""
        if chain:
            chains.append(chain)
        runs += rows
        print("\n".join(rows), f"({time.time() - t0:.0f} s)", flush=True)
    text = "\n".join([
        "# remat auto on the architectures users bring",
        "",
        f"Command: `{COMMAND} --models {' '.join(args.models)}{out_flag}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch "
        f"{torch.__version__}, Python {platform.python_version()}; one thread, "
        f"{args.repeats} timed steps; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{(time.time() - started) / 60:.0f} min. Peaks in MiB, measured by the live-storage "
        "tracker over a whole training step; 'minimum' is the smallest budget any plan "
        "reaches, as the planning error names it.",
        "",
        *chains,
        "",
        *runs,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
