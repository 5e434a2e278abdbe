"""What a profile over a range of shapes costs, and how exact it is (issue 48, item 1).

Run: ``python benchmarks/shape_profiles.py`` (writes benchmarks/shape_profiles.md).

For each model and range: the wall time of ``profile_shapes`` against one ``profile`` at
the range's largest shape (the single-shape profile a user would otherwise run), both in
one process, one torch thread, in alternating order over ``--runs`` runs; after each run,
a profile at a held-out shape (on neither the byte grid, the ladder nor the timed shapes)
compared with that run's fit: the polynomial byte figures to the byte, the stepped ones
never under, the step and stage times against what a second profile of the same shape
differs by, both levelled to the fit's anchor by steps timed side by side (Note [Times
within the noise] in remat/profiling/shaped.py); the errors before levelling are shown
too.

``--malloc keep`` (default, as ``remat profile --shapes`` and ``remat.auto_checkpoint``
profile on CPU) lets glibc keep freed memory, so a timed step does not depend on the shape
profiled before it; ``--malloc system`` leaves the allocator alone (docs/bench.md, "Steady
CPU timings").
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from remat.measure.malloc import MALLOC_MODES, set_malloc
from remat.models import load_model
from remat.profiling.profiler import profile
from remat.profiling.shaped import batch_axes, check_fit, profile_shapes, resize

HERE = Path(__file__).parent

CASES: list[tuple[str, dict[str, Any], str, tuple[int, ...]]] = [
    ("gpt", {"n_layer": 6, "n_embd": 128, "block_size": 256, "batch_size": 4},
     "seq=32..256:8", (104,)),
    ("hf:llama", {"seq_len": 256, "batch_size": 4}, "seq=32..256:8", (152,)),
    ("gpt", {"n_layer": 4, "n_embd": 64, "block_size": 128, "batch_size": 8},
     "batch=2..8,seq=32..128:8", (5, 72)),
]


def _one(name: str, options: dict[str, Any], shapes: str, held_out: tuple[int, ...],
         runs: int) -> list[str]:
    model, batch, loss = load_model(name, **options)
    profile(model, batch, loss, repeats=1)  # the process's one-off costs, paid by neither
    ranged_s, single_s, reports = [], [], []
    prof = None
    for k in range(runs):
        order = ("range", "single") if k % 2 == 0 else ("single", "range")
        for what in order:
            t0 = time.perf_counter()
            if what == "range":
                prof = profile_shapes(model, batch, loss, shapes)
                ranged_s.append(time.perf_counter() - t0)
            else:
                assert prof is not None or k == 0
                dims = prof.shapes.dims if prof is not None else None
                big = batch if dims is None else resize(
                    batch, batch_axes(batch, dims), dict(zip(dims.names, dims.hi, strict=True)))
                profile(model, big, loss)
                single_s.append(time.perf_counter() - t0)
        assert prof is not None
        reports.append(check_fit(model, batch, loss, prof, held_out))
    assert prof is not None and prof.shapes is not None
    fit = prof.shapes
    report = reports[-1]
    over = [-d for p, d in report.bytes_wrong if p in report.stepped]
    ratios = [r / s for r, s in zip(ranged_s, single_s, strict=True)]
    within = sum(r.times_within_noise for r in reports)
    exact = all(r.polynomial_exact and r.stepped_under == 0 for r in reports)
    lines = [
        f"## {name} {options}, `{shapes}`",
        "",
        f"- profiled: {len(fit.byte_points)} grid shapes, a ladder "
        f"{'x'.join(str(len(r)) for r in fit.rungs)}, timed at "
        f"{'; '.join(fit.dims.shape_text(s) for s in fit.time_points)}",
        f"- cost: the range took {', '.join(f'{s:.1f}' for s in ranged_s)} s against one "
        f"profile at the largest shape {', '.join(f'{s:.1f}' for s in single_s)} s: "
        f"**{statistics.median(ratios):.2f}x** (median of {runs}; each run "
        f"{', '.join(f'{r:.2f}' for r in ratios)}; target at most 4x)",
        f"- bytes: {len(fit.bytes)} polynomial, {len(fit.steps)} stepped; at the held-out "
        f"{fit.dims.shape_text(held_out)}: {report.byte_fields} figures, polynomial ones "
        f"{'all equal to the byte' if report.polynomial_exact else 'NOT exact'}, stepped "
        f"ones never under: {report.stepped_under == 0} ({len(over)} over, at most "
        f"{max(over, default=0)} bytes); in every run's check: "
        f"{'exact' if exact else 'NOT exact'}",
        f"- times at the held-out shape, each run's fit checked: **within the noise in "
        f"{within} of {runs}**",
    ]
    for k, r in enumerate(reports, 1):
        lines.append(
            f"  - run {k}: step {r.fitted_step_s * 1e3:.1f} ms fitted against "
            f"{r.levelled_step_s * 1e3:.1f} ms levelled ({r.step_s * 1e3:.1f} ms as "
            f"profiled); the worst step or stage time off by {r.time_error:.0%} (before "
            f"levelling {r.raw_time_error:.0%}); a second profile off the first by "
            f"{r.repeat_error:.0%} ({r.raw_repeat_error:.0%}), the profile's own stage "
            f"spread {r.timing_noise:.0%}: within the noise: "
            f"{'yes' if r.times_within_noise else 'no'}")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "shape_profiles.md"))
    parser.add_argument("--malloc", choices=MALLOC_MODES, default="keep")
    args = parser.parse_args()
    torch.set_num_threads(1)
    allocator = set_malloc(args.malloc)
    lines = ["# Profiles over a range of shapes: cost and exactness", "",
             f"Command: `python benchmarks/shape_profiles.py --runs {args.runs} --malloc "
             f"{args.malloc}`; torch {torch.__version__}, one thread, {allocator}, the "
             f"shared 2-core CPU machine, {time.strftime('%Y-%m-%d')}.", ""]
    for case in CASES:
        lines += _one(*case, runs=args.runs)
        print("\n".join(lines[-(8 + args.runs):]), flush=True)
    Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
