"""The step at real scale, phase by phase against its floors: polopt against TRL's GRPOTrainer on the job of
``memory.py`` (a model shaped like Qwen2.5-0.5B: 494M parameters, tied embeddings, vocabulary 151,936; random weights
from its config numbers, no download), under full fine-tuning in fp32, full fine-tuning under bf16 autocast, LoRA
and nf4+LoRA, with the same settings on both sides.

    python benchmarks/real_scale.py --settings fp32 --impls polopt 'polopt:rollout_dtype="bfloat16"' trl
    python benchmarks/real_scale.py --settings bf16-mixed lora nf4+lora --interleave
    python benchmarks/real_scale.py --shape small --steps 3 --trials 1 --impls polopt     # a smoke run (seconds)
    python benchmarks/real_scale.py --summarize a.json b.json@lora,nf4+lora               # runs pooled
    python benchmarks/real_scale.py --summarize a.json b.json --impls polopt trl          # only these, pooled
    python benchmarks/real_scale.py --settings fp32 --new-tokens 512 --prompts 1 --generations 8 --steps 2 \
        --trials 1 --impls polopt 'polopt:update={"fused_head":false}' trl      # long completions, a lever off

The harness and statistics are ``throughput.py``'s: each (setting, implementation) trial runs in a fresh process;
``--interleave`` runs a trial's implementations side by side, taking turns step by step (step i of each ran back to
back, so the machine's drift hits both), where their memory fits beside each other (the estimate is printed; full
fine-tuning at 0.5B needs ~12 GiB a process, so on a 24 GiB machine those trials run one after the other, alternating
the implementations). Speed-ups are the median of per-step ratios (step i of trial k of each), with a 95% bootstrap
interval and their range; the first step of each trial (optimizer state allocated, warm-up) is left out. Runs
pooled with ``--summarize`` measure each step against the floors of the run it was measured in (the median of those
ratios; the floors' range is printed).

Phases, timed around the trainers' own methods (polopt: ``rollout``, ``scorer.reference``, ``updater.accumulate``;
TRL: ``_generate``, ``_get_per_token_logps_and_entropies`` without gradient (reference) and with it (training
forward), ``accelerator.backward``): rollout, reference pass, training forward + backward, and the rest of the step
(rewards, gradient norm and clipping, optimizer step, zeroing, bookkeeping). Each phase's floor, from the measured
matmul throughput (fp32 and bf16) and memory read bandwidth of this process:

- rollout: the prefill's FLOPs, then per new token the longer of its FLOPs (body and the 151,936-row head, 8 rows) and
  the bytes it must read (every weight once in the dtype it samples with, nf4 layers at 0.56 byte a weight, the keys
  and values so far, and the ``[rows, vocabulary]`` logits twice: once for the log-probs, once to draw the token);
- reference and training passes: FLOPs (2 per weight and scored token forward, 2 more backward for the activations'
  gradients, 2 more for the weights' under full fine-tuning; each prompt once per group; the head on completion
  positions only) at the rate of the dtype they compute in;
- rest: the optimizer's bytes at the bandwidth (AdamW reads gradient, weight and both moments and writes weight and
  moments, one more read of the gradients for the norm: 32 bytes per trained fp32 weight).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import JOB, SETTINGS, SHAPES, Phases, _cpu_name, ensure_model, run_polopt, run_trl  # noqa: E402
from throughput import (  # noqa: E402
    Baton,
    bootstrap_ci,
    matmul_gflops,
    memory_gbps,
    parse_impl,
    peak_rss_gib,
    run_child,
    run_interleaved,
)

# setting: (memory.py's setting, polopt overrides, TRL overrides)
REAL_SETTINGS = {
    "fp32": ("none", {}, {}),
    "bf16-mixed": ("none", {"precision": "bf16-mixed"}, {"bf16": True}),
    "lora": ("lora", {}, {}),
    "nf4+lora": ("nf4+lora", {}, {}),
}
PHASES = ("rollout", "reference", "training", "rest")
NF4_BYTES = 0.5 + 4 / 64  # 4-bit codes and one fp32 scale per 64-weight block


def shape_numbers(shape: str) -> dict:
    """Parameter counts of the shape (built on the meta device: no memory): total, embedding (the tied head),
    non-embedding, and the part in the blocks' linear layers (what nf4 quantizes)."""
    import torch
    from torch import nn

    from polopt_lightning.models import build_tiny_model, count_parameters

    s = SHAPES[shape]
    with torch.device("meta"):
        model, _ = build_tiny_model(hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                                    num_kv_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                                    vocab_size=s["vocab"], max_position_embeddings=1024)
    total = count_parameters(model)
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not name.endswith("lm_head"))
    head_dim = s["hidden"] // s["heads"]
    return {"total": total, "embedding": s["vocab"] * s["hidden"], "non_embedding": total - s["vocab"] * s["hidden"],
            "linear": linear, "vocab": s["vocab"], "hidden": s["hidden"],
            "kv_width": 2 * s["layers"] * s["kv_heads"] * head_dim, "lora": _lora_parameters(model)}


def _lora_parameters(model) -> int:
    from memory import LORA
    from torch import nn

    from polopt_lightning.models import LLAMA_TARGETS

    r = LORA["r"]
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in LLAMA_TARGETS)


def quantization_and_adapter(setting: str) -> tuple[str, str]:
    """``(quantization, adapter)`` of a setting, as memory.py names them (e.g. ``("nf4", "lora")``)."""
    return SETTINGS[REAL_SETTINGS[setting][0]]


def phase_dtypes(setting: str, impl: str, sampled: str | None = None) -> dict[str, str]:
    """What each phase computes in and, for decoding, the dtype of the weights it reads. ``sampled``: what polopt's
    engine sampled with, as its trials recorded it (under autocast on the CPU it samples the float32 policy through
    oneDNN); without it (older result files) the rollout computes in the autocast dtype or ``rollout_dtype``."""
    name, o = parse_impl(impl)
    mixed = setting == "bf16-mixed"
    compute = "bfloat16" if mixed else "float32"
    if name == "polopt":
        sample = sampled or o.get("rollout_dtype") or (o.get("engine") or {}).get("dtype") or compute
        return {"sample": sample, "sample_weights": sample, "ref": o.get("ref_dtype") or compute, "train": compute}
    # TRL under bf16 autocast computes in bf16 but reads its fp32 weights (cast on every product)
    return {"sample": compute, "sample_weights": "float32", "ref": compute, "train": compute}


def phase_floors(numbers: dict, setting: str, impl: str, gflops: dict[str, float], gbps: float,
                 sampled: str | None = None) -> dict[str, float]:
    """Seconds each phase needs at the least on this machine (see the module's docstring)."""
    size = {"float32": 4, "bfloat16": 2}
    dt = phase_dtypes(setting, impl, sampled)
    P, G, Lp, T = JOB["prompts"], JOB["generations"], JOB["prompt_len"], JOB["new_tokens"]
    N = P * G
    body, head = numbers["non_embedding"], numbers["embedding"]  # per token: 2 FLOPs a weight
    quant, adapter = quantization_and_adapter(setting)
    w = size[dt["sample_weights"]]
    if quant == "nf4":  # the blocks' linear layers are read as 4-bit codes, the rest (head included) in fp32
        weight_bytes = numbers["linear"] * NF4_BYTES + (numbers["total"] - numbers["linear"]) * 4
    else:
        weight_bytes = numbers["total"] * w
    if adapter == "lora":
        weight_bytes += numbers["lora"] * 4
    rate = {k: gflops[v] * 1e9 for k, v in dt.items() if k != "sample_weights"}
    bw = gbps * 1e9
    decode = []
    for t in range(T):
        flops = 2 * (body + head) * N
        kv = numbers["kv_width"] * (P * Lp + N * t) * size[dt["sample"]]
        sampling = 2 * N * numbers["vocab"] * 4  # fp32 logits read for the log-probs and for the draw
        decode.append(max(flops / rate["sample"], (weight_bytes + kv + sampling) / bw))
    rollout = 2 * body * P * Lp / rate["sample"] + sum(decode)
    scored = 2 * body * (P * Lp + N * T) + 2 * head * N * T  # one forward, each prompt once per group
    full = adapter == "none"
    trained = numbers["total"] if full else numbers["lora"]
    return {"rollout": rollout, "reference": scored / rate["ref"] if JOB["beta"] > 0 else 0.0,
            "training": (3 if full else 2) * scored / rate["train"], "rest": 32 * trained / bw}


def estimated_peak_gib(numbers: dict, setting: str) -> float:
    """What one process needs, roughly: under full fine-tuning weights, reference, gradients and AdamW's two moments
    (20 bytes a weight) and a fifth more; with an adapter the base, its copies during decoding and activations."""
    full = quantization_and_adapter(setting)[1] == "none"
    return numbers["total"] * (24 if full else 8) / 2**30 + 1.0


def child(impl: str, setting: str, folder: str, steps: int, threads: int, baton: Baton | None,
          device: str = "cpu", heap: bool = False) -> None:
    import torch

    torch.set_num_threads(threads)
    name, overrides = parse_impl(impl)
    base, polopt_extra, trl_extra = REAL_SETTINGS[setting]
    phases = Phases(heap=heap)
    run = run_polopt if name == "polopt" else run_trl
    times, load_peak = run(folder, base, steps, {**(polopt_extra if name == "polopt" else trl_extra), **overrides},
                           baton, phases, device)
    # the phases reset the high-water mark at each of them: the training peak is the highest mark they read
    print("RESULT " + json.dumps({"impl": impl, "setting": setting, "job": JOB, "step_s": times, "phases": phases.steps,
                                  "phase_peaks": phases.peaks, "phase_heap": phases.heap_steps,
                                  "load_peak_gib": load_peak,
                                  "sample_dtype": phases.facts.get("sample_dtype"), "tokens": phases.tokens,
                                  "train_peak_gib": max(phases.overall, peak_rss_gib())}))


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            return int(next(x for x in fh if x.startswith("MemTotal:")).split()[1]) / 2**20
    except (OSError, StopIteration):
        return 0.0


def measure(args) -> dict:
    gflops = {dt: matmul_gflops(args.threads, dtype=dt, device=args.device) for dt in ("float32", "bfloat16")}
    gbps = memory_gbps(args.threads, device=args.device)
    numbers = shape_numbers(args.shape)
    gpu = ""
    if args.device == "cuda":
        import torch

        gpu = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
    machine = (f"{gpu}{_cpu_name()}, {os.cpu_count()} CPUs, {args.threads} torch threads, {_mem_total_gib():.0f} GiB; "
               f"matmul {gflops['float32']:.0f} GFLOP/s fp32, {gflops['bfloat16']:.0f} bf16; memory read "
               f"{gbps:.1f} GB/s")
    print(machine, flush=True)
    print(f"job: {JOB}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="polopt_real_scale_") as tmp:
        folder = args.model_dir or tmp
        ensure_model(args.shape, folder)
        for setting in args.settings:
            need = estimated_peak_gib(numbers, setting) * len(args.impls)
            interleave = args.interleave and need <= 0.75 * _mem_total_gib()
            print(f"{setting}: {'interleaved' if interleave else 'alternating trials'} (~{need:.1f} GiB for "
                  f"{len(args.impls)} processes side by side)", flush=True)
            trials: dict[str, list[dict]] = {impl: [] for impl in args.impls}
            for trial in range(args.trials):
                order = args.impls if trial % 2 == 0 else args.impls[::-1]  # A/B then B/A
                cmds = [[sys.executable, __file__, "--child", impl, setting, folder, "--steps", str(args.steps),
                         "--threads", str(args.threads), "--device", args.device, *job_arguments(args)]
                        for impl in order]
                began = time.perf_counter()
                outputs = run_interleaved(cmds) if interleave else [run_child(cmd) for cmd in cmds]
                print(f"  trial {trial}: {time.perf_counter() - began:.0f} s with loading", flush=True)
                for impl, (code, out, err) in zip(order, outputs):
                    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                    if code or line is None:
                        print(err[-4000:], file=sys.stderr)
                        raise SystemExit(f"{impl} under {setting} failed (trial {trial}, exit {code})")
                    result = json.loads(line[len("RESULT "):])
                    trials[impl].append(result)
                    print(f"  {setting:10s} {impl:34s} trial {trial}: {statistics.median(result['step_s'][1:]):6.2f} "
                          f"s/step, peak {result['train_peak_gib']:.2f} GiB", flush=True)
            rows.append({"setting": setting, "interleave": interleave, "trials": trials,
                         "floors": {impl: phase_floors(numbers, setting, impl, gflops, gbps, sampled(trials[impl]))
                                    for impl in args.impls}})
    return {"machine": machine, "gflops": gflops, "memory_gbps": gbps, "shape": args.shape, "numbers": numbers,
            "job": JOB, "steps": args.steps, "rows": rows}


def sampled(trials: list[dict]) -> str | None:
    """The dtype an implementation's trials sampled with (polopt's record it; TRL's and older files do not)."""
    return next((t["sample_dtype"] for t in trials if t.get("sample_dtype")), None)


def pool(runs: list[dict]) -> list[dict]:
    """Rows of several runs (same build and settings) as one: each setting's trials together, each trial keeping its
    own run's floors (from that run's matmul and bandwidth measurements); the row's floors are the last run's."""
    pooled: dict[str, dict] = {}
    for run in runs:
        for row in run["rows"]:
            into = pooled.setdefault(row["setting"], {**row, "trials": {impl: [] for impl in row["trials"]}})
            if set(into["trials"]) != set(row["trials"]):
                raise ValueError(f"{row['setting']} was measured with {sorted(row['trials'])} in one run and "
                                 f"{sorted(into['trials'])} in another: pool only runs of the same settings")
            into["interleave"] = into["interleave"] and row["interleave"]
            floors = row["floors"]
            if "numbers" in run:  # floors from the run's measured rates, by the current rules
                floors = {impl: phase_floors(run["numbers"], row["setting"], impl, run["gflops"], run["memory_gbps"],
                                             sampled(trials))
                          for impl, trials in row["trials"].items()}
            into["floors"] = floors
            for impl, trials in row["trials"].items():
                into["trials"][impl] += [{**t, "floors": floors[impl]} for t in trials]
    return list(pooled.values())


def floor_ratios(row: dict, impl: str, trials: list[dict], phase: str | None = None) -> tuple[list[float], list[float]]:
    """Every step's (after each trial's first) ratio to its floor, one phase's or the whole step's, each against the
    floors of the run it was measured in (pooled trials carry theirs); and those floors."""
    ratios, floors = [], []
    for trial, values in zip(trials, steps_of(trials, phase)):
        own = trial.get("floors", row["floors"][impl])
        floor = own[phase] if phase else sum(own.values())
        if floor > 0:
            ratios += [v / floor for v in values]
            floors.append(floor)
    return ratios, floors


def floor_cell(ratios: list[float], floors: list[float]) -> str:
    """``floor 0.79 (1.5x)``, with the floors' range where the pooled runs measured different ones."""
    if not ratios:
        return "floor 0.00 (-)"
    lo, hi = min(floors), max(floors)
    span = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"
    return f"floor {span} ({statistics.median(ratios):.2f}x)"


def steps_of(trials: list[dict], key: str | None = None) -> list[list[float]]:
    """Per trial, the steps after the first: their seconds, or one phase's seconds."""
    if key is None:
        return [t["step_s"][1:] for t in trials]
    return [[p.get(key, 0.0) for p in t["phases"][1:]] for t in trials]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def print_tables(rows: list[dict], machine: str) -> None:
    print(f"\n{machine}; medians (range) of every step after each trial's first\n")
    print("| setting | run | s/step | speed-up vs TRL (median of per-step pairs, 95% CI, range) | peak GiB train "
          "/ load | step / floor |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        trials, peer = row["trials"], next((i for i in row["trials"] if parse_impl(i)[0] == "trl"), None)
        for impl, ts in trials.items():
            steps = [s for trial in steps_of(ts) for s in trial]
            if peer and impl != peer:
                ratios = [p / r for rt, pt in zip(steps_of(ts), steps_of(trials[peer])) for r, p in zip(rt, pt)]
                lo, hi = bootstrap_ci(ratios)
                speed = (f"{statistics.median(ratios):.2f}x ({lo:.2f}-{hi:.2f}, {min(ratios):.2f}-{max(ratios):.2f}, "
                         f"{len(ratios)} pairs{', interleaved' if row['interleave'] else ''})")
            else:
                speed = "-"
            ratios, floors = floor_ratios(row, impl, ts)
            print(f"| {row['setting']} | {impl} | {spread(steps)} | {speed} | "
                  f"{max(t['train_peak_gib'] for t in ts):.2f} / {max(t['load_peak_gib'] for t in ts):.2f} | "
                  f"{floor_cell(ratios, floors)} |")
    print("\nPhases: median (range) s, then the floor in s (pooled: the runs' range) and the median of the steps' "
          "ratios to their run's floor\n")
    print("| setting | run | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for row in rows:
        for impl, ts in row["trials"].items():
            cells = []
            for phase in PHASES:
                values = [s for trial in steps_of(ts, phase) for s in trial]
                cells.append(f"{spread(values)}, {floor_cell(*floor_ratios(row, impl, ts, phase))}")
            print(f"| {row['setting']} | {impl} | " + " | ".join(cells) + " |")
    peaks = [(row, impl, ts) for row in rows for impl, ts in row["trials"].items()
             if all(t.get("phase_peaks") for t in ts)]
    if peaks:
        print("\nPeak resident memory in each phase (GiB, the highest over every step but each trial's first)\n")
        print("| setting | run | " + " | ".join(PHASES) + " |")
        print("|---|---|" + "---|" * len(PHASES))
        for row, impl, ts in peaks:
            cells = [f"{max((p.get(phase, 0.0) for t in ts for p in t['phase_peaks'][1:]), default=0.0):.2f}"
                     for phase in PHASES]
            print(f"| {row['setting']} | {impl} | " + " | ".join(cells) + " |")


JOB_SIZES = ("prompts", "generations", "new_tokens")  # the job's sizes the command line may change


def job_arguments(args) -> list[str]:
    """The job's sizes given on the command line, for the children."""
    return [f"--{key.replace('_', '-')}={value}" for key in JOB_SIZES
            if (value := getattr(args, key)) is not None] + (["--sampled"] if args.sampled else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--settings", nargs="+", default=list(REAL_SETTINGS), choices=list(REAL_SETTINGS))
    parser.add_argument("--impls", nargs="+",
                        help="polopt, trl, polopt:KEY=JSON,... (module arguments changed, e.g. "
                             "'polopt:rollout_dtype=\"bfloat16\"') or trl:KEY=JSON,... (GRPOConfig arguments); "
                             "default polopt trl; with --summarize: pool only these")
    parser.add_argument("--trials", type=int, default=2, help="trials per setting and implementation")
    parser.add_argument("--steps", type=int, default=5, help="RL steps per trial (the first is left out)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both trainers run (cuda: GPU 0; peaks stay host memory, floors use the GPU's rates)")
    parser.add_argument("--interleave", action="store_true",
                        help="run a trial's implementations side by side, step by step, where memory allows")
    parser.add_argument("--prompts", type=int, help=f"prompts a step (default {JOB['prompts']})")
    parser.add_argument("--generations", type=int, help=f"completions a prompt (default {JOB['generations']})")
    parser.add_argument("--new-tokens", type=int,
                        help=f"tokens each completion is forced to (default {JOB['new_tokens']})")
    parser.add_argument("--sampled", action="store_true",
                        help="completions end where sampling ends them (the model's EOS tokens), not forced to "
                             "--new-tokens (benchmarks/lengths.py sets the EOS tokens)")
    parser.add_argument("--model-dir", help="where the model is saved (default: a temporary folder)")
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="measure nothing: pool these --json files (FILE@SETTING,...: only those settings of it)")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "SETTING", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--baton", help=argparse.SUPPRESS)
    parser.add_argument("--heap", action="store_true", help=argparse.SUPPRESS)  # lengths.py's --heap
    args = parser.parse_args()
    JOB.update({k: getattr(args, k) for k in JOB_SIZES if getattr(args, k) is not None})
    JOB["forced"] = not args.sampled
    if args.child:
        return child(*args.child, args.steps, args.threads, Baton(args.baton) if args.baton else None, args.device,
                     args.heap)
    if args.summarize:
        runs = []
        for item in args.summarize:  # FILE or FILE@SETTING,SETTING: only those settings of that run
            path, _, only = item.partition("@")
            run = json.loads(Path(path).read_text())
            if only:
                run["rows"] = [r for r in run["rows"] if r["setting"] in only.split(",")]
            for row in run["rows"] if args.impls else ():
                row["trials"] = {impl: trials for impl, trials in row["trials"].items() if impl in args.impls}
            runs.append(run)
        machines = "\n".join(dict.fromkeys(run["machine"] for run in runs))
        return print_tables(pool(runs), f"{machines}\n{len(runs)} runs pooled (each row's floors from its run's rates)")
    args.impls = args.impls or ["polopt", "trl"]
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each trial is left out)")
    start = time.perf_counter()
    run = measure(args)
    print_tables(run["rows"], run["machine"])
    print(f"\n({time.perf_counter() - start:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
