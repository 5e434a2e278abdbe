"""Does a training step's time depend on the step before it? (a lead for issue 48 item 6)

A profile times its steps in a fixed order within each round (one region per stage, the
spanning regions, plain, bare, then each selective option; :mod:`remat.profiling.
measurements`), and remat's time predictions for the variable-length run were 8-17% over
the measured totals, most on selective options. This measures one thing that could bias
a fixed order: the step before. For the variable-length benchmark's ``hf:llama`` at one
length, four configurations (no checkpointing, per-layer, every layer
``selective:save-nothing``, every layer ``selective:save-matmuls``) are each timed right
after a step of no checkpointing (which allocates the most) and right after a
``save-nothing`` step (the least), the pairs in a shuffled order, ``--reps`` times.
``--malloc keep`` runs it with glibc keeping freed memory (docs/bench.md, "Steady CPU
timings": the history-dependence ``remat bench`` already avoids that way).

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/step_order.py

writes ``benchmarks/step_order.md`` (``--out``), appending a run to what is there.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat.core.plan_format import Plan, Region
from remat.measure.malloc import MALLOC_MODES, set_malloc

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import variable_length as vl  # noqa: E402

KEEP = "keep"
AFTER = ("none", "sel-nothing")
TIMED = ("none", "per-layer", "sel-nothing", "sel-matmuls")


def plans(n: int, names: list[str]) -> dict[str, Plan]:
    def mk(regions: list[tuple[int, int]], opts: list[str]) -> Plan:
        return Plan(stages=tuple(names), regions=tuple(Region(a, b) for a, b in regions),
                    options=tuple(opts))
    return {"none": mk([], [KEEP] * n),
            "per-layer": mk([(i, i + 1) for i in range(n)], [KEEP] * n),
            "sel-nothing": mk([], ["selective:save-nothing"] * n),
            "sel-matmuls": mk([], ["selective:save-matmuls"] * n)}


def run(seq: int, reps: int, quick: bool) -> dict[tuple[str, str], list[float]]:
    torch.set_num_threads(1)
    cfg = vl.settings(quick)
    init = vl.build_model(cfg)
    batch = vl.example(cfg, seq)
    names = [f"model.layers.{i}" for i in range(cfg["layers"])]
    models = {}
    for name, plan in plans(cfg["layers"], names).items():
        model = copy.deepcopy(init)
        model.train()
        remat.apply(model, plan)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(name: str) -> float:
        model, opt = models[name]
        began = time.perf_counter()
        vl.hf_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    for name in models:
        step(name)
    pairs = [(x, y) for x in AFTER for y in TIMED]
    out: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    rng = random.Random(0)
    for _ in range(reps):
        rng.shuffle(pairs)
        for x, y in pairs:
            step(x)
            out[(x, y)].append(step(y))
    return out


def markdown(seq: int, reps: int, out: dict[tuple[str, str], list[float]], allocator: str
             ) -> str:
    lines = [f"## Run of {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
             f"(seq {seq}, {reps} reps, remat at {vl.commit()}; allocator: {allocator})", "",
             "| timed step | after no checkpointing (median s) | after save-nothing (median s) "
             "| after save-nothing / after none |", "| --- | --- | --- | --- |"]
    for y in TIMED:
        a, b = (statistics.median(out[(x, y)]) for x in AFTER)
        lines.append(f"| {y} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="the tiny model, seq 64, 2 reps")
    parser.add_argument("--out", type=Path, default=HERE / "step_order.md")
    parser.add_argument("--malloc", choices=MALLOC_MODES, default="system",
                        help="glibc's defaults, or freed memory kept (docs/bench.md)")
    args = parser.parse_args(argv)
    seq, reps = (64, 2) if args.quick else (args.seq, args.reps)
    allocator = set_malloc(args.malloc)
    text = markdown(seq, reps, run(seq, reps, args.quick), allocator)
    head = "" if args.out.exists() else (
        "# A step's time after the step before it\n\nWritten by `benchmarks/step_order.py` "
        "(its docstring says why); machine: " + vl.machine() + ", one torch thread.\n\n")
    with args.out.open("a") as f:
        f.write(head + text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
