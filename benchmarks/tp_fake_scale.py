"""One rank of a tensor-parallel run sized in one process: fake tensors (no weights) on
torch's fake process group (no communication), profiled for a device this machine does
not have.

Run (repository root)::

    PYTHONPATH=src .venv/bin/python benchmarks/tp_fake_scale.py [--ranks 8] [--layers 32]
        [--dim 4096] [--heads 32] [--seq 8192] [--device h100-sxm]

The model is ``remat.models.tp``'s decoder (bfloat16, vocabulary 32000, micro-batch 1)
parallelized the torchtitan way with sequence parallelism over ``--ranks``; this
process is rank 0 of them (``remat.parallel.tensor.init_fake_ranks``). It prints the
profile's wall time and the process's peak resident memory, a stage's per-rank bytes,
and the per-rank peak of no checkpointing, per-stage regions, save-collectives on every
stage and remat's optimal plan under ``--budget`` GiB.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

import remat
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve import simulate
from remat.models.tp import parallelize, tp_transformer
from remat.parallel.tensor import init_fake_ranks

GIB, MIB = 2**30, 2**20


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, target = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(),
                                             target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("ranks", 8), ("layers", 32), ("dim", 4096), ("heads", 32),
                          ("seq", 8192)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--budget", type=float, default=10.0, help="GiB per rank")
    args = parser.parse_args()
    init_fake_ranks(args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,))  # outside the fake mode
    began = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with remat.fake_mode():
            model, batch = tp_transformer(vocab=32000, dim=args.dim, heads=args.heads,
                                          layers=args.layers, batch=1, seq=args.seq)
            parallelize(model, mesh)
    finally:
        torch.set_default_dtype(torch.float32)
    names = tuple(f"layers.{i}" for i in range(args.layers))
    prof = remat.profile(model, batch, _loss, stages=names, fake=True, device=args.device)
    took = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    problem = to_problem(prof)
    stage = prof.stages[0]
    print(f"{args.ranks} ranks, {args.layers} layers, width {args.dim}, {args.heads} heads, "
          f"sequence {args.seq}, micro-batch 1, bfloat16, {args.device}; torch "
          f"{torch.__version__}")
    print(f"profiled in {took:.1f} s, peak resident memory {rss:.0f} MiB")
    print(f"per rank: parameters {prof.fixed.params_bytes / GIB:.2f} GiB; a block's input "
          f"{stage.boundary_bytes / MIB:.1f} MiB (a 1/{args.ranks} sequence shard), saved "
          f"for backward {stage.saved_bytes['keep'] / MIB:.1f} MiB (keep), "
          f"{stage.saved_bytes['selective:save-collectives'] / MIB:.1f} MiB "
          f"(save-collectives); its forward's collectives "
          f"{', '.join(op for op, _ in stage.comms.forward) if stage.comms else 'none'}")
    plans = {
        "none": Plan(names),
        "per-stage": Plan(names, tuple(Region(i, i + 1) for i in range(len(names)))),
        "save-collectives": Plan(names, (), ("selective:save-collectives",) * len(names)),
    }
    budget = int(args.budget * GIB)
    try:
        plans[f"optimal @ {args.budget:g} GiB"] = remat.plan(prof, budget)
    except remat.CheckFailed as err:
        print(f"optimal @ {args.budget:g} GiB: {err}")
    for name, plan in plans.items():
        sim = simulate(plan, problem)
        print(f"{name}: peak per rank {sim.peak_bytes / GIB:.2f} GiB, step "
              f"{sim.time.total_s:.3f} s (roofline), "
              f"{len(plan.regions)} regions, options "
              f"{sorted({o for o in plan.options if o != 'keep'}) or ['keep']}")


if __name__ == "__main__":
    main()
