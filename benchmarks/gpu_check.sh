#!/usr/bin/env bash
# The GPU-only checks as one prepared script, for a session whose task is lent a GPU machine through the `device`
# tool. Not run in CI (CI has no GPU). Results and their machine: docs/performance.md ("On a GPU").
#
#   here, once:  bash benchmarks/gpu_check.sh --download      (.whl/ is git-ignored; ~45 MB, bitsandbytes most of it)
#   there:       device run, carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout_s 500
#                (or name sections to run only those: "bash benchmarks/gpu_check.sh tests nf4")
#
# The GPU image holds torch, lightning, transformers, torchmetrics, peft, accelerate, pandas and pyarrow; what it
# lacks travels as wheels in .whl: hydra-core, omegaconf and antlr (the CLI), bitsandbytes (nf4, 8-bit optimizers),
# TRL and datasets (the peer). Each section has a time limit of its own, so one that hangs leaves the others their
# time; everything goes to $OUT/gpu_check.txt and the benchmarks' JSON rows to $OUT.
set -uo pipefail
if [[ "${1:-}" == "--download" ]]; then
  set -e
  p=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
  for w in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 hydra-core==1.3.8 omegaconf==2.3.1 \
           bitsandbytes==0.50.2; do
    python3 -m pip download -q "${p[@]}" "$w"
  done
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # published as a source archive only
  exit 0
fi
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
section() {  # section NAME SECONDS COMMAND...: run it under its limit and say how it ended
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit} s)"
  timeout -k 10 "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
  python3 -c "import torch, transformers, lightning, peft, bitsandbytes, trl, hydra; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'lightning', lightning.__version__, \
'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__, 'trl', trl.__version__)"
  sections=("${@:-tests fp32 nf4 tiny vllm}")
  for name in ${sections[*]}; do
    case $name in
      # nf4 + LoRA with bitsandbytes' 8-bit optimizers; DDP and FSDP on one device against the plain run (DeepSpeed
      # is skipped with its reason: it builds from source, which this image cannot)
      tests) section "pytest -m gpu" 210 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider ;;
      # the real-scale job (Qwen2.5-0.5B's shape) against TRL: full fine-tuning in fp32, then nf4+LoRA
      fp32|nf4) setting=$([[ $name == fp32 ]] && echo fp32 || echo nf4+lora)
        section "real_scale cuda $setting" 150 python3 benchmarks/real_scale.py --device cuda --settings "$setting" \
            --impls polopt trl --trials 1 --steps 5 --threads 8 --model-dir /tmp/qwen-shape \
            --json "$OUT/real_scale_gpu_$name.json" ;;
      # the tiny workload like for like (fp32, no activation checkpointing on either side)
      tiny) section "throughput cuda" 70 python3 benchmarks/throughput.py --device cuda --workloads tiny --trials 1 \
            --steps 4 --threads 8 --impls polopt trl:gradient_checkpointing=false --json "$OUT/throughput_gpu.json" ;;
      # vLLM on CUDA (colocated, weight sync equality, sleep mode, the real-scale job with rollout=vllm): only where
      # the image has vLLM (its CUDA wheels are far over what a run carries); otherwise it says so
      vllm) if python3 -c "import vllm" 2>/dev/null; then
          section "pytest -m vllm" 240 python3 -m pytest -m vllm tests/test_vllm.py -q -p no:cacheprovider
          section "real_scale cuda fp32 rollout=vllm" 200 python3 benchmarks/real_scale.py --device cuda \
              --settings fp32 --impls polopt 'polopt:engine={"name":"vllm","enable_sleep_mode":true}' trl \
              --trials 1 --steps 5 --threads 8 --model-dir /tmp/qwen-shape --json "$OUT/real_scale_gpu_vllm.json"
        else
          echo "=== vllm: not installed on this image (vLLM's CUDA wheels cannot travel in .whl); skipped"
        fi ;;
      # long completions (issue 51): lengths sampled below 512 and 1,024 tokens, the fused head (on by default there),
      # padding-free passes and TRL, per phase (not in the default sections: name it, "bash benchmarks/gpu_check.sh long")
      long) section "lengths cuda" 240 python3 benchmarks/lengths.py --device cuda --shape qwen2.5-0.5b \
            --lengths 512 1024 --impls polopt 'polopt:update={"padding_free":true}' trl --threads 8 \
            --model-dir /tmp/qwen-shape --json "$OUT/lengths_gpu.json" --plot "$OUT/lengths_gpu.png" ;;
      # generation apart from training (issue 52): the weight group over NCCL (tests/test_gpu.py's server test), then a
      # server and the trainer on one device, taking turns and overlapping (experience.max_staleness=1); with two
      # devices, the server on the second ("bash benchmarks/gpu_check.sh async")
      async) section "pytest -m gpu -k server" 120 python3 -m pytest -m gpu tests/test_gpu.py -k server -q \
            -p no:cacheprovider
        section "async pipeline cuda" 240 python3 benchmarks/async_pipeline.py --shape heavy --seeds 0 \
            --modes server server-async --server-args "--device cuda:$(($(nvidia-smi -L | wc -l) - 1))" \
            --json "$OUT/async_gpu.json" -- trainer=gpu ;;
      *) echo "unknown section $name (tests, fp32, nf4, tiny, vllm, long, async)"; exit 2 ;;
    esac
  done
} 2>&1 | tee "$OUT/gpu_check.txt"
