"""Does the same code measure the same per-rank peak in every fresh run? DDP and FSDP2.

For each wrap (``ddp``, ``fsdp``) and plan (no regions, one region per block) a fresh
2-process gloo job measures each rank's step with
:func:`remat.parallel.data_parallel.plan_rank_memory`, ``--runs`` times, and every run's figures are
recorded: the peak (the step's threads, by address; Note [Steady per-rank peaks]), the
bytes alive at the start, DDP's buckets, what gloo's worker threads held at once, the
frees of older blocks left out, the plain running sum of the same events, and how many
steps were recorded to get a clean reading. Target: every run's peak within 1% of the
row's median, on each rank. Writes ``benchmarks/distributed_steadiness.md``.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/distributed_steadiness.py [--runs 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import remat
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve import simulate
from remat.core.transforms import per_rank_problem
from remat.models import load_model
from remat.parallel import data_parallel as rd
from remat.parallel.ranks import shard_batch

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/distributed_steadiness.py"
WORLD = 2
GPT = dict(n_layer=4, n_embd=64, block_size=32, vocab_size=128, batch_size=8, dropout=0.1)
STAGES = tuple(f"blocks.{i}" for i in range(4))
PLANS = {
    "none": Plan(STAGES),
    "per-stage": Plan(STAGES, tuple(Region(i, i + 1) for i in range(4))),
}
TOLERANCE = 0.01


def _rank(rank: int, path: str, out: str, wrap: str, name: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        model, batch, loss_fn = load_model("gpt", **GPT)
        batch = shard_batch(batch, rank, WORLD)
        memory = rd.plan_rank_memory(model, batch, loss_fn, PLANS[name], wrap=wrap, stages=STAGES)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(dataclasses.asdict(memory), os.path.join(out, f"rank{rank}.pt"))


def measure(wrap: str, name: str) -> list[dict[str, int]]:
    """One fresh 2-process job: each rank's figures."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), tmp, wrap, name), nprocs=WORLD)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _spread(values: list[int]) -> tuple[float, int]:
    """The largest distance from the median, as a fraction, and how many are within 1%."""
    middle = statistics.median(values)
    gaps = [abs(v / middle - 1) for v in values]
    return max(gaps), sum(g <= TOLERANCE for g in gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).with_name("distributed_steadiness.md")))
    args = parser.parse_args()
    began = time.perf_counter()
    model, batch, loss_fn = load_model("gpt", **GPT)
    base = to_problem(remat.profile(model, shard_batch(batch, 0, WORLD), loss_fn, repeats=1))
    summary = [
        "| wrap | plan | predicted | rank | peak median | spread | within 1% of the median "
        "| steps recorded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    detail = [
        "| wrap | plan | run | rank | peak | start | buckets | other threads | ignored frees "
        "| all events summed | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wrap in ("ddp", "fsdp"):
        problem = per_rank_problem(base, world_size=WORLD, strategy=wrap)
        for name, plan in PLANS.items():
            predicted = simulate(plan, problem).peak_bytes
            runs = [measure(wrap, name) for _ in range(args.runs)]
            for i, ranks in enumerate(runs, 1):
                for r, m in enumerate(ranks):
                    detail.append(
                        f"| {wrap} | {name} | {i} | {r} | {m['peak_bytes']:,} "
                        f"| {m['start_bytes']:,} | {m['resident_bytes']:,} "
                        f"| {m['other_thread_bytes']:,} | {m['ignored_free_bytes']:,} "
                        f"| {m['summed_peak_bytes']:,} | {m['attempts']} |"
                    )
            for r in range(WORLD):
                peaks = [ranks[r]["peak_bytes"] for ranks in runs]
                steps = [ranks[r]["attempts"] for ranks in runs]
                gap, near = _spread(peaks)
                summary.append(
                    f"| {wrap} | {name} | {predicted:,} | {r} | {statistics.median(peaks):,.0f} "
                    f"({statistics.median(peaks) / predicted - 1:+.1%}) | {gap:.2%} "
                    f"| {near} of {len(peaks)} | {min(steps)} to {max(steps)} |"
                )
                print(summary[-1], flush=True)
    minutes = (time.perf_counter() - began) / 60
    lines = [
        "# Per-rank peaks: the same code, fresh runs",
        "",
        f"Command: `{COMMAND} --runs {args.runs}` "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {minutes:.1f} min; "
        f"torch {torch.__version__}, {platform.machine()} CPU, {os.cpu_count()} cores shared "
        f"with other jobs, gloo, {WORLD} processes). gpt {GPT}, AdamW; each run is a fresh "
        f"{WORLD}-process job measuring one step per rank with `rd.plan_rank_memory` "
        "(Note [Steady per-rank peaks] in `src/remat/measure/allocator_events.py`).",
        "",
        "Spread: the largest distance of a run's peak from the median of its row and rank. "
        "Steps recorded: how many steps the instrument recorded until every rank had a "
        "clean one (no block of the step's without its free event). Predicted: the "
        "simulator on `per_rank_problem` (issue 15 item 2 is its accuracy). The readings "
        "before this instrument, same model and plans: `benchmarks/distributed_peaks.md` "
        "at commit 45aa628 (DDP up to +17% in 1 to 3 runs of 8, FSDP2 per-stage from "
        "3,234,392 to 3,634,264 bytes).",
        "",
        *summary,
        "",
        "Every run (bytes; buckets: DDP's, read from its reducer and included in start; "
        "other threads: the most that threads other than the step's held at once, not in "
        "the peak; ignored frees: frees of blocks older than the step that the start did "
        "not count; all events summed: the kept step's events summed in time order, all "
        "threads, as the instrument read them before; steps: recorded for this reading):",
        "",
        *detail,
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
