"""Throughput of one RL step: polopt-lightning against TRL's GRPOTrainer, same weights, prompts and settings.

Each trial runs in a fresh subprocess (so peak resident memory is that run's own), alternating polopt / TRL, and
completions are forced to full length (min_new_tokens = max_new_tokens) so both do identical work.

    python benchmarks/throughput.py                       # all workloads, 2 alternating trials each
    python benchmarks/throughput.py --workloads tiny --trials 3 --steps 6
    python benchmarks/throughput.py --device cuda         # on a GPU machine (peak = GPU memory allocated)

Prints per workload: median seconds per rollout step (one optimizer step on-policy; all mini-batch steps of one
rollout off-policy), generated tokens per second, peak RSS (GPU memory with --device cuda), the polopt/TRL speed ratio, and the FLOP floor: the
step's FLOPs (2N per generated or scored token, 6N per trained token, prompts counted once per group, N =
non-embedding parameters) over the fp32 matmul throughput measured at the start of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

WORKLOADS = {
    # name: model shape and step settings
    "tiny": dict(hidden=256, layers=4, heads=4, intermediate=512, prompts=2, generations=8, prompt_len=8,
                 new_tokens=32, beta=0.04, mini_batches=1),
    "long-prompt": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=2, generations=8, prompt_len=128,
                        new_tokens=128, beta=0.04, mini_batches=1),
    "off-policy": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=2, generations=8, prompt_len=128,
                       new_tokens=128, beta=0.04, mini_batches=4),
}


@dataclass
class TrialResult:
    impl: str
    workload: str
    step_s: list[float]
    peak_rss_gib: float
    generated_tokens_per_step: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def build(workload: dict, seed: int = 0):
    """The workload's model (Qwen2 config, char tokenizer) and prompts; identical in every process."""
    import random

    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=workload["hidden"], num_layers=workload["layers"],
                                  num_heads=workload["heads"], intermediate_size=workload["intermediate"], seed=seed)
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-="
    prompts = ["".join(rng.choice(alphabet) for _ in range(workload["prompt_len"])) for _ in range(64)]
    return model, tok, prompts


def _sync(device: str) -> None:
    """Wait for queued GPU work so a step's wall time is its own."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def length_reward(prompts, completions, **kwargs):
    """Cheap and varied, so groups carry signal (rewards are not what is measured)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def run_polopt(workload: dict, steps: int, overrides: dict | None = None, device: str = "cpu") -> list[float]:
    import lightning as L
    import torch

    from polopt_lightning import PolicyOptimizationModule, PromptDataModule

    model, tok, prompts = build(workload)
    data = PromptDataModule(train=[{"prompt": p} for p in prompts], tokenizer=tok, batch_size=workload["prompts"],
                            shuffle=False)
    n = workload["new_tokens"]
    module = PolicyOptimizationModule(
        model, tok, objective={"name": "grpo", "beta": workload["beta"]}, reward_fns=[length_reward],
        num_generations=workload["generations"], mini_batches=workload["mini_batches"],
        generation={"max_new_tokens": n, "min_new_tokens": n, "temperature": 1.0}, lr=1e-6,
        **(overrides or {}),
    )
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args):
            _sync(device)
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args):
            _sync(device)
            times.append(time.perf_counter() - self.t)

    trainer = L.Trainer(max_steps=steps * workload["mini_batches"], accelerator=device, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    torch.manual_seed(0)
    trainer.fit(module, datamodule=data)
    return times


def run_trl(workload: dict, steps: int, device: str = "cpu") -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok, prompts = build(workload)
    # TRL builds its reference model from the policy's path: save the (seeded, identical) weights first
    model_dir = tempfile.mkdtemp(prefix="trl_model_")
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    completions_per_rollout = workload["prompts"] * workload["generations"]
    mb = workload["mini_batches"]
    n = workload["new_tokens"]
    out = tempfile.mkdtemp(prefix="trl_bench_")
    config = GRPOConfig(
        output_dir=out, use_cpu=device == "cpu", bf16=False, fp16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=completions_per_rollout // mb, steps_per_generation=mb,
        gradient_accumulation_steps=1, num_generations=workload["generations"], max_completion_length=n,
        generation_kwargs={"min_new_tokens": n}, temperature=1.0, beta=workload["beta"], num_iterations=1,
        learning_rate=1e-6, max_steps=steps * mb, logging_steps=1, disable_dropout=True, shuffle_dataset=False,
        dataloader_num_workers=0, seed=0,
    )
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            step_times.append(time.perf_counter() - self.t)

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tok,
                          callbacks=[Timer()])
    trainer.train()
    # one rollout = mb optimizer steps (TRL generates on the first of them)
    return [sum(step_times[i:i + mb]) for i in range(0, len(step_times) - mb + 1, mb)]


def child(impl: str, name: str, steps: int, threads: int, device: str = "cpu") -> None:
    import torch

    torch.set_num_threads(threads)
    workload = WORKLOADS[name]
    if impl == "trl":
        times = run_trl(workload, steps, device)
    else:  # "polopt" or a lever switched off, e.g. "polopt:share_prompt=false"
        overrides = {}
        for item in impl.partition(":")[2].split(",") if ":" in impl else []:
            key, _, value = item.partition("=")
            overrides[key] = json.loads(value)
        times = run_polopt(workload, steps, overrides, device)
    if device == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    else:  # accelerator memory is what bounds a GPU run
        peak = torch.cuda.max_memory_allocated() / 2**30
    generated = workload["prompts"] * workload["generations"] * workload["new_tokens"]
    print("RESULT " + json.dumps(asdict(TrialResult(impl, name, times[1:] or times, peak, generated))))


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 5, rounds: int = 5, device: str = "cpu") -> float:
    """Best of ``rounds`` timings of fp32 ``size x size`` matrix products: what the hardware gives this process."""
    import torch

    torch.set_num_threads(threads)
    if device != "cpu":  # a GPU needs more work per timing to be measured at all
        size, repeats = 8192, 20
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeats):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 * repeats / best / 1e9


def flop_floor(workload: dict) -> float:
    """FLOPs of one rollout step with each prompt counted once per group."""
    from polopt_lightning.models import build_tiny_model, count_parameters

    model, _ = build_tiny_model(hidden_size=workload["hidden"], num_layers=workload["layers"],
                                num_heads=workload["heads"], intermediate_size=workload["intermediate"])
    N = count_parameters(model, non_embedding=True)
    P, G, Lp, T = workload["prompts"], workload["generations"], workload["prompt_len"], workload["new_tokens"]
    generated = P * G * T
    scored = P * Lp + P * G * T  # prompt once per group + every completion token
    flops = 2 * N * (P * Lp + generated)  # prefill + sampling
    if workload["beta"] > 0:
        flops += 2 * N * scored  # reference pass
    flops += 6 * N * scored  # training forward + backward
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--trials", type=int, default=2, help="alternating polopt/TRL trials per workload")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps per trial (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both trainers run")
    parser.add_argument("--impls", nargs="+", default=["polopt", "trl"],
                        help="polopt, trl, or polopt:KEY=JSON,... for polopt with module arguments changed, to "
                             "measure a lever (e.g. polopt:share_prompt=false or 'polopt:rollout_dtype=\"bfloat16\"')")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.steps, args.threads, args.device)

    gflops = matmul_gflops(args.threads, device=args.device)
    print(f"machine: {os.cpu_count()} CPUs, {args.threads} torch threads, device {args.device}; "
          f"fp32 matmul {gflops:.0f} GFLOP/s; peak = {'resident memory' if args.device == 'cpu' else 'GPU memory allocated'}")
    rows = []
    for name in args.workloads:
        results: dict[str, list[TrialResult]] = {impl: [] for impl in args.impls}
        for trial in range(args.trials):
            for impl in args.impls:  # alternate A/B so drift on the machine hits both
                cmd = [sys.executable, __file__, "--child", impl, name, "--steps", str(args.steps),
                       "--threads", str(args.threads), "--device", args.device]
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"{impl} on {name} failed (trial {trial})")
                r = TrialResult(**json.loads(line[len("RESULT "):]))
                results[impl].append(r)
                print(f"  {name:12s} {impl:20s} trial {trial}: {r.median_s:.3f} s/step, peak {r.peak_rss_gib:.2f} GiB",
                      flush=True)
        floor_s = flop_floor(WORKLOADS[name]) / (gflops * 1e9)
        row = {"workload": name, "floor_s": floor_s}
        for impl, rs in results.items():
            all_steps = [s for r in rs for s in r.step_s]
            row[impl] = {"s_per_step": statistics.median(all_steps),
                         "tokens_per_s": rs[0].generated_tokens_per_step / statistics.median(all_steps),
                         "peak_rss_gib": max(r.peak_rss_gib for r in rs)}
        rows.append(row)

    print()
    header = "| workload | run | s/step | speed-up vs TRL | generated tok/s | peak GiB | FLOP floor s | s/step / floor |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows:
        trl = row.get("trl")
        for impl in [k for k in row if k not in ("workload", "floor_s")]:
            r = row[impl]
            speed = f"{trl['s_per_step'] / r['s_per_step']:.2f}x" if trl else "-"
            print(f"| {row['workload']} | {impl} | {r['s_per_step']:.3f} | {speed} | {r['tokens_per_s']:.0f} "
                  f"| {r['peak_rss_gib']:.2f} | {row['floor_s']:.3f} | {r['s_per_step'] / row['floor_s']:.2f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gflops": gflops, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
