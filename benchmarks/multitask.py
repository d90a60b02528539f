"""Three tasks in one run: do adaptive task weights or the supervised anchor help, for GRPO and for GSPO?

Every run is `polopt-train experiment=multitask` (sorting, reversing, counting a letter) in its own process with the
same sampled-completion budget (`--rollouts` rollouts of 8 prompts x 8 completions) from the same supervised warm
start per seed. The arms: task weights `static` (uniform), `signal` or `progress` (`weights=...`), each without and
with the supervised anchor (`anchor=constant`), for GRPO and GSPO (two mini-batches per rollout: off-policy, where
the two differ), for each seed.

    python benchmarks/multitask.py --out docs/multitask --runs /tmp/multitask --jobs 2   # the study (~35 min, 2 cores)
    python benchmarks/multitask.py --out /tmp/m --quick                    # a minute: the pipeline, not a result
    python benchmarks/multitask.py --out docs/multitask --summarize        # tables and plots from what is there

Writes `<out>/results.csv` (one row per run: each task's accuracy before, best and final), `<out>/curves.csv` (each
run's per-task validation accuracy and task weights by rollout), `<out>/summary.md` (median and range over seeds per
arm, and each arm against static weights without the anchor, seed by seed) and `<out>/weights.png` (the task
weights during training, median over seeds) and `<out>/accuracy.png` (per-task validation accuracy).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stability import band_figure, median_range  # noqa: E402  (the same tables and plots)

TASKS = ("sort", "reverse", "count")
OBJECTIVES = ("grpo", "gspo")
WEIGHTINGS = ("static", "signal", "progress")
ANCHORS = ("none", "constant")
PROMPTS, GENERATIONS = 8, 8
COLUMNS = ["objective", "weights", "anchor", "seed", "rollouts", "completions", "accuracy_before", "accuracy_best",
           "accuracy_final", *(f"{t}_{k}" for t in TASKS for k in ("before", "best", "final")),
           *(f"{t}_weight_final" for t in TASKS), "wall_s"]


def arms(quick: bool) -> list[tuple[str, str, str]]:
    if quick:
        return [("grpo", "static", "none"), ("grpo", "signal", "constant")]
    return list(itertools.product(OBJECTIVES, WEIGHTINGS, ANCHORS))


def run_name(objective: str, weights: str, anchor: str, seed: int) -> str:
    return f"{objective}-{weights}-{anchor}-s{seed}"


def run(runs: Path, objective: str, weights: str, anchor: str, seed: int, rollouts: int, val_every: int,
        warm_start: float, lr: float, quick: bool, cache: Path, threads: int) -> dict:
    name = run_name(objective, weights, anchor, seed)
    run_dir = runs / name
    results_file = run_dir / "results.json"
    if not results_file.is_file():
        args = [sys.executable, "-m", "polopt_lightning", "experiment=multitask", f"objective={objective}",
                f"weights={weights}", f"anchor={anchor}", f"seed={seed}", f"warm_start.target_accuracy={warm_start}",
                f"optimizer.lr={lr}",
                f"trainer.max_steps={rollouts * 2}", f"trainer.val_check_interval={val_every}",
                f"data.batch_size={PROMPTS}", f"experience.num_generations={GENERATIONS}", "update.mini_batches=2",
                # no checkpoint files: nothing resumes here
                "trainer.enable_progress_bar=false", "callbacks.checkpoint=null", "callbacks.best=null",
                f"num_threads={threads}", f"hydra.run.dir={run_dir}"]
        if quick:
            args += ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32",
                     "warm_start.steps=3", "warm_start.batch_size=4", "generation.max_new_tokens=3",
                     *(f"task.tasks.{t}.{k}={n}" for t in TASKS for k, n in (("train_size", 48), ("val_size", 8)))]
        start = time.perf_counter()
        proc = subprocess.run(args, env={**os.environ, "POLOPT_CACHE": str(cache)}, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return row(json.loads(results_file.read_text()), objective, weights, anchor, seed, rollouts)


def row(results: dict, objective: str, weights: str, anchor: str, seed: int, rollouts: int) -> dict:
    history = results["val_history"]
    out = {"objective": objective, "weights": weights, "anchor": anchor, "seed": seed, "rollouts": rollouts,
           "completions": rollouts * PROMPTS * GENERATIONS, "accuracy_before": results["val_accuracy_before"],
           # the best validation during training, as the study has always counted it (results.json's
           # val_accuracy_best ranks the validations before and after training too)
           "accuracy_best": max((r["val/accuracy"] for r in history), default=None),
           "accuracy_final": results["val_accuracy_after"],
           "wall_s": results["rl_wall_s"]}
    for task in TASKS:
        key = f"val/{task}/accuracy"
        out[f"{task}_before"] = results["val_task_accuracy_before"][task]
        # each task's best validation during training (the validations before and after count too)
        seen = [r[key] for r in history if key in r] + [results["val_task_accuracy_after"][task]]
        out[f"{task}_best"] = max(seen)
        out[f"{task}_final"] = results["val_task_accuracy_after"][task]
        out[f"{task}_weight_final"] = results["task_weights_final"][task]
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def summarize(rows: list[dict], out: Path) -> str:
    """Per arm: median (range) over seeds of each task's best and final accuracy and of the overall accuracy; then
    each arm minus static-without-anchor of the same objective and seed (median and range of the paired
    differences, in points)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["objective"], r["weights"], r["anchor"]), []).append(r)
    head = " | ".join(f"{t} best | {t} final" for t in TASKS)
    lines = [f"| objective | weights | anchor | seeds | before | {head} | all best | all final |",
             "|---|---|---|---|---|" + "---|---|" * len(TASKS) + "---|---|"]
    for (objective, weights, anchor), rs in sorted(groups.items()):
        cells = " | ".join(f"{median_range([r[f'{t}_best'] for r in rs])} | {median_range([r[f'{t}_final'] for r in rs])}"
                           for t in TASKS)
        lines.append(f"| {objective} | {weights} | {anchor} | {len(rs)} | {median_range([r['accuracy_before'] for r in rs])} | "
                     f"{cells} | {median_range([r['accuracy_best'] for r in rs])} | {median_range([r['accuracy_final'] for r in rs])} |")
    lines += ["", "Paired against static weights without the anchor (same objective and seed), points: median "
              "(range) of the differences.", "",
              "| objective | weights | anchor | " + " | ".join(f"{t} final" for t in TASKS) + " | all best | all final |",
              "|---|---|---|" + "---|" * len(TASKS) + "---|---|"]
    base = {(r["objective"], r["seed"]): r for r in rows if r["weights"] == "static" and r["anchor"] == "none"}

    def diff(rs: list[dict], key: str) -> str:
        values = [100 * (r[key] - base[(r["objective"], r["seed"])][key]) for r in rs
                  if (r["objective"], r["seed"]) in base]
        if not values:
            return "-"
        return f"{statistics.median(values):+.1f} ({min(values):+.1f} to {max(values):+.1f})"

    for (objective, weights, anchor), rs in sorted(groups.items()):
        if weights == "static" and anchor == "none":
            continue
        cells = " | ".join(diff(rs, f"{t}_final") for t in TASKS)
        lines.append(f"| {objective} | {weights} | {anchor} | {cells} | {diff(rs, 'accuracy_best')} | "
                     f"{diff(rs, 'accuracy_final')} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


CURVE_METRICS = (*(f"val/{t}/accuracy" for t in TASKS), *(f"weights/{t}" for t in TASKS), "val/accuracy")


def write_curves(runs: Path, rows: list[dict], path: Path) -> None:
    """Every run's per-task accuracy and task weights by rollout, in one file (the plots read it; the runs can go)."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["objective", "weights", "anchor", "seed", "rollout", "metric", "value"])
        for r in rows:
            metrics = runs / run_name(r["objective"], r["weights"], r["anchor"], r["seed"]) / "csv" / "version_0"
            for line in csv.DictReader(open(metrics / "metrics.csv")) if (metrics / "metrics.csv").is_file() else []:
                for metric in CURVE_METRICS:
                    if line.get(metric):
                        writer.writerow([r["objective"], r["weights"], r["anchor"], r["seed"], line["step"], metric,
                                         f"{float(line[metric]):.4g}"])


def curves(path: Path, prefix: str) -> dict:
    """{(objective, weights, anchor, task): {rollout: [per-seed values]}} of ``<prefix><task>...`` metrics."""
    data: dict[tuple, dict[int, list[float]]] = {}
    for line in csv.DictReader(open(path)):
        metric = line["metric"]
        if metric.startswith(prefix) and metric != "val/accuracy":
            task = metric[len(prefix):].split("/")[0]
            key = (line["objective"], line["weights"], line["anchor"], task)
            data.setdefault(key, {}).setdefault(int(line["rollout"]), []).append(float(line["value"]))
    return data


def plot(out: Path) -> list[Path]:
    paths = []
    for prefix, title, name in (("weights/", "task weight", "weights"), ("val/", "held-out accuracy", "accuracy")):
        data = curves(out / "curves.csv", prefix)
        panels = sorted({k[:3] for k in data}, key=lambda p: (p[0], WEIGHTINGS.index(p[1]), p[2]))
        if panels:
            paths.append(band_figure(out / f"{name}.png", panels, list(TASKS),
                                     lambda panel, task, data=data: data.get((*panel, task)),
                                     lambda p: f"{p[0]}, {p[1]} weights, anchor {p[2]}", title, len(WEIGHTINGS),
                                     height=2.8, dpi=70))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results.csv, curves.csv, summary.md, plots")
    parser.add_argument("--runs", type=Path, help="the runs' own folders (default <out>/runs; keep them out of git)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=300, help="rollouts per run (64 completions each)")
    parser.add_argument("--val-every", type=int, default=25, help="validate every this many rollouts")
    parser.add_argument("--lr", type=float, default=1e-4, help="optimizer.lr (the default job's 4e-5 barely moves these "
                                                                  "tasks in 300 rollouts)")
    parser.add_argument("--warm-start", type=float, default=0.5,
                        help="warm_start.target_accuracy: greedy accuracy on a probe of the mixture's training prompts")
    parser.add_argument("--quick", action="store_true", help="a tiny model and budget: checks the pipeline only")
    parser.add_argument("--summarize", action="store_true", help="tables and plots from the runs already in --runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with cores / jobs threads)")
    args = parser.parse_args(argv)
    out = args.out
    runs = args.runs or out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    rollouts, val_every = (6, 3) if args.quick else (args.rollouts, args.val_every)
    cache = runs / "cache"
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    # seeds outermost: the first runs of a seed train its warm start, cached for the rest
    keys = [(*arm, seed) for seed in args.seeds for arm in arms(args.quick)]
    if args.summarize:
        keys = [k for k in keys if (runs / run_name(*k) / "results.json").is_file()]
    else:  # one run per seed first, alone: it trains the seed's warm start that the others load
        for seed in args.seeds:  # (the first arm, which the pool then finds done)
            run(runs, *arms(args.quick)[0], seed, rollouts, val_every, args.warm_start, args.lr, args.quick, cache,
                threads)
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process; the threads only wait
        rows = list(pool.map(lambda k: run(runs, *k, rollouts, val_every, args.warm_start, args.lr, args.quick, cache,
                                           threads), keys))
    write_csv(rows, out / "results.csv")
    write_curves(runs, rows, out / "curves.csv")
    print(summarize(rows, out))
    for path in plot(out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
