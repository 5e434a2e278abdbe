"""A range profile's step times at the small end of its range (issue 48, items 1 and 6).

Run: ``PYTHONPATH=src python benchmarks/region_time_fit.py`` (output recorded in
benchmarks/region_time_fit.md).

The variable-length benchmark's hf:llama (hidden 128, 4 layers) is profiled over
``seq=32..1024:8`` with freed memory kept; at seq 32, 64 and 128 the step without
checkpointing and with one region per layer is predicted from the range's fit, predicted
from a profile of that shape alone, and measured (16 interleaved rounds, the first
dropped, medians), with the figures the predictions come from.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import variable_length as vl

import remat
from remat.core.plan_format import Plan, Region
from remat.core.shape_profiles import at_shape
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.simulator import simulate
from remat.measure.malloc import set_malloc
from remat.profiling.profiler import profile
from remat.profiling.shaped import profile_shapes


def _step_s(prof: Any, plan: Plan) -> float:
    return simulate(plan, problem_from_profile(prof)).step_time_s


def _ms(values: Any) -> str:
    return " ".join(f"{v * 1e3:.2f}" for v in values)


def _measured(init: torch.nn.Module, plan: Plan, batch: Any) -> tuple[float, float]:
    """Median step seconds without checkpointing and under ``plan``, interleaved."""
    plain, planned = copy.deepcopy(init), copy.deepcopy(init)
    handle = remat.apply(planned, plan)
    try:
        runs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-4), []) for m in (plain, planned)]
        for k in range(16):
            for model, opt, times in runs:
                t = time.perf_counter()
                vl.hf_loss(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if k:
                    times.append(time.perf_counter() - t)
        return statistics.median(runs[0][2]), statistics.median(runs[1][2])
    finally:
        handle.remove()


def main() -> None:
    print(f"allocator: {set_malloc('keep')}; torch {torch.__version__}, one thread")
    torch.set_num_threads(1)
    cfg = vl.settings(False)
    init = vl.build_model(cfg)
    t = time.perf_counter()
    ranged = profile_shapes(copy.deepcopy(init), vl.example(cfg, 32), vl.hf_loss,
                            "seq=32..1024:8", repeats=cfg["repeats"])
    print(f"range profiled in {time.perf_counter() - t:.0f} s; timed at "
          f"{ranged.shapes.time_points}")
    stages = ranged.stage_names
    none = Plan(stages)
    per_layer = Plan(stages, tuple(Region(i, i + 1) for i in range(len(stages))))
    for seq in (32, 64, 128):
        fitted = at_shape(ranged, (seq,))
        single = profile(copy.deepcopy(init), vl.example(cfg, seq), vl.hf_loss,
                         repeats=cfg["repeats"])
        n, p = _measured(init, per_layer, vl.example(cfg, seq))
        line = [f"seq {seq}: measured none {n * 1e3:.1f} ms, per-layer {p * 1e3:.1f} ms "
                f"(+{p / n - 1:.0%})"]
        for name, prof in (("range fit", fitted), ("single profile", single)):
            a, b = _step_s(prof, none), _step_s(prof, per_layer)
            line.append(f"{name}: none {a * 1e3:.1f}, per-layer {b * 1e3:.1f} (+{b / a - 1:.0%})")
        print("; ".join(line))
        for name, prof in (("fit", fitted), ("single", single)):
            print(f"   {name}: step {prof.step_s * 1e3:.1f} fwd "
                  f"{_ms(s.fwd_s for s in prof.stages)} bwd {_ms(s.bwd_s for s in prof.stages)}"
                  f" rebuild {_ms(s.rebuild_s for s in prof.stages)} region_overhead "
                  f"{prof.region_overhead_s * 1e3:.2f} outside {prof.outside_chain_s * 1e3:.1f}")


if __name__ == "__main__":
    main()
