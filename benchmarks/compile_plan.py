"""A remat plan and ``torch.compile`` together: gradients, peak memory and step time.

Six rows on the built-in gpt (small, so that inductor compiles in seconds), each on its
own fresh model from the same seed:

* ``eager`` and ``eager + plan``: no compile;
* ``compile(loss)`` and ``compile(loss) + plan``: ``torch.compile`` of the loss function
  (forward and loss); with a plan the stage calls are opaque to Dynamo and run eagerly
  (Note [torch.compile sees the engine as one opaque call] in ``remat/runtime/engine.py``);
* ``compile(stages)`` and ``compile(stages) + plan``: every block's ``forward`` replaced
  by ``torch.compile(block.forward)`` *before* ``remat.apply``, the recipe of
  ``docs/compile.md``: the engine then calls the compiled block in forward and rebuild.

Every compiled row runs with ``torch._inductor.config.fallback_random = True`` so that
compiled dropout draws from torch's generator as eager does and gradients can be
compared with eager's. Per row: the first step's loss and gradients against ``eager``
(largest ``|a - b|`` over ``max |b|``, and whether every element is within float32's
``rtol=1.3e-6, atol=1e-5``); the peak of a whole training step (forward, backward, AdamW
step, after a warm-up step) from ``torch.profiler``'s allocator events
(``remat.benchmarking.step_measures.by_profiler``), and from remat's live-storage
tracker, which for a compiled row is wrong on purpose: under its dispatch mode Dynamo does
not compile, so the tracker sees the eager model; step times interleaved, quoted as
medians of per-round ratios against ``eager``.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/compile_plan.py

Prints the figures and writes them to ``benchmarks/compile_plan.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import nn

import remat
from remat import plans
from remat.benchmarking.runners import Runner
from remat.benchmarking.step_measures import by_profiler, by_tracker, interleaved, paired
from remat.core.plan_format import Plan
from remat.models import load_model

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/compile_plan.py"
MIB = 1024 * 1024
OPTIONS: dict[str, Any] = {
    "n_layer": 4,
    "n_embd": 64,
    "n_head": 2,
    "block_size": 64,
    "vocab_size": 128,
    "batch_size": 8,
    "dropout": 0.1,
}
ROWS = (
    "eager",
    "eager + plan",
    "compile(loss)",
    "compile(loss) + plan",
    "compile(stages)",
    "compile(stages) + plan",
)


class CountingInductor:
    """Inductor (``compile_fx``, what ``torch.compile``'s default backend runs), counting
    the calls of the graphs it compiled: evidence that a measured step ran compiled."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


class Row(Runner):
    """A fresh gpt set up as ``name`` says; ``step()`` is one whole training step."""

    def __init__(self, name: str, plan_of: Callable[[nn.Module], Plan]) -> None:
        model, batch, loss_fn = load_model("gpt", **OPTIONS)
        super().__init__(model, batch, loss_fn, "adamw")
        self.name = name
        self.compiled = name.startswith("compile")
        self.backend = CountingInductor()
        if "stages" in name:
            for block in model.blocks:  # before apply: the engine calls the compiled forward
                block.forward = torch.compile(block.forward, backend=self.backend)  # type: ignore[method-assign]
        self.plan = plan_of(model) if name.endswith("+ plan") else None
        if self.plan is not None:
            remat.apply(model, self.plan)
        run: Callable[[Any], torch.Tensor] = lambda b: loss_fn(model, b)  # noqa: E731
        self.run = torch.compile(run, backend=self.backend) if "loss" in name else run

    def context(self) -> AbstractContextManager[Any]:
        if not self.compiled:
            return contextlib.nullcontext()
        return inductor_config.patch(fallback_random=True)

    def loss(self) -> torch.Tensor:
        return self.run(self.batch)


def seeded_grads(row: Row, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.random.fork_rng(), row.context():
        torch.manual_seed(seed)
        loss = row.loss()
        loss.backward()
    grads = {
        n: p.grad.detach().clone() for n, p in row.model.named_parameters() if p.grad is not None
    }
    row.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Largest ``max|a-b| / max|b|`` over parameters; all elements within float32's tolerance?"""
    worst, close = 0.0, True
    for name, b in ref.items():
        a = ours[name]
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
        close = close and bool(torch.allclose(a, b, rtol=1.3e-6, atol=1e-5))
    return worst, close


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plan", choices=("per-stage", "segments"), default="per-stage")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("compile_plan.md"))
    args = parser.parse_args(argv)
    plan_of = plans.per_stage if args.plan == "per-stage" else plans.segments

    rows: dict[str, Row] = {}
    first_s: dict[str, float] = {}
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
    results: dict[str, dict[str, Any]] = {}
    for name in ROWS:
        row = rows[name] = Row(name, plan_of)
        began = time.perf_counter()
        loss, grads = seeded_grads(row)
        first_s[name] = time.perf_counter() - began
        if reference is None:
            reference = (loss, grads)
        worst, close = compare(grads, reference[1])
        results[name] = {
            "loss_diff": abs(float(loss - reference[0])),
            "grad_rel": worst,
            "close": close,
        }
        print(
            f"{name}: first step {first_s[name]:.1f} s, grads max rel diff {worst:.1e}",
            file=sys.stderr,
        )
    for name, row in rows.items():
        calls = row.backend.calls
        results[name]["profiler"] = by_profiler(row).peak_bytes  # a warm-up step, then one
        results[name]["graph_calls"] = (row.backend.calls - calls) // 2
    times = interleaved(
        {n: r.step for n, r in rows.items()}, repeats=args.repeats, warmup=args.warmup
    )
    for name in rows:
        results[name]["ratio"] = paired(times[name], times["eager"])[0]
        results[name]["median_ms"] = statistics.median(times[name]) * 1e3
    # Last: a compiled function run once under a dispatch mode (the tracker) is skipped by
    # Dynamo for the rest of the process, so every compiled measurement comes before.
    for name, row in rows.items():
        results[name]["tracker"] = by_tracker(row).peak_bytes

    plan = rows["eager + plan"].plan
    assert plan is not None
    lines = [
        "# A remat plan under torch.compile",
        "",
        f"Reproduce with `{COMMAND}`"
        + ("" if args.plan == "per-stage" else f" `--plan {args.plan}`")
        + ".",
        f"Measured with torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads, inductor on CPU with "
        "`fallback_random=True`.",
        "",
        f"Model: built-in gpt with {', '.join(f'{k}={v}' for k, v in OPTIONS.items())}; "
        f"plan `{args.plan}`: regions "
        f"{', '.join(f'[{r.start}, {r.stop})' for r in plan.regions)} over "
        f"{len(plan.stages)} blocks. Gradients: the first step from seed 0 against `eager`. "
        "Peak: one whole training step (forward, backward, AdamW step) after a warm-up "
        "step. Time: median of per-round ratios against `eager` over "
        f"{args.repeats} interleaved rounds after {args.warmup} warm-up rounds (a shared "
        "machine: read the ratios, not the absolute times).",
        "",
        "| row | grads vs eager (max rel) | within rtol 1.3e-6, atol 1e-5 | peak, profiler "
        "| compiled graph calls per step | peak, tracker | step time / eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        r = results[name]
        tracker = f"{r['tracker'] / MIB:.2f} MiB" + (
            " (eager fallback)" if rows[name].compiled else ""
        )
        lines.append(
            f"| {name} | {r['grad_rel']:.1e} | {'yes' if r['close'] else 'NO'} "
            f"| {r['profiler'] / MIB:.2f} MiB | {r['graph_calls']} | {tracker} "
            f"| {r['ratio']:.3f} |"
        )
    p = {n: results[n]["profiler"] for n in ROWS}
    lines += [
        "",
        f"- The plan under compiled stages: peak {p['compile(stages) + plan'] / MIB:.2f} MiB "
        f"against {p['compile(stages)'] / MIB:.2f} MiB for the same compiled stages without "
        f"it ({p['compile(stages) + plan'] / p['compile(stages)']:.2f}x); eager: "
        f"{p['eager + plan'] / MIB:.2f} against {p['eager'] / MIB:.2f} MiB "
        f"({p['eager + plan'] / p['eager']:.2f}x).",
        f"- `compile(loss) + plan` runs the blocks eagerly (opaque to Dynamo), so its peak "
        f"is the eager plan's: {p['compile(loss) + plan'] / MIB:.2f} MiB; compiled, the "
        "code outside the blocks is only the loss (the model's loop graph-breaks at every "
        "block, and Dynamo runs a frame with a graph break in a loop eagerly).",
        "- The tracker column shows the compile trap: under its dispatch mode Dynamo does "
        "not compile, so for compiled rows it reports the eager model's peak (and Dynamo "
        "skips those functions from then on; the tracker ran last).",
        "- First steps (compile, then one step; inductor's on-disk cache may be warm): "
        + ", ".join(f"{n} {first_s[n]:.1f} s" for n in ROWS)
        + ".",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
