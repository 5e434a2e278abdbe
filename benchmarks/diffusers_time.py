"""Step-time overhead on diffusers UNets, predicted against measured: the mid block's
attention as a stage (what discovery finds) and as code between two stages.

diffusers' mid block runs ``resnets[0]``, ``attentions[0]``, ``resnets[1]``. Discovery
makes the attention a stage (docs/stages.md, rule 5); before it did, the attention was
code between two stages, which a region spanning them records and replays call by call,
at a cost the profile prices as an average link (``region_link_s``). Each row is one
``remat auto`` run (profile, plan, verify, measure; one thread) on the chain named: the
plan it chose, its predicted and measured peak, and its predicted and measured overhead
(the median of interleaved per-pair step ratios, as ``remat auto`` reports it).

Models (random weights, nothing downloaded): ``unet2d``, a ``UNet2DModel`` (blocks of 16
and 32 channels, one resnet a block, attention in the lower level, 16 x 16 images, 4 of
them), and ``unet2d-cond``, a ``UNet2DConditionModel`` (the same levels with
cross-attention to 8 tokens of a 32-wide context, latents of 4 channels, 2 of them).

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/diffusers_time.py [--runs 2]

Prints a table and writes it to ``benchmarks/diffusers_time.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from remat.benchmarking.main_job import auto
from remat.runtime.stages import discover_stages

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/diffusers_time.py"
ATTENTION = "mid_block.attentions.0"


def unet2d(*, batch_size: int = 4) -> tuple[Any, Any, Callable[..., Any]]:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    x, t = torch.randn(batch_size, 3, 16, 16), torch.randint(0, 1000, (batch_size,))
    return model, (x, t), lambda m, b: m(b[0], b[1]).sample.pow(2).mean()


def unet2d_cond(*, batch_size: int = 2) -> tuple[Any, Any, Callable[..., Any]]:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
    )
    x, t = torch.randn(batch_size, 4, 16, 16), torch.randint(0, 1000, (batch_size,))
    ctx = torch.randn(batch_size, 8, 32)
    return model, (x, t, ctx), lambda m, b: m(b[0], b[1], encoder_hidden_states=b[2]
                                             ).sample.pow(2).mean()


MODELS = {"unet2d": unet2d, "unet2d-cond": unet2d_cond}


def _regions(report: Any) -> str:
    regions = " ".join(f"[{r.start},{r.stop})" for r in report.plan.regions) or "none"
    options = [o for o in report.plan.options if o != "keep"]
    return regions + (f"; {len(options)} selective" if options else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--budgets", nargs="+", default=["75%", "65%"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = parser.parse_args()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.perf_counter()
    rows = ["| model | attention | stages | budget | run | plan | peak predicted / measured "
            "(MiB) | overhead predicted | measured | gap (pts) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    gaps: dict[str, list[float]] = {"stage": [], "glue": []}
    for name in args.models:
        factory = MODELS[name]
        found = discover_stages(*factory())
        chains = {"stage": found, "glue": [s for s in found if s != ATTENTION]}
        for run in range(1, args.runs + 1):
            for budget in args.budgets:
                for as_what, stages in chains.items():  # interleaved: the machine drifts
                    r = auto(factory, stages=stages, budget=budget, threads=1)
                    predicted = 100 * (r.predicted_overhead or 0.0)
                    gap = 100 * r.overhead - predicted
                    gaps[as_what].append(gap)
                    rows.append(
                        f"| {name} | {as_what} | {len(stages)} | {budget} | {run} "
                        f"| {_regions(r)} | {r.predicted_peak_bytes / 2**20:.2f} / "
                        f"{r.measured_peak_bytes / 2**20:.2f} | {predicted:+.1f}% "
                        f"| {100 * r.overhead:+.1f}% | {gap:+.1f} |")
                    print(rows[-1], flush=True)
    summary = [f"- attention as {k}: measured less predicted overhead, median "
               f"{sorted(v)[len(v) // 2]:+.1f} points, range {min(v):+.1f} to {max(v):+.1f} "
               f"over {len(v)} runs" for k, v in gaps.items() if v]
    text = "\n".join([
        "# Overhead on diffusers UNets: the mid-block attention as a stage and as glue",
        "",
        f"Command: `{COMMAND} --runs {args.runs} --budgets {' '.join(args.budgets)}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch "
        f"{torch.__version__}, Python {platform.python_version()}; one thread; {began}, "
        f"{(time.perf_counter() - t0) / 60:.0f} min. Each row one `remat auto` run; "
        "'glue' runs name the discovered chain without `mid_block.attentions.0`.",
        "",
        *rows,
        "",
        *summary,
        "",
    ])
    Path(args.out).write_text(text)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
