"""Every byte figure of a range profile against a fresh profile at shapes the fit never saw
(issue 48, item 1; Note [Maxima fitted term by term] in remat/core/shapes.py).

Run: ``python benchmarks/shape_fit_exact.py`` (writes benchmarks/shape_fit_exact.md).

For each model and range: ``profile_shapes`` (bytes at the grid and the ladder, times at
three shapes), then one ``profile`` at each held-out shape (on neither the grid, the
ladder nor the timed shapes), and every byte figure compared with ``at_shape``'s: how many
are polynomials, maxima fitted term by term and stepped, how many differ and by how much.
Bytes do not move with the machine's load: one run says it.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from remat.core.profile_format import numeric_paths
from remat.core.shape_profiles import at_shape, figure_kind
from remat.core.shapes import byte_grid, ladder
from remat.models import load_model
from remat.profiling.profiler import profile
from remat.profiling.shaped import batch_axes, profile_shapes, resize, time_shapes

HERE = Path(__file__).parent

CASES: list[tuple[str, dict[str, Any], str, list[tuple[int, ...]]]] = [
    ("gpt", {}, "seq=16..128:8", [(56,), (88,), (120,)]),
    ("gpt", {}, "batch=2..6,seq=16..96:8", [(4, 56), (5, 88)]),
    ("hf:llama", {}, "seq=32..512:8", [(152,), (304,), (480,)]),
    ("resnet", {}, "side=16..64:8", [(40,), (56,)]),
    ("convnet-bn", {}, "batch=2..16:2", [(8,), (14,)]),
    ("mlp-hetero", {}, "batch=2..32:2", [(14,), (30,)]),
    # a range from batch 1: the gpt's figures there are off the larger batches' polynomial
    ("gpt", {}, "batch=1..6,seq=16..96:8", [(4, 56), (5, 88)]),
]


def _case(name: str, options: dict[str, Any], shapes: str,
          held_out: list[tuple[int, ...]]) -> dict[str, Any]:
    model, batch, loss = load_model(name, **options)
    start = time.perf_counter()
    prof = profile_shapes(model, batch, loss, shapes, repeats=1)
    took = time.perf_counter() - start
    fit = prof.shapes
    assert fit is not None
    seen = {*byte_grid(fit.dims), *itertools.product(*ladder(fit.dims)), *time_shapes(fit.dims)}
    axes = batch_axes(batch, fit.dims)
    rows = []
    for shape in held_out:
        if shape in seen:
            raise SystemExit(f"{shape} is a profiled shape of {shapes}; hold out another")
        sized = resize(batch, axes, dict(zip(fit.dims.names, shape, strict=True)))
        measured = profile(model, sized, loss, list(prof.stage_names), prof.optimizer,
                           repeats=1)
        got = numeric_paths(measured.to_dict())
        want = numeric_paths(at_shape(prof, shape).to_dict())
        paths = [p for p, v in want.items() if figure_kind(p, v) == "bytes"]
        wrong = {p: int(want[p]) - int(got[p]) for p in paths if got.get(p) != want[p]}
        rows.append({"shape": fit.dims.shape_text(shape), "fields": len(paths),
                     "differ": len(wrong),
                     "differ_not_stepped": sorted(p for p in wrong if p not in fit.steps),
                     "most_over": max(wrong.values(), default=0),
                     "most_under": max(0, max((-d for d in wrong.values()), default=0))})
    return {"model": name, "range": shapes, "profile_s": took, "polynomial": len(fit.bytes),
            "maxima": len(fit.envelopes),
            "terms": sum(len(t) for t in fit.envelopes.values()),
            "stepped": len(fit.steps), "held_out": rows}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "shape_fit_exact.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for case in CASES:
        results.append(_case(*case))
        print(results[-1], flush=True)
    lines = [
        "# Range profiles against fresh profiles at held-out shapes: every byte figure",
        "",
        "Issue 48, item 1. Written by `benchmarks/shape_fit_exact.py`:",
        "",
        "```console",
        "$ PYTHONPATH=src .venv/bin/python benchmarks/shape_fit_exact.py",
        "```",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, one thread, CPU; "
        f"remat at commit {_commit()}; {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        "- each model at its built-in default size; every held-out shape is on neither the "
        "byte grid, the ladder nor the timed shapes; figures are bytes (one run)",
        "- *maxima*: peaks fitted term by term (Note [Maxima fitted term by term]); "
        "*over*/*under*: the fit's figure above/below the fresh profile's",
        "",
        "| model | range | polynomials | maxima (terms) | stepped | held-out shape | byte "
        "figures | differing | of them not stepped | most over | most under |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for h in r["held_out"]:
            lines.append(
                f"| {r['model']} | `{r['range']}` | {r['polynomial']} | {r['maxima']} "
                f"({r['terms']}) | {r['stepped']} | {h['shape']} | {h['fields']} | "
                f"{h['differ']} | {len(h['differ_not_stepped'])} | {h['most_over']} B | "
                f"{h['most_under']} B |")
    exact = sum(1 for r in results for h in r["held_out"] if not h["differ_not_stepped"]
                and not h["most_under"])
    total = sum(len(r["held_out"]) for r in results)
    lines += ["", f"Held-out shapes where every figure that is not stepped equals the fresh "
              f"profile's and none is under it: **{exact} of {total}**.", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
