"""What numba adds to remat's install, and what it buys (issue 18, item 6).

numba is a dependency of remat (pyproject.toml), so ``pip install -e .`` (the README's
first line) brings it. Measured here, each in a new process (as a user's ``remat plan``
runs): the optimal solver on an 80-stage chain at 500 slots, and the one-level solver
(``segments_optimal``) on a 1,000-stage chain, with numba's kernel cache empty (the first
plan after installing), with it warm, and without numba (the numpy path); each solve is
also repeated in the same process (warm: what a library user who plans twice sees). The
chains are ``benchmarks/solver_speed.py``'s random heterogeneous ones (three options per
stage, budget halfway between per-stage regions and no checkpointing). Also the disk
numba and llvmlite take in the environment.

    PYTHONPATH=src .venv/bin/python benchmarks/solver_install.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, "benchmarks")
from solver_speed import random_chain, budget_of
if sys.argv[1] == "numpy":
    import remat.core.solve.dp_numba as dn
    dn.available = lambda: False
from remat.core.solve import solvers
out = {}
for name, n, solve in (("optimal 80 x 500", 80, solvers.optimal),
                       ("one-level 1000 x 500", 1000, solvers.segments_optimal)):
    p = random_chain(n)
    b = budget_of(p)
    t = time.perf_counter(); solve(p, b); first = time.perf_counter() - t
    t = time.perf_counter(); solve(p, b); again = time.perf_counter() - t
    out[name] = [first, again]
print(json.dumps(out))
"""


def _child(mode: str, cache: str) -> dict[str, list[float]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _size(package: str) -> float:
    import importlib

    path = Path(importlib.import_module(package).__file__).parent
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[list[float]]]] = {}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            for mode, label in (("numba", "numba, cache empty"), ("numba", "numba, cache warm"),
                                ("numpy", "numpy (no numba)")):
                for problem, times in _child(mode, cache).items():
                    rows.setdefault(problem, {}).setdefault(label, []).append(times)
    print(f"numba {_size('numba'):.0f} MiB and llvmlite {_size('llvmlite'):.0f} MiB on disk "
          f"here; {args.runs} runs, medians (s)\n")
    print("| problem | path | new process, first solve | same process, again |")
    print("| --- | --- | --- | --- |")
    for problem, by_label in rows.items():
        for label, runs in by_label.items():
            first = statistics.median(r[0] for r in runs)
            again = statistics.median(r[1] for r in runs)
            print(f"| {problem} | {label} | {first:.3f} | {again:.3f} |")


if __name__ == "__main__":
    main()
