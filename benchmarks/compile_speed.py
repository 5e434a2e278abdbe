"""Where torch.compile's speed comes from: whole-model compilation against regional.

remat compiles stage by stage (regional compilation), so its plans can run each stage
compiled with its own option, and rebuild it. ``torch.compile`` of the whole step compiles
the chain as one graph with the code around it. This measures, with no checkpointing at
all, what each way of compiling gives on its own (so at ``compile@1.0``, where compile
recomputes nothing, the most remat+compile can reach is the ``stages`` row):

* ``eager``: the model as written;
* ``compile``: ``torch.compile(loss_fn)``, the whole step's forward (what ``remat bench``'s
  compile rows run, at ``activation_memory_budget`` 1.0);
* ``stages``: ``remat.compile_stages(model)``, each stage's forward compiled;
* ``stages+plan``: the same with ``remat.apply(model, plans.none(model))`` (remat's
  runtime around each stage, checkpointing nothing);
* ``stages+outside`` (gpt only): ``stages`` with the code before and after the chain
  (embeddings; final norm, head and cross entropy) compiled as two graphs of their own.

Each row's step (forward, backward, AdamW step) runs in interleaved rounds after 3
warm-up steps; reported: per row the median step time and the median of per-round ratios
to the ``compile`` row. Dropout runs under inductor's ``fallback_random`` (as in
``remat bench --compile``). One process per run.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_speed.py --runs 2 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

MODELS = {
    "gpt": ("gpt", {}),
    "mlp-hetero": ("mlp-hetero", {}),
    "convnet-bn": ("convnet-bn", {}),
    "hf:llama": ("hf:llama", {"num_hidden_layers": 8, "hidden_size": 256}),
}


def _outside(model: Any) -> Any:
    """gpt's loss with the code before and after its blocks compiled apart."""
    import torch
    import torch.nn.functional as F

    @torch.compile
    def pre(idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return model.drop(model.wte(idx) + model.wpe(pos))

    @torch.compile
    def post(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(model.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def loss(m: Any, batch: Any) -> torch.Tensor:
        idx, targets = batch
        x = pre(idx)
        for block in m.blocks:
            x = block(x)
        return post(x, targets)

    return loss


def measure(name: str, rounds: int) -> dict[str, dict[str, float]]:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch._inductor.config as inductor_config

    import remat
    from remat import plans
    from remat.models import load_model

    torch.set_num_threads(1)
    inductor_config.fallback_random = True
    model_name, options = MODELS[name]

    def make() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        return load_model(model_name, **options)

    rows: dict[str, tuple[Any, Any, Any]] = {}
    rows["eager"] = make()
    m, b, loss_fn = make()
    rows["compile"] = (m, b, torch.compile(loss_fn))
    m, b, loss_fn = make()
    remat.compile_stages(m)
    rows["stages"] = (m, b, loss_fn)
    m, b, loss_fn = make()
    remat.compile_stages(m)
    remat.apply(m, plans.none(m))
    rows["stages+plan"] = (m, b, loss_fn)
    if name == "gpt":
        m, b, _ = make()
        remat.compile_stages(m)
        rows["stages+outside"] = (m, b, _outside(m))
    optimizers = {k: torch.optim.AdamW(v[0].parameters(), lr=1e-3) for k, v in rows.items()}

    def step(key: str) -> float:
        model, batch, loss = rows[key]
        t = time.perf_counter()
        loss(model, batch).backward()
        optimizers[key].step()
        optimizers[key].zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for key in rows:
        for _ in range(3):
            step(key)
    times: dict[str, list[float]] = {key: [] for key in rows}
    for _ in range(rounds):
        for key in rows:
            times[key].append(step(key))
    base = times["compile"]
    return {
        key: {"median_s": statistics.median(v),
              "ratio_to_compile": statistics.median(a / c for a, c in zip(v, base, strict=True))}
        for key, v in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rounds)))
        return
    for name in args.models:
        print(f"### {name}\n")
        print("| row | " + " | ".join(f"run {r + 1}: step ms, ratio to compile"
                                      for r in range(args.runs)) + " |")
        print("| --- |" + " --- |" * args.runs)
        results = []
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, "--rounds", str(args.rounds)],
                check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
        for key in results[0]:
            cells = [f"{r[key]['median_s'] * 1e3:.1f}, {r[key]['ratio_to_compile']:.3f}"
                     for r in results]
            print(f"| {key} | " + " | ".join(cells) + " |")
        print(flush=True)


if __name__ == "__main__":
    main()
