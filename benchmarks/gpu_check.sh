#!/usr/bin/env bash
# The GPU-only checks of the performance issue as one prepared script, for a session whose task is lent a GPU
# machine through the `device` tool. Not run in CI (CI has no GPU). Untested so far: no session that wrote it was
# lent a GPU.
#
#   here, once:  bash benchmarks/gpu_check.sh --download      (.whl/ is git-ignored)
#   there:       device run, carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout_s 540
#
# The GPU image already holds torch, lightning, transformers, torchmetrics, peft, pandas and pyarrow; TRL (the peer)
# and its datasets dependency travel as wheels in .whl (about 2 MB). Output: $OUT/gpu_check.txt and the JSON rows.
set -euo pipefail
if [[ "${1:-}" == "--download" ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  exit 0
fi
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
  python3 -c "import torch, transformers, lightning, trl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'trl', trl.__version__)"
  # like for like: fp32 without activation checkpointing on both sides, then bf16 mixed precision on both sides
  python3 benchmarks/throughput.py --device cuda --trials 1 --steps 4 \
      --impls polopt trl:gradient_checkpointing=false 'polopt:precision="bf16-mixed"' \
      'trl:bf16=true,gradient_checkpointing=false' \
      --json "$OUT/throughput_gpu.json"
} 2>&1 | tee "$OUT/gpu_check.txt"
