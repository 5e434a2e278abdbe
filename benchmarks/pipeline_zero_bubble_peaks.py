"""Each rank's peak under torch's zero-bubble schedules: predicted against measured.

Run from the repository root (spawns the gloo processes itself)::

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_zero_bubble_peaks.py \\
        [--ranks 2] [--microbatches 4 8] [--model gpt|llama] [--out FILE]

remat's gpt (2 blocks per stage, hidden 64, sequence 32, batch 32, no dropout;
``remat.models.gpt.GPTPart``) or transformers' ``LlamaForCausalLM`` (``hf:llama``'s
config, one decoder layer per stage, batch 8; :class:`LlamaPart`) over ``--ranks`` gloo
processes with two stages each, under
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``,
with no plan, with a region per block on every stage, with
``selective:save-matmuls`` on every block (no region), and with
:func:`remat.core.zero_bubble.plan_split_pipeline`'s per-stage plans at a budget halfway
between the per-block plan's largest predicted rank peak and no plan's largest (all with
``split_backward=True``).
Predicted: :func:`remat.core.zero_bubble.split_pipeline_step` from every stage's
profile (``remat.parallel.pipeline.profile_part``), its two passes measured once without a plan
(``split_figures``), what the schedule keeps for it (``schedule_buffers``) and the
schedule's own order (``schedule_orders``). Measured: the live-storage tracker over a
schedule step and an AdamW step after one warm-up step (``rank_step_peak``). Rank 0
prints the table and writes it to ``--out`` (markdown) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

BLOCKS_PER_STAGE = 2
OPTS = {"n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32, "dropout": 0.0}
SCHEDULES = {"ScheduleInterleavedZeroBubble": "interleaved-zero-bubble",
             "ScheduleZBVZeroBubble": "zbv-zero-bubble", "ScheduleDualPipeV": "dualpipev"}
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
PLANS = ("none", "a region per block", "save-matmuls", "remat")


class LlamaPart(torch.nn.Module):
    """Pipeline stage ``stage`` of ``stages`` of a transformers ``LlamaForCausalLM``: the
    embedding on the first, its share of the decoder layers, the norm and head on the
    last (a manual split, as ``GPTPart``); the rotary embedding is computed on each."""

    def __init__(self, model: Any, stage: int, stages: int) -> None:
        super().__init__()
        inner = model.model
        n = len(inner.layers)
        lo, hi = stage * n // stages, (stage + 1) * n // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.embed_tokens = inner.embed_tokens
        self.layers = torch.nn.ModuleList(inner.layers[lo:hi])
        self.rotary_emb = inner.rotary_emb
        if self.last:
            self.norm, self.lm_head = inner.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = self.rotary_emb(x, positions)
        for layer in self.layers:
            out = layer(x, position_embeddings=rotary)
            x = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.norm(x)) if self.last else x


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def _model(kind: str, stages: int) -> tuple[Any, Any, Any, Any, int, Any]:
    """``(model, ids, target, part(model, stage, stages), hidden size, loss)``."""
    if kind == "llama":
        from remat.models import load_model

        model, batch, _ = load_model("hf:llama", batch_size=8, num_hidden_layers=stages)
        return (model, batch["input_ids"], batch["labels"], LlamaPart,
                model.config.hidden_size, _next_token_loss)
    from remat.models.gpt import GPTPart, gpt, logits_loss

    model, (idx, target), _ = gpt(**{**OPTS, "n_layer": stages * BLOCKS_PER_STAGE})
    return model, idx, target, GPTPart, OPTS["n_embd"], logits_loss
ROUNDS = 7  # interleaved timed steps per configuration


def _describe(plan: Any) -> str:
    """A stage's plan in a cell: its regions, and its options other than keep."""
    options = sorted({str(o) for o in plan.parsed_options if not o.is_keep})
    return " ".join([*(str(r) for r in plan.regions), *options]) or "-"


def _blocks(part: Any) -> tuple[str, ...]:
    """The part's blocks as module paths: its stages."""
    name = "blocks" if hasattr(part, "blocks") else "layers"
    return tuple(f"{name}.{i}" for i in range(len(getattr(part, name))))


def _rank(rank: int, world: int, store: str, out: str, counts: list[int], kind: str) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from remat.core.plan_format import Plan, Region
    from remat.core.solve.problem import Problem
    from remat.core.zero_bubble import plan_split_pipeline, split_pipeline_step
    from remat.parallel.pipeline import apply_to_stage, rank_step_peak, schedule_orders, split_stage
    from remat.runtime.install import applied, remove

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    n = 2 * world
    rows = []
    for micro in counts:
        for name, core_name in SCHEDULES.items():
            ids = [rank, n - 1 - rank] if name in V_SHAPED else [rank, rank + world]
            model, idx, target, part_of, hidden, loss = _model(kind, n)
            mb = idx.shape[0] // micro
            mine = {}
            for s in ids:  # each stage's problem, buffers and two passes, once
                part = part_of(model, s, n)
                torch.manual_seed(1)
                x = (idx[:mb] if part.first else
                     torch.randn(mb, idx.shape[1], hidden, requires_grad=True))
                problem, buffers, split = split_stage(
                    part, x, schedule=core_name, microbatches=micro, first=part.first,
                    last=part.last, prev_on_rank=s - 1 in ids, next_on_rank=s + 1 in ids,
                    loss_fn=loss, target=target[:mb],
                    stages=_blocks(part), repeats=1)
                mine[s] = (problem.to_dict(), buffers, split)
            shared: list[Any] = [None] * world
            dist.all_gather_object(shared, mine)
            every = {s: v for d in shared for s, v in d.items()}
            problems = [Problem.from_dict(every[s][0]) for s in range(n)]
            buffers_all = [every[s][1] for s in range(n)]
            splits = [every[s][2] for s in range(n)]
            variants: dict[str, list[Plan]] = {
                "none": [Plan(p.stage_names) for p in problems],
                "a region per block": [Plan(p.stage_names, tuple(
                    Region(i, i + 1) for i in range(p.n))) for p in problems],
                "save-matmuls": [Plan(p.stage_names, (), options=(
                    "selective:save-matmuls",) * p.n) for p in problems]}
            budget = 0
            steps: dict[str, Any] = {}
            applied_parts: list[Any] = []
            for label in PLANS:
                model, idx, target, _, _, _ = _model(kind, n)  # fresh: profiling stepped
                parts = [part_of(model, s, n) for s in ids]
                stages = [pipelining.PipelineStage(part, s, n, torch.device("cpu"))
                          for s, part in zip(ids, parts, strict=True)]
                schedule = getattr(pipelining, name)(stages, n_microbatches=micro,
                                                     loss_fn=loss)
                orders = schedule_orders(schedule)
                if label == "remat":
                    # halfway between per-block's largest rank and no plan's largest
                    plain = split_pipeline_step(variants["none"], problems, splits, orders,
                                                buffers_all)[0]
                    uniform = split_pipeline_step(variants["a region per block"], problems,
                                                  splits, orders, buffers_all)[0]
                    budget = (max(uniform.values()) + max(plain.values())) // 2
                    variants[label] = plan_split_pipeline(problems, splits, orders, budget,
                                                          buffers_all)[0]
                plans = variants[label]
                for stage, s in zip(stages, ids, strict=True):
                    if not plans[s].checkpoints_nothing:
                        apply_to_stage(stage, plans[s], split_backward=True)
                peaks, step_s = split_pipeline_step(plans, problems, splits, orders,
                                                    buffers_all)
                opt = torch.optim.AdamW([q for p in parts for q in p.parameters()], lr=1e-3)
                first, last = any(p.first for p in parts), any(p.last for p in parts)

                def step(schedule: Any = schedule, first: bool = first, last: bool = last,
                         idx: Any = idx, target: Any = target, opt: Any = opt) -> None:
                    kwargs = {"target": target, "losses": []} if last else {}
                    if first:
                        schedule.step(idx, **kwargs)
                    else:
                        schedule.step(**kwargs)
                    opt.step()

                step()
                measured, _ = rank_step_peak(step, parts, stages, held=[idx, target],
                                             optimizer=opt)
                steps[label] = step
                applied_parts += parts
                rows.append({"microbatches": micro, "schedule": name, "plan": label,
                             "regions": " / ".join(_describe(plans[s]) for s in ids),
                             "budget": budget if label == "remat" else None,
                             "measured": measured, "predicted": peaks[rank],
                             "step_s": step_s, "times": []})
            # measured steps: the three plans interleaved, started on every rank at once
            for _ in range(ROUNDS):
                for k, label in enumerate(PLANS):
                    dist.barrier()
                    t0 = time.perf_counter()
                    steps[label]()
                    rows[-len(PLANS) + k]["times"].append(time.perf_counter() - t0)
            for part in applied_parts:
                if applied(part):
                    remove(part)
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="remat's gpt (2 blocks a stage) or transformers' LlamaForCausalLM "
                             "(hf:llama, one decoder layer a stage)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_rank, args=(args.ranks, os.path.join(rendezvous, "store"), out,
                              args.microbatches, args.model), nprocs=args.ranks)
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    lines = ["| schedule | micro-batches | plan | rank | regions, options (its stages) | "
             "predicted (MB) | measured (MB) | error | within budget | predicted step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for i, row in enumerate(ranks[0]):
        for r, rows in enumerate(ranks):
            x = rows[i]
            error = x["predicted"] / x["measured"] - 1
            worst = max(worst, abs(error))
            fits = "" if x["budget"] is None else (
                f"{x['budget'] / 1e6:.2f}: {'yes' if x['measured'] <= x['budget'] else 'NO'}")
            lines.append(f"| {row['schedule']} | {row['microbatches']} | {row['plan']} | "
                         f"{r} | {x['regions']} | {x['predicted'] / 1e6:.2f} | "
                         f"{x['measured'] / 1e6:.2f} | {error:+.1%} | {fits} | "
                         f"{x['step_s'] * 1e3:.1f} ms |")
    lines.append(f"\nLargest error: {worst:.1%}.")
    lines += ["", f"Step time, {ROUNDS} interleaved rounds, the slowest rank's per round: "
              "the median step, the predicted one, and each plan's ratio to per-block's "
              "(measured: the median of the per-round ratios).", "",
              "| schedule | micro-batches | plan | measured step (ms) | predicted step (ms) | "
              "measured ratio | predicted ratio |", "|---|---|---|---|---|---|---|"]
    for i in range(0, len(ranks[0]), len(PLANS)):
        slowest = [[max(ts) for ts in zip(*(rows[i + k]["times"] for rows in ranks),
                                          strict=True)] for k in range(len(PLANS))]
        uniform = slowest[PLANS.index("a region per block")]
        for k, label in enumerate(PLANS):
            row = ranks[0][i + k]
            ratio = statistics.median(t / u for t, u in zip(slowest[k], uniform, strict=True))
            predicted = row["step_s"] / ranks[0][i + PLANS.index("a region per block")]["step_s"]
            lines.append(f"| {row['schedule']} | {row['microbatches']} | {label} | "
                         f"{statistics.median(slowest[k]) * 1e3:.1f} | "
                         f"{row['step_s'] * 1e3:.1f} | {ratio:.2f} | {predicted:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
