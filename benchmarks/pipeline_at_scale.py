"""Pipeline plans at scale, on paper: a 32-layer model over 4 and 8 ranks, 1F1B.

Every rank's part of a GPT-shaped model (remat's gpt: 32 blocks, hidden 4096, 32 heads,
vocabulary 32000, sequence 4096, bfloat16) is built under ``remat.fake_mode()`` and
profiled without weights for a device of the table (``remat.parallel.pipeline.profile_part``
with ``fake=True, device=...``: memory exact, times from the device's roofline); the
middle ranks' parts are identical, so one is profiled for all. Per rank count and
micro-batch count: every rank per-block (uniform full recompute, what Megatron and
torchtitan apply today), every rank without checkpointing, and remat's per-rank plans
(``remat.core.pipeline.plan_pipeline``) under the per-rank budget; each rank's
predicted peak and the pipeline's predicted step time.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_at_scale.py \\
        [--ranks 4 8] [--microbatches 8 32] [--micro-batch-size 4] [--device h100-sxm] \\
        [--budget-gib 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

import remat
from remat.core.errors import CheckFailed
from remat.core.pipeline import ScheduleBuffers, pipeline_step, plan_pipeline
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve.problem import Problem
from remat.models.gpt import GPTPart, gpt, logits_loss
from remat.parallel.pipeline import profile_part, schedule_buffers

MODEL = {"n_layer": 32, "n_embd": 4096, "n_head": 32, "block_size": 4096, "vocab_size": 32000,
         "dropout": 0.0}
GIB = 2**30


def rank_problems(ranks: int, micro_batch: int, microbatches: int, device: str
                  ) -> tuple[list[Problem], list[ScheduleBuffers]]:
    """Every rank's one-micro-batch problem and the stage's buffers (1F1B)."""
    found: dict[str, tuple[Problem, ScheduleBuffers]] = {}
    out_p, out_b = [], []
    for r in range(ranks):
        kind = "first" if r == 0 else "last" if r == ranks - 1 else "middle"
        if kind not in found:
            with remat.fake_mode():
                model, (idx, target), _ = gpt(**MODEL, batch_size=micro_batch)
                part = GPTPart(model, r, ranks)
                x = (idx if part.first else torch.randn(
                    micro_batch, MODEL["block_size"], MODEL["n_embd"], requires_grad=True))
            names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
            prof = profile_part(part, x, last=part.last, loss_fn=logits_loss, target=target,
                                stages=names, fake=True, device=device)
            buffers = schedule_buffers(prof, part, x, schedule="1f1b", microbatches=microbatches,
                                       first=part.first, last=part.last)
            found[kind] = (to_problem(prof), buffers)
        out_p.append(found[kind][0])
        out_b.append(found[kind][1])
    return out_p, out_b


def _plans(problems: list[Problem], kind: str) -> list[Plan]:
    if kind == "none":
        return [Plan(p.stage_names) for p in problems]
    return [Plan(p.stage_names, tuple(Region(i, i + 1) for i in range(p.n))) for p in problems]


def _label(plan: Plan) -> str:
    """How many stages the plan's outermost regions rebuild, and its selective stages."""
    rebuilt = sum(r.stop - r.start for r in plan.regions if
                  not any(q.start <= r.start and r.stop <= q.stop and q != r
                          for q in plan.regions))
    options = sum(not o.is_keep for o in plan.parsed_options)
    parts = [f"{rebuilt}/{len(plan.stages)} in regions" if plan.regions else "no regions"]
    if options:
        parts.append(f"{options} selective")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    budget = int(args.budget_gib * GIB)
    began = time.perf_counter()
    lines = [
        f"Model: remat's gpt {MODEL}, micro-batch {args.micro_batch_size} x sequence "
        f"{MODEL['block_size']}, bfloat16, AdamW; device `{args.device}` (times from its "
        f"roofline); 1F1B; per-rank budget {args.budget_gib:g} GiB. Peaks are per rank, "
        "first to last; the step is the pipeline's, predicted.",
        "",
        "| ranks | micro-batches | plan | per rank (first .. last) | peaks (GiB) | fits | "
        "step (s) | vs uniform |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ranks in args.ranks:
        for micro in args.microbatches:
            problems, buffers = rank_problems(ranks, args.micro_batch_size, micro, args.device)
            rows: list[tuple[str, list[Plan], Any]] = []
            for kind in ("per-block", "none"):
                plans = _plans(problems, kind)
                rows.append((kind, plans, pipeline_step(plans, problems, "1f1b", micro,
                                                        buffers=buffers)))
            failed = None
            try:
                plans, step = plan_pipeline(problems, budget, "1f1b", micro, buffers=buffers)
                rows.append(("remat", plans, step))
            except CheckFailed as err:
                failed = str(err)
            uniform = rows[0][2].step_s
            for kind, plans, step in rows:
                labels = [_label(p) for p in plans]
                label = labels[0] if len(set(labels)) == 1 else " / ".join(labels)
                peaks = " ".join(f"{b / GIB:.1f}" for b in step.peaks)
                fits = "yes" if max(step.peaks) <= budget else "no"
                lines.append(f"| {ranks} | {micro} | {kind} | {label} | {peaks} | "
                             f"{fits} | {step.step_s:.2f} | {step.step_s / uniform:.3f} |")
            if failed is not None:
                lines.append(f"| {ranks} | {micro} | remat | {failed} | | no | | |")
    lines += ["", f"({time.perf_counter() - began:.0f} s on this CPU.)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
