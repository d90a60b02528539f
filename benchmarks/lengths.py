"""Cost against completion length, with lengths that vary as sampled ones do: polopt against TRL's GRPOTrainer,
phase by phase, at several length caps, in one run.

    python benchmarks/lengths.py --shape qwen2.5-0.5b --model-dir /tmp/q05b --lengths 128 512 1024 \
        --impls 'polopt:update={"gradient_checkpointing":true}' 'trl:gradient_checkpointing=true' --plot out.png
    python benchmarks/lengths.py --shape small --lengths 32 64 --steps 2 --impls polopt       # a smoke run

How lengths vary: no completion is forced. The model's generation config lists, besides the tokenizer's EOS, one
token in every ``k`` of the vocabulary (``k`` = ``--mean-fraction`` x the cap), so a completion ends at each token
with a chance of about ``1 / k`` (the random model samples near uniformly): lengths spread geometrically, most short,
some cut at the cap (about e^-1/f of them). Both trainers stop on those tokens and mask after them (TRL reads the
model's generation config; so does polopt). Each (cap, implementation) runs ``--steps`` steps in a fresh process of
``real_scale.py`` (its ``--setting``, fp32 unless told; its phases: rollout, reference pass, training forward + backward, the rest),
the first step left out. Printed per cap and implementation: seconds a step and per phase, the tokens generated
(mean over the steps), generated tokens per second of rollout, seconds a step per 1,000 generated tokens, peak resident
memory; the speed and memory ratios of polopt's first implementation to TRL's at each cap; and the growth of the cost
per generated token from the smallest cap to the largest. ``--plot`` draws cost per generated token and peak memory
against the cap. ``--heap`` adds each phase's highest live and held memory of the C library's allocator
(``memory.HeapSampler``): a resident peak far above the live one is memory the allocator keeps around its blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import JOB, NO_HEAP, SHAPES, cpu_description, ensure_model  # noqa: E402
from real_scale import _mem_total_gib  # noqa: E402
from throughput import child_result  # noqa: E402

HERE = Path(__file__).resolve().parent


def set_stops(folder: str, every: int | None) -> list[int]:
    """Write the model's generation config: the tokenizer's EOS and (``every``) one ordinary token in every ``every``;
    returns the stop tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(folder)
    config = GenerationConfig.from_pretrained(folder)
    stops = [tok.eos_token_id]
    if every:  # over the model's vocabulary (what it samples from; the local tokenizer names fewer tokens)
        special = set(tok.all_special_ids)
        stops += [v for v in range(every // 2, AutoConfig.from_pretrained(folder).vocab_size, every)
                  if v not in special]
    config.eos_token_id = stops if every else tok.eos_token_id
    config.save_pretrained(folder)
    return stops


def run_one(folder: str, impl: str, cap: int, args) -> dict:
    cmd = [sys.executable, str(HERE / "real_scale.py"), "--child", impl, args.setting, folder, "--steps", str(args.steps),
           "--threads", str(args.threads), "--new-tokens", str(cap), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--sampled", "--device", args.device] + (["--heap"] if args.heap else [])
    return child_result(cmd, f"{impl} at {cap} tokens")


def summary(result: dict) -> dict:
    """The steps after the first: medians of seconds (step, phases), tokens and peak memory."""
    steps = result["step_s"][1:]
    phases = result["phases"][1:]
    tokens = result["tokens"][1:]
    rollout = [p.get("rollout", 0.0) for p in phases]
    return {"setting": result["setting"], "step_s": statistics.median(steps), "steps": steps,
            "phases": {k: statistics.median(p.get(k, 0.0) for p in phases)
                       for k in ("rollout", "reference", "training", "rest")},
            "tokens": statistics.mean(tokens), "tokens_per_step": tokens,
            "rollout_tokens_per_s": sum(tokens) / max(sum(rollout), 1e-9),
            "s_per_1k_tokens": 1000 * sum(steps) / max(sum(tokens), 1),
            "peak_gib": result["train_peak_gib"],
            "phase_peaks_gib": {k: max((p.get(k, 0.0) for p in result["phase_peaks"][1:]), default=0.0)
                                for k in ("rollout", "reference", "training", "rest")},
            **({"phase_live_held_gib": {k: [max((p.get(k, [0.0, 0.0])[i] for p in result["phase_heap"][1:]), default=0.0)
                                            for i in (0, 1)] for k in ("rollout", "reference", "training", "rest")}}
               if result.get("phase_heap") else {})}


def plot(rows: list[dict], impls: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for impl in impls:
        caps = [r["cap"] for r in rows if impl in r["results"]]
        a.plot(caps, [r["results"][impl]["s_per_1k_tokens"] for r in rows if impl in r["results"]], "o-", label=impl)
        b.plot(caps, [r["results"][impl]["peak_gib"] for r in rows if impl in r["results"]], "o-", label=impl)
    for ax, label in ((a, "seconds a step per 1,000 generated tokens"), (b, "peak resident memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion length cap (tokens; lengths sampled below it)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--impls", nargs="+", default=["polopt", "trl"],
                        help="as real_scale.py's (polopt:KEY=JSON,..., trl:KEY=JSON,...)")
    parser.add_argument("--mean-fraction", type=float, default=0.5,
                        help="a completion's chance to end at each token is about 1 / (this x the cap)")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps a run (the first is left out)")
    parser.add_argument("--setting", default="fp32", choices=["fp32", "bf16-mixed"],
                        help="real_scale.py's setting both trainers run under (bf16-mixed: polopt's "
                             "trainer.precision=bf16-mixed, TRL's bf16=True)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both trainers run")
    parser.add_argument("--model-dir", required=True, help="the model's folder (built there if missing)")
    parser.add_argument("--json", help="write the measurements to this file")
    parser.add_argument("--plot", help="draw the cost and memory against the cap to this image")
    parser.add_argument("--heap", action="store_true",
                        help="also each phase's highest live and held memory of the C library's allocator (glibc's "
                             "mallinfo2, read every 5 ms: what the tensors need against what the process keeps)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is left out)")
    ensure_model(args.shape, args.model_dir)
    machine = f"{cpu_description()}, {args.threads} torch threads, {_mem_total_gib():.0f} GiB"
    if args.device == "cuda":
        import torch

        machine = f"{torch.cuda.get_device_name(0)}; {machine}"
    print(machine, flush=True)
    rows = []
    began = time.perf_counter()
    try:
        for cap in args.lengths:
            every = max(1, round(args.mean_fraction * cap))
            stops = set_stops(args.model_dir, every)
            row = {"cap": cap, "stop_tokens": len(stops), "results": {}}
            for impl in args.impls:
                result = summary(run_one(args.model_dir, impl, cap, args))
                row["results"][impl] = result
                ph = result["phases"]
                print(f"{cap:5d} {impl:50s} {result['step_s']:7.1f} s/step (rollout {ph['rollout']:.1f}, reference "
                      f"{ph['reference']:.1f}, training {ph['training']:.1f}, rest {ph['rest']:.1f}); "
                      f"{result['tokens']:.0f} tokens generated, {result['rollout_tokens_per_s']:.1f} tokens/s "
                      f"sampling, {result['s_per_1k_tokens']:.2f} s per 1k tokens, peak {result['peak_gib']:.2f} GiB "
                      f"(by phase {', '.join(f'{v:.2f}' for v in result['phase_peaks_gib'].values())})",
                      flush=True)
                if "phase_live_held_gib" in result:
                    print("      allocator, live / held GiB by phase: " + ", ".join(
                        f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in result["phase_live_held_gib"].items()), flush=True)
                elif args.heap:
                    print(f"      {NO_HEAP}", flush=True)
            rows.append(row)
    finally:
        set_stops(args.model_dir, None)  # the folder's generation config as it was built
    print(f"\n{machine}; {args.setting}; {JOB['prompt_len']}-token prompts, {args.prompts} x {args.generations} completions a step, "
          f"lengths sampled (a stop chance of 1 / ({args.mean_fraction} x cap) a token), {args.steps - 1} measured "
          f"step(s) a run; {time.perf_counter() - began:.0f} s in all\n")
    print("| cap | " + " | ".join(f"{impl} s/1k tokens (peak GiB)" for impl in args.impls) + " |")
    print("|---|" + "---|" * len(args.impls))
    for row in rows:
        cells = [f"{row['results'][i]['s_per_1k_tokens']:.2f} ({row['results'][i]['peak_gib']:.2f})"
                 for i in args.impls]
        print(f"| {row['cap']} | " + " | ".join(cells) + " |")
    polopt = next((i for i in args.impls if i.startswith("polopt")), None)
    trl = next((i for i in args.impls if i.startswith("trl")), None)
    if polopt and trl:  # per generated token: the two runs sampled different lengths
        for row in rows:
            p, t = row["results"][polopt], row["results"][trl]
            print(f"{row['cap']}: speed {t['s_per_1k_tokens'] / p['s_per_1k_tokens']:.2f}x TRL's (per generated "
                  f"token), peak {p['peak_gib'] / t['peak_gib']:.2f}x TRL's")
    for impl in args.impls:
        if len(rows) > 1:
            first, last = rows[0]["results"][impl], rows[-1]["results"][impl]
            print(f"{impl}: cost per generated token x{last['s_per_1k_tokens'] / first['s_per_1k_tokens']:.2f} from "
                  f"{rows[0]['cap']} to {rows[-1]['cap']}")
    run = {"machine": machine, "shape": args.shape, "job": {**JOB, "prompts": args.prompts,
                                                             "generations": args.generations},
           "mean_fraction": args.mean_fraction, "steps": args.steps, "setting": args.setting, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))
    if args.plot:
        plot(rows, args.impls, args.plot, f"{args.shape}, {machine}")


if __name__ == "__main__":
    main()
