"""What putting the caller's model back after a profile costs (issue 47, item 1).

``remat.profile`` trains the model in its measuring steps and puts it back afterwards
(Note [The user's model is the user's] in ``remat.measure.model_state``). This measures,
per model: the host bytes the copies hold (parameters and buffers; gradients the caller
left are kept by reference on the CPU), the time to capture and to restore (medians of
``--repeats`` rounds), and those set against one whole ``remat.profile`` of the model.

    PYTHONPATH=src .venv/bin/python benchmarks/model_restored.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import remat
from remat.measure.model_state import ModelState
from remat.models import load_model

MODELS = (("gpt", {}), ("mlp-hetero", {}), ("hf:llama", {}),
          ("gpt", {"n_layer": 12, "n_embd": 512}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| model | parameters + buffers | capture (median) | restore (median) | "
          "profile | capture + restore / profile |")
    print("|---|---|---|---|---|---|")
    for spec, options in MODELS:
        model, batch, loss_fn = load_model(spec, **options)
        nbytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        captures, restores = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            state = ModelState(model)
            captures.append(time.perf_counter() - t)
            t = time.perf_counter()
            state.restore()
            restores.append(time.perf_counter() - t)
        t = time.perf_counter()
        remat.profile(model, batch, loss_fn)
        profile_s = time.perf_counter() - t
        capture, restore = statistics.median(captures), statistics.median(restores)
        name = " ".join([spec, *(f"{k}={v}" for k, v in options.items())])
        print(f"| {name} | {nbytes / 2**20:.1f} MiB | {capture * 1e3:.1f} ms | "
              f"{restore * 1e3:.1f} ms | {profile_s:.1f} s | "
              f"{(capture + restore) / profile_s:.2%} |", flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
