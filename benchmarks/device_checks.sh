#!/usr/bin/env bash
# The checks run on a lent GPU machine (one H200, 16 CPU cores), in one call from the
# repository root; results land in $OUT. The CPU benchmarks run with the GPU hidden
# (FSDP2's default mesh would take the accelerator) and use the machine's 16 cores,
# where this project's own machine has 2.
set -u
export PYTHONPATH=src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
{ date -u; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
(CUDA_VISIBLE_DEVICES= timeout 330 python3 benchmarks/distributed_time.py --runs 3 \
   --rounds 10 --out "$OUT/distributed_time.md" > "$OUT/distributed_time.log" 2>&1) &
(CUDA_VISIBLE_DEVICES= timeout 170 python3 -m torch.distributed.run --nproc-per-node 4 \
   benchmarks/pipeline_ranks.py --rounds 10 --out "$OUT/pipeline4.md" > "$OUT/pipeline4.log" 2>&1
 CUDA_VISIBLE_DEVICES= timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 \
   benchmarks/pipeline_ranks.py --rounds 10 --out "$OUT/pipeline2.md" > "$OUT/pipeline2.log" 2>&1) &
timeout 60 python3 -m pytest -o addopts="" -q -m cuda tests/test_tracker.py >> "$OUT/env.txt" 2>&1
OMP_NUM_THREADS=4 timeout 300 python3 benchmarks/accelerator_check.py --on cuda --target h200 \
  > "$OUT/accelerator_check.md" 2>&1
wait
date -u >> "$OUT/env.txt"
