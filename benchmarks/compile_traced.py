"""Regions as traced checkpoint calls inside one whole-model ``torch.compile`` (issue 17).

remat's runtime is opaque to Dynamo (docs/compile.md), so with a plan applied a
whole-model compile compiles little, and remat+compile compiles stage by stage, which is
itself 1.09-1.10x the whole-model compile on gpt (benchmarks/compile_speed.md). This
measures the other way: a plan's regions written as ``torch.utils.checkpoint`` calls in
the model (each region's blocks moved into one module whose forward is one non-reentrant
checkpoint call), then ``torch.compile`` of the whole loss, which Dynamo traces as one
graph with the regions inside. Rows, per process: ``eager`` (the base of the ratios),
then either ``compile@F`` (``torch.compile`` with functorch's
``activation_memory_budget=F``; one fraction per process, so no compiled graph is shared)
or ``traced:A-B,C-D`` (regions [A,B) and [C,D) of the model's ``blocks``, compiled
whole at 1.0). Models: the built-in gpt (a ``ModuleList`` in a plain loop) and
mlp-hetero (a ``Sequential``).

Per row: the peak (allocator events, ``remat.benchmarking.step_measures.by_profiler``), the
median step and the median of per-round ratios to ``eager`` over interleaved rounds after
3 warm-up steps, and the largest gradient difference from ``eager`` after one step from
the same weights and seed (dropout 0.1 under inductor's ``fallback_random``). Not yet a
remat feature: the regions are written by hand here.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_traced.py [--model gpt] [--rounds 9]
        [--out benchmarks/compile_traced.md]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_FRACTIONS = [["compile@0.75"], ["compile@0.5"], ["compile@0.2"]]
GROUPS = {
    "gpt": [["compile@1.0", "traced:0-2", "traced:0-3", "traced:0-2,2-4", "traced:0-2,2-5",
             "traced:0-1,1-2,2-3,3-4,4-5,5-6,6-7,7-8"], *_FRACTIONS],
    "mlp-hetero": [["compile@1.0", "traced:0-1", "traced:0-1,3-4", "traced:0-2",
                    "traced:0-4", "traced:0-4,4-8", "traced:0-12"], *_FRACTIONS],
}


def measure(model_name: str, rows_wanted: list[str], rounds: int
            ) -> dict[str, dict[str, float]]:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from remat.benchmarking.runners import Runner
    from remat.benchmarking.step_measures import by_profiler, interleaved, paired
    from remat.models import load_model

    torch.set_num_threads(1)
    inductor_config.fallback_random = True
    # every row compiles the same loss function for another model: past Dynamo's
    # recompile limit (8) a row would silently run eagerly
    torch._dynamo.config.recompile_limit = 64

    class Region(nn.Module):
        def __init__(self, blocks: list[nn.Module]) -> None:
            super().__init__()
            self.inner = nn.ModuleList(blocks)

        def _run(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.inner:
                x = block(x)
            return x

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self._run, x, use_reentrant=False)

    def with_regions(model: Any, spec: str) -> None:
        spans = dict(tuple(map(int, s.split("-"))) for s in spec.split(","))
        blocks, out, i = list(model.blocks), [], 0
        while i < len(blocks):
            if i in spans:
                out.append(Region(blocks[i:spans[i]]))
                i = spans[i]
            else:
                out.append(blocks[i])
                i += 1
        model.blocks = type(model.blocks)(*out) if isinstance(model.blocks, nn.Sequential) \
            else nn.ModuleList(out)

    rows: dict[str, tuple[Any, Any, Any]] = {}
    for name in ["eager", *rows_wanted]:
        torch.manual_seed(0)
        model, batch, loss = load_model(model_name)
        if name.startswith("traced:"):
            with_regions(model, name.split(":", 1)[1])
        if name != "eager":
            loss = torch.compile(loss)
        rows[name] = (model, batch, loss)

    grads: dict[str, list[torch.Tensor]] = {}
    for name, (model, batch, loss) in rows.items():
        fraction = float(name.split("@")[1]) if name.startswith("compile@") else 1.0
        with functorch_config.patch(activation_memory_budget=fraction):
            torch.manual_seed(1)  # the same dropout draws in every row's first step
            loss(model, batch).backward()  # compiles here, at the row's fraction
        grads[name] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    diff = {name: max(float((a - b).abs().max()) for a, b in zip(g, grads["eager"],
                                                                   strict=True))
            for name, g in grads.items()}
    peaks = {name: by_profiler(Runner(m, b, loss, "adamw")).peak_bytes
             for name, (m, b, loss) in rows.items()}
    optimizers = {k: torch.optim.AdamW(v[0].parameters(), lr=1e-3) for k, v in rows.items()}

    def step(key: str) -> None:
        model, batch, loss = rows[key]
        loss(model, batch).backward()
        optimizers[key].step()
        optimizers[key].zero_grad(set_to_none=True)

    times = interleaved({key: functools.partial(step, key) for key in rows}, repeats=rounds,
                        warmup=3)
    return {
        key: {"peak_mib": peaks[key] / 2**20, "median_s": statistics.median(v),
              "ratio": paired(v, times["eager"])[0],
              "grad_diff": diff[key]}
        for key, v in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(GROUPS), default="gpt")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.rows is not None:
        print(json.dumps(measure(args.model, args.rows.split(";"), args.rounds)))
        return
    import torch

    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"# Regions as traced checkpoint calls in a whole-model compile ({args.model})", "",
        "Command: `PYTHONPATH=src .venv/bin/python benchmarks/compile_traced.py --model "
        f"{args.model} --rounds {args.rounds}` ({began}; torch {torch.__version__}, one "
        "thread, 2-core shared CPU). One process per group of rows; ratios are to `eager` "
        "in the same process "
        f"(median of {args.rounds} interleaved per-round ratios); gradient difference: the "
        "largest absolute difference from eager's after one step from the same weights "
        "and seed.", "",
        "| process | row | peak (MiB) | median step (ms) | step / eager | grad diff |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, group in enumerate(GROUPS[args.model], 1):
        done = subprocess.run([sys.executable, __file__, "--model", args.model,
                               "--rounds", str(args.rounds),
                               "--rows", ";".join(group)],
                              capture_output=True, text=True, check=True)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        for name, row in found.items():
            line = (f"| {k} | {name} | {row['peak_mib']:.2f} | {row['median_s'] * 1e3:.1f} | "
                    f"{row['ratio']:.3f} | {row['grad_diff']:.1e} |")
            print(line, flush=True)
            lines.append(line)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
