"""Regions under torch's zero-bubble schedules: does checkpointing lower a rank's peak?

Run from the repository root (spawns 2 gloo processes itself)::

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_zero_bubble.py [--out FILE]

remat's gpt (4 blocks, hidden 64, sequence 32, batch 32, no dropout) over 2 ranks x 2
chunks (4 virtual stages, ``remat.models.gpt.GPTPart``), 4 micro-batches; per schedule
(``ScheduleInterleaved1F1B`` for reference, then ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, the last two placing chunks in a
V), one step with no plan, one with a region per block on every chunk applied as
usual (torch's frame), and one with the same regions applied with
``split_backward=True`` (one rebuild for all of a backward's passes). Each rank's
peak is the live-storage tracker's over the second ``schedule.step`` (the first warms
up); the gradients of the planned runs are compared with the plain run's. Rank 0 prints
the table and writes it to ``--out`` (markdown) when given. Why the zero-bubble peaks
rise with torch's frame: Note [Backward in passes] in ``remat/runtime/engine.py``; what
``split_backward`` changes: Note [One rebuild for a backward in passes] in
``remat/runtime/rebuild_once.py``.
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

WORLD, MICRO = 2, 4
OPTS = {"n_layer": 4, "n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32,
        "dropout": 0.0}
SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
ROUNDS = 7  # interleaved timed steps per run
PLANS = ("none", "torch", "once")  # no plan; regions with torch's frame; split_backward


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from remat.core.plan_format import Plan, Region
    from remat.models.gpt import GPTPart, gpt, logits_loss
    from remat.parallel.pipeline import apply_to_stage, rank_step_peak
    from remat.runtime.install import remove

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    rows: list[dict[str, Any]] = []
    for name in SCHEDULES:
        n = 2 * WORLD
        ids = [rank, 2 * WORLD - 1 - rank] if name in V_SHAPED else [rank, rank + WORLD]
        grads: dict[str, dict[str, torch.Tensor]] = {}
        steps: dict[str, Any] = {}
        applied: list[Any] = []
        for planned in PLANS:
            model, (idx, target), _ = gpt(**OPTS)
            parts = [GPTPart(model, s, n) for s in ids]
            stages = [pipelining.PipelineStage(part, s, n, torch.device("cpu"))
                      for s, part in zip(ids, parts, strict=True)]
            if planned != "none":
                applied += parts
                for stage, part in zip(stages, parts, strict=True):
                    names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
                    apply_to_stage(stage, Plan(names, tuple(Region(i, i + 1)
                                                            for i in range(len(names)))),
                                   split_backward=planned == "once")
            schedule = getattr(pipelining, name)(stages, n_microbatches=MICRO,
                                                 loss_fn=logits_loss)
            first, last = any(p.first for p in parts), any(p.last for p in parts)

            def step(schedule: Any = schedule, first: bool = first, last: bool = last,
                     idx: Any = idx, target: Any = target) -> None:
                kwargs = {"target": target, "losses": []} if last else {}
                if first:
                    schedule.step(idx, **kwargs)
                else:
                    schedule.step(**kwargs)

            step()
            grads[planned] = {f"{s}.{k}": q.grad.clone() for s, part in zip(ids, parts,
                                                                           strict=True)
                              for k, q in part.named_parameters() if q.grad is not None}
            peak, _ = rank_step_peak(step, parts, stages, held=[idx, target])
            same = grads["none"].keys() == grads[planned].keys() and all(
                torch.equal(grads["none"][k], grads[planned][k]) for k in grads["none"])
            rows.append({"schedule": name, "planned": planned, "peak": peak,
                         "same_grads": same, "times": []})
            steps[planned] = step
        # step times: the three runs interleaved, each step started on both ranks at once
        for _ in range(ROUNDS):
            for planned in PLANS:
                dist.barrier()
                t0 = time.perf_counter()
                steps[planned]()
                took = time.perf_counter() - t0
                next(r for r in rows if r["schedule"] == name
                     and r["planned"] == planned)["times"].append(took)
        for part in applied:
            remove(part)
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _rows(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [next(x for x in rows if x["schedule"] == name and x["planned"] == p)
            for p in PLANS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_rank, args=(os.path.join(rendezvous, "store"), out), nprocs=WORLD)
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    lines = ["| schedule | rank | peak, no plan (MB) | a region per block (MB) | change | "
             "the same, split_backward=True (MB) | change | gradients equal |",
             "|---|---|---|---|---|---|---|---|"]
    for name in SCHEDULES:
        for r, rows in enumerate(ranks):
            plain, torch_frame, once = _rows(rows, name)
            same = torch_frame["same_grads"] and once["same_grads"]
            lines.append(f"| {name} | {r} | {plain['peak'] / 1e6:.2f} | "
                         f"{torch_frame['peak'] / 1e6:.2f} | "
                         f"{torch_frame['peak'] / plain['peak'] - 1:+.0%} | "
                         f"{once['peak'] / 1e6:.2f} | "
                         f"{once['peak'] / plain['peak'] - 1:+.0%} | "
                         f"{'yes' if same else 'NO'} |")
    lines += ["", f"Step time, the slower rank's, {ROUNDS} interleaved rounds: the median "
              "step and the median of the per-round ratios to no plan's.", "",
              "| schedule | no plan (ms) | a region per block | split_backward=True |",
              "|---|---|---|---|"]
    for name in SCHEDULES:
        per_rank = [_rows(rows, name) for rows in ranks]
        slowest = [[max(ts) for ts in zip(*(r[i]["times"] for r in per_rank), strict=True)]
                   for i in range(len(PLANS))]
        plain = slowest[0]
        cells = [f"{statistics.median(plain) * 1e3:.1f}"]
        for times in slowest[1:]:
            ratio = statistics.median(t / b for t, b in zip(times, plain, strict=True))
            cells.append(f"{statistics.median(times) * 1e3:.1f} ms, {ratio:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
