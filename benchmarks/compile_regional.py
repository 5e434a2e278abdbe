"""Regional compilation: does compiling a chain of 8 identical blocks cost more than 2?

Each depth runs in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
a new temporary folder, ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``), so each pays the whole
compile: ``remat.compile_stages`` on the built-in gpt at that depth, then one training
step (forward and backward compile there). Reported: the first step's wall time, a
plain eager step's time for scale, and how many graphs Dynamo compiled.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_regional.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import torch
import torch._dynamo.utils as du
import remat
from remat.models import load_model
depth = int(sys.argv[1])
torch.set_num_threads(1)
model, batch, loss_fn = load_model("gpt", n_layer=depth)
t = time.perf_counter(); loss_fn(model, batch).backward(); eager = time.perf_counter() - t
model.zero_grad(set_to_none=True)
remat.compile_stages(model)
t = time.perf_counter(); loss_fn(model, batch).backward(); first = time.perf_counter() - t
print(json.dumps({"depth": depth, "first_step_s": first, "eager_step_s": eager,
                  "graphs": du.counters["stats"]["unique_graphs"]}))
"""


def run(depth: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
        out = subprocess.run([sys.executable, "-c", CHILD, str(depth)], env=env, check=True,
                             capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--depths", default="2,8")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for r in range(args.runs):  # interleaved: the machine's speed moves
        for depth in depths:
            row = run(depth)
            row["run"] = r + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| run | depth | graphs | first step (compile), s | eager step, s |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['run']} | {row['depth']} | {row['graphs']} | {row['first_step_s']:.1f} "
              f"| {row['eager_step_s']:.3f} |")
    for r in range(1, args.runs + 1):
        by = {row["depth"]: row["first_step_s"] for row in rows if row["run"] == r}
        print(f"run {r}: compile of {depths[-1]} blocks / {depths[0]} blocks = "
              f"{by[depths[-1]] / by[depths[0]]:.2f}")
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


if __name__ == "__main__":
    main()
