"""A Llama-2-70B-sized model profiled from fake tensors on this CPU: time and memory.

Issue 18's target: a Llama-2-70B-shaped config (80 layers, hidden 8192, 64 heads, 8
key/value heads, intermediate 28672, sequence 4096, micro-batch 1, bf16) profiles in
<= 20 s and <= 2 GiB of resident memory. Each run is a new process: it builds the model
(transformers' Llama from a config, bf16 as the default dtype) under ``remat.fake_mode()``
and runs ``remat.profile(..., fake=True)``; reported: the build and profile wall times,
the process's peak resident memory (``ru_maxrss``) and what the profile counted.

    PYTHONPATH=src .venv/bin/python benchmarks/fake_scale.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import remat
from remat.models import load_model
layers = int(sys.argv[1])
t0 = time.perf_counter()
torch.set_default_dtype(torch.bfloat16)
with remat.fake_mode():
    model, batch, loss_fn = load_model(
        "hf:llama", num_hidden_layers=layers, hidden_size=8192, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=28672, seq_len=4096, batch_size=1,
        vocab_size=32000, max_position_embeddings=4096)
torch.set_default_dtype(torch.float32)
t1 = time.perf_counter()
p = remat.profile(model, batch, loss_fn, fake=True)
t2 = time.perf_counter()
s = p.stages[len(p.stages) // 2]
print(json.dumps({
    "layers": layers, "build_s": t1 - t0, "profile_s": t2 - t1,
    "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "model": p.model, "stages": len(p.stages), "dtype": p.dtype,
    "keep_saved_gib": s.saved_bytes["keep"] / 2**30, "boundary_mib": s.boundary_bytes / 2**20,
    "params_gib": p.fixed.params_bytes / 2**30,
    "optimizer_state_gib": p.fixed.optimizer_state_bytes / 2**30,
    "peak_gib": p.predicted_peak_bytes / 2**30}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--layers", type=int, default=80)
    args = parser.parse_args()
    print("| run | build s | profile s | total s | max RSS GiB | stages | keep saved per layer "
          "GiB | boundary MiB | parameters GiB | AdamW state GiB | peak without "
          "checkpointing GiB |")
    print("| --- |" + " --- |" * 10)
    for run in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.layers)], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {run + 1} | {r['build_s']:.1f} | {r['profile_s']:.1f} | "
              f"{r['build_s'] + r['profile_s']:.1f} | {r['max_rss_gib']:.2f} | {r['stages']} | "
              f"{r['keep_saved_gib']:.2f} | {r['boundary_mib']:.0f} | {r['params_gib']:.1f} | "
              f"{r['optimizer_state_gib']:.1f} | {r['peak_gib']:.1f} |", flush=True)
    print(f"\nmodel as profiled: {r['model']}, dtype {r['dtype']}")


if __name__ == "__main__":
    main()
