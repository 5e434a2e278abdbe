"""Mixed precision to the byte: predicted against measured peaks under CPU autocast and in
pure bfloat16 (issue 48, item 5).

For each model and precision: profile, then at the budget 75% and at the minimum budget
remat names (``solvers.minimum_budget``), the optimal plan's predicted peak (the
simulator) and its measured peak (the live-storage tracker, ``measure_step``, one step
after a warm-up), with the events where each peaks.

Run: .venv/bin/python benchmarks/mixed_precision.py [--quick]
(``--quick``: the small gpt only.)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import remat
from remat.core.solve import parse_budget, simulate, solvers
from remat.core.solve.from_profile import problem_from_profile
from remat.core.units import format_bytes
from remat.measure import measure_step
from remat.models import load_model

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt (4 x 128)": ("gpt", {"n_layer": 4}),
    "mlp-hetero (6 x 64)": ("mlp-hetero", {"n_blocks": 6, "d_model": 64, "expansion": 8,
                                           "depth": 2, "batch_size": 64}),
    "hf:llama (tiny)": ("hf:llama", {}),
}
PRECISIONS = ("fp32", "autocast-bf16", "autocast-fp16", "pure-bf16")


def _autocast(loss_fn: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    def under_autocast(model: torch.nn.Module, batch: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(model, batch)
    return under_autocast


def _floats_to(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_floats_to(b, dtype) for b in batch)
    if isinstance(batch, dict):
        return {k: _floats_to(v, dtype) for k, v in batch.items()}
    return batch


def build(spec: str, options: dict[str, Any], precision: str
          ) -> tuple[torch.nn.Module, Any, Callable[..., Any]]:
    model, batch, loss_fn = load_model(spec, **options)
    if precision == "pure-bf16":
        return model.to(torch.bfloat16), _floats_to(batch, torch.bfloat16), loss_fn
    if precision.startswith("autocast"):
        dtype = torch.bfloat16 if precision.endswith("bf16") else torch.float16
        return model, batch, _autocast(loss_fn, dtype)
    return model, batch, loss_fn


def measured_peak(model: torch.nn.Module, batch: Any, loss_fn: Callable[..., Any],
                  plan: remat.Plan) -> tuple[int, str]:
    applied = copy.deepcopy(model)
    handle = remat.apply(applied, plan)
    try:
        step = measure_step(applied, batch, loss_fn)
    finally:
        handle.remove()
    phase = step.peak_phase.value if step.peak_phase is not None else "?"
    return step.peak_bytes, f"{phase} {step.peak_module_path or '(outside modules)'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small gpt only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    print(f"torch {torch.__version__}, one thread, CPU")
    print()
    print("| model | precision | budget | predicted | measured | measured - predicted "
          "| within budget | predicted peak event | measured peak at |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    over = 0
    for label, (spec, options) in models.items():
        for precision in PRECISIONS:
            start = time.perf_counter()
            model, batch, loss_fn = build(spec, options, precision)
            prof = remat.profile(model, batch, loss_fn, repeats=1)
            problem = problem_from_profile(prof)
            least = solvers.minimum_budget(problem)
            for name, budget in (("75%", parse_budget("75%", problem)),
                                 ("minimum", least)):
                plan = solvers.optimal(problem, budget)
                sim = simulate(plan, problem)
                measured, where = measured_peak(model, batch, loss_fn, plan)
                diff = measured - sim.peak_bytes
                rel = diff / sim.peak_bytes
                worst = max(worst, abs(rel))
                fits = measured <= budget
                over += not fits
                print(f"| {label} | {precision} | {name} ({format_bytes(budget)}) "
                      f"| {sim.peak_bytes:,} | {measured:,} | {diff:+,} ({rel:+.2%}) "
                      f"| {'yes' if fits else '**no**'} | {sim.peak_event} | {where} |",
                      flush=True)
            print(f"<!-- {label} {precision}: {time.perf_counter() - start:.0f} s -->",
                  file=sys.stderr)
    print()
    print(f"largest |measured - predicted|: {worst:.2%} of the prediction; "
          f"plans over their budget: {over}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
