"""GRPO, GSPO and DAPO under the same budget: who collapses, and does the collapse monitor's rollback rescue them?

Every run is `polopt-train` in its own process with the same sampled-completion budget (`--rollouts` rollouts of
8 prompts x 8 completions), from a weak or a good supervised warm start, on-policy or off-policy, at two learning
rates, for each seed. The collapse monitor runs in `warn` mode (it records, never intervenes) and the KL to the
starting policy is tracked (`reference.track_kl=true`). Then (`--rollback`) the settings whose final accuracy fell more
than `--collapse-margin` below their best run again with `callbacks=protect` (rollback to the last healthy state).

    python benchmarks/stability.py --out docs/stability                     # the full study (about an hour, 2 cores)
    python benchmarks/stability.py --out /tmp/s --quick                     # a minute: the pipeline, not a result
    python benchmarks/stability.py --out docs/stability --summarize         # tables and plots from what is there
    python benchmarks/stability.py --out docs/stability/objectives --warm-starts good --policies off \
        --objectives grpo cispo sapo grpo_dual_clip rloo reinforce_pp grpo_kl grpo_kl_in_reward grpo_entropy_bonus \
        grpo_top_entropy --jobs 2                                           # the newer losses (issue 40)

Writes `<out>/results.csv` (one row per run), `<out>/curves.csv` (every run's accuracy, entropy, KL and reward by
rollout), `<out>/summary.md` (medians and ranges per setting) and PNG plots of held-out accuracy and entropy during
training per objective (median over seeds, band from min to max). The runs themselves go to `--runs`.
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

WARM_STARTS = {"weak": 0.15, "good": 0.65}  # warm_start.target_accuracy: greedy accuracy on a training probe
OFF_POLICY = {"on": (1, 1), "off": (1, 4)}  # (num_iterations, mini_batches)
OBJECTIVES = ("grpo", "gspo", "dapo")  # the first study's
# every setting the study can run, by the name its rows carry: the overrides that make it
VARIANTS = {
    "grpo": ["objective=grpo"], "gspo": ["objective=gspo"], "dapo": ["objective=dapo"],
    "cispo": ["objective=cispo"],
    "sapo": ["objective=sapo", "objective.aggregation=token-mean"],  # as the study ran it (SAPO's default until 55)
    "grpo_dual_clip": ["objective=grpo", "objective.dual_clip=3.0"],  # verl's default clip_ratio_c
    "rloo": ["objective=grpo", "experience.advantage_estimator=rloo"],
    "reinforce_pp": ["objective=grpo", "experience.advantage_estimator=reinforce_pp"],
    "grpo_kl": ["objective=grpo", "objective.beta=0.04"],  # k3 in the loss at TRL's former default beta
    "grpo_kl_in_reward": ["objective=grpo", "reference.kl_in_reward=0.05"],  # k1 summed per completion
    "grpo_entropy_bonus": ["objective=grpo", "update.entropy_coef=0.01"],
    "grpo_top_entropy": ["objective=grpo", "update.top_entropy_quantile=0.2"],  # the paper's 20%
}
LRS = (4e-5, 3e-4)  # the default job's, and one where the peer (TRL) collapsed from a weak start
PROMPTS, GENERATIONS = 8, 8
COLUMNS = ["objective", "warm_start", "off_policy", "num_iterations", "mini_batches", "lr", "seed", "mode",
           "rollouts", "completions", "accuracy_before", "accuracy_best", "accuracy_final", "best_rollout",
           "collapsed", "events", "event_rules", "rollbacks", "discarded_completions", "wall_s"]


def settings(quick: bool, objectives=OBJECTIVES, warm_starts=tuple(WARM_STARTS), policies=tuple(OFF_POLICY),
             lrs=LRS):
    if quick:
        return [(objective, "good", "on", 4e-5) for objective in objectives[:2]]
    return list(itertools.product(objectives, warm_starts, policies, lrs))


def run_name(objective: str, warm: str, off: str, lr: float, seed: int, mode: str) -> str:
    return f"{objective}-{warm}-{off}-lr{lr:g}-s{seed}-{mode}"


def run(runs: Path, objective: str, warm: str, off: str, lr: float, seed: int, mode: str, rollouts: int,
        val_every: int, quick: bool, cache: Path, threads: int) -> dict:
    mu, mb = OFF_POLICY[off]
    name = run_name(objective, warm, off, lr, seed, mode)
    run_dir = runs / name
    results_file = run_dir / "results.json"
    if not results_file.is_file():
        args = [sys.executable, "-m", "polopt_lightning", *VARIANTS[objective], f"seed={seed}",
                f"warm_start.target_accuracy={WARM_STARTS[warm]}", f"update.num_iterations={mu}",
                f"update.mini_batches={mb}", f"optimizer.lr={lr}", "reference.track_kl=true",
                f"trainer.max_steps={rollouts * mu * mb}", f"trainer.val_check_interval={val_every}",
                f"data.batch_size={PROMPTS}", f"experience.num_generations={GENERATIONS}",
                # no checkpoint files: 72 runs of them would fill the disk, and nothing resumes here
                "trainer.enable_progress_bar=false", "callbacks.checkpoint=null", "callbacks.best=null",
                f"callbacks={'protect' if mode == 'rollback' else 'default'}", f"num_threads={threads}",
                f"hydra.run.dir={run_dir}"]
        if quick:
            args += ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32",
                     "task.train_size=64", "task.val_size=16", "warm_start.steps=3", "warm_start.batch_size=4",
                     "generation.max_new_tokens=3"]
        start = time.perf_counter()
        proc = subprocess.run(args, env={**os.environ, "POLOPT_CACHE": str(cache)}, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    results = json.loads(results_file.read_text())
    events_file = run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.is_file() else []
    if mode == "warn":  # the validation rule from the run's validations (see validation_events)
        events = [e for e in events if e["rule"] != "val_drop"] + validation_events(results)
    return row(results, events, objective, warm, off, lr, seed, mode, rollouts)


def validation_events(results: dict) -> list[dict]:
    """`val_drop` replayed on the run's validations, the one before training first (its best is then the start's).

    The rule depends on the validations alone, so replaying it gives every warn-mode run the same treatment (the
    first runs of the study were made before the monitor took the validation before training as its first best).
    """
    from dataclasses import asdict

    from polopt_lightning.callbacks import CollapseRules

    rules = CollapseRules()
    points = [(0, results["val_accuracy_before"])] + [(h["rollout"], h["val/accuracy"]) for h in results["val_history"]]
    return [asdict(e) for rollout, value in points if value is not None
            for e in rules.observe_validation(0, rollout, {"val/accuracy": value})]


def row(results: dict, events: list[dict], objective, warm, off, lr, seed, mode, rollouts) -> dict:
    mu, mb = OFF_POLICY[off]
    history = results["val_history"]
    best = max(history, key=lambda r: (r["val/accuracy"], -r["rollout"])) if history else None
    before, final = results["val_accuracy_before"], results["val_accuracy_after"]
    rollbacks = [e for e in events if e["action"] == "rollback"]
    done = results["steps"] // (mu * mb)
    return {
        "objective": objective, "warm_start": warm, "off_policy": off, "num_iterations": mu, "mini_batches": mb,
        "lr": lr, "seed": seed, "mode": mode, "rollouts": done, "completions": done * PROMPTS * GENERATIONS,
        "accuracy_before": round(before, 4), "accuracy_best": round(best["val/accuracy"], 4) if best else None,
        "accuracy_final": round(final, 4), "best_rollout": best["rollout"] if best else None,
        "collapsed": None, "events": len(events), "event_rules": " ".join(sorted({e["rule"] for e in events})),
        "rollbacks": len(rollbacks),
        # completions sampled between the restored state and the rollback: learning thrown away
        "discarded_completions": sum((e["rollout"] - (e.get("restored_rollout") or 0)) * PROMPTS * GENERATIONS
                                     for e in rollbacks),
        "wall_s": results["wall_s"],
    }


def collapsed(r: dict, margin: float) -> bool:
    """Ended more than `margin` below its own best, or below where it started."""
    return r["accuracy_final"] < max(r["accuracy_best"] - margin, r["accuracy_before"])


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def summarize(rows: list[dict], out: Path) -> str:
    """Per setting: median (range) over seeds of best and final accuracy, and how many seeds collapsed."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["warm_start"], r["off_policy"], r["lr"], r["objective"]), []).append(r)

    lines = ["| mode | warm start | policy | lr | objective | seeds | before | best | final | collapsed | events |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, warm, off, lr, objective), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "warn", kv[0])):
        events = sorted({rule for r in rs for rule in r["event_rules"].split()})
        lines.append(f"| {mode} | {warm} | {off} | {lr:g} | {objective} | {len(rs)} | "
                     f"{median_range([r['accuracy_before'] for r in rs])} | {median_range([r['accuracy_best'] for r in rs])} | "
                     f"{median_range([r['accuracy_final'] for r in rs])} | {sum(bool(r['collapsed']) for r in rs)}/{len(rs)} | "
                     f"{', '.join(events) or '-'} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


CURVE_METRICS = ("val/accuracy", "train/entropy", "train/kl", "train/reward")


def write_curves(runs: Path, rows: list[dict], path: Path) -> None:
    """Every run's curves in one file (`curves.csv`: the plots and the notebook read it; the runs can go)."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["objective", "warm_start", "off_policy", "lr", "seed", "mode", "rollout", "metric", "value"])
        for r in rows:
            name = run_name(r["objective"], r["warm_start"], r["off_policy"], float(r["lr"]), r["seed"], r["mode"])
            metrics = runs / name / "csv" / "version_0" / "metrics.csv"
            for line in csv.DictReader(open(metrics)) if metrics.is_file() else []:
                for metric in CURVE_METRICS:
                    if line.get(metric):
                        writer.writerow([r["objective"], r["warm_start"], r["off_policy"], r["lr"], r["seed"],
                                         r["mode"], line["step"], metric, f"{float(line[metric]):.4g}"])


def curves(path: Path, metric: str, mode: str = "warn") -> dict:
    """{(warm, off, lr, objective): {rollout: [per-seed values]}} of one metric from `curves.csv`."""
    data: dict[tuple, dict[int, list[float]]] = {}
    for line in csv.DictReader(open(path)):
        if line["metric"] == metric and line["mode"] == mode:
            key = (line["warm_start"], line["off_policy"], float(line["lr"]), line["objective"])
            data.setdefault(key, {}).setdefault(int(line["rollout"]), []).append(float(line["value"]))
    return data


def median_range(values: list[float | None]) -> str:
    """``median (min-max)`` in percent of the values that exist, ``-`` when none does."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{100 * statistics.median(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def band_figure(path: Path, panels: list, lines: list, series_of, title_of, ylabel: str, cols: int, smooth: int = 0,
                height: float = 3.0, dpi: int = 80) -> Path:
    """One panel per entry of ``panels`` and in each one line per entry of ``lines``: ``series_of(panel, line)`` gives
    ``{x: [one value per seed]}`` (or nothing), drawn as the median with a band from min to max (each smoothed over
    ``smooth`` points when set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, height * rows), squeeze=False, sharey=True)
    for ax, panel in zip(axes.flat, panels):
        for name in lines:
            series = series_of(panel, name)
            if not series:
                continue
            xs = sorted(series)
            med = [statistics.median(series[x]) for x in xs]
            lo = [min(series[x]) for x in xs]
            hi = [max(series[x]) for x in xs]
            if smooth:
                med, lo, hi = (_smooth(v, smooth) for v in (med, lo, hi))
            line, = ax.plot(xs, med, label=name)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(title_of(panel), fontsize=9)
        ax.set_xlabel("rollout (64 completions each)")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    axes.flat[0].set_ylabel(ylabel)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot(out: Path) -> list[Path]:
    paths = []
    for metric, title in (("val/accuracy", "held-out accuracy"), ("train/entropy", "entropy (nats/token)")):
        data = curves(out / "curves.csv", metric)
        panels = sorted({k[:3] for k in data})
        if not panels:
            continue
        # the metric is logged at the rollout index; a training curve is smoothed over 10 rollouts
        lines = sorted({k[3] for k in data}, key=lambda o: list(VARIANTS).index(o) if o in VARIANTS else len(VARIANTS))
        paths.append(band_figure(out / f"{metric.split('/')[1]}.png", panels, lines,
                                 lambda panel, objective, data=data: data.get((*panel, objective)),
                                 lambda p: f"{p[0]} start, {p[1]}-policy, lr {p[2]:g}", title, min(4, len(panels)),
                                 smooth=10 if metric.startswith("train/") else 0))
    return paths


def _smooth(values: list[float], n: int) -> list[float]:
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results.csv, curves.csv, summary.md, plots")
    parser.add_argument("--runs", type=Path, help="the runs' own folders (default <out>/runs; large: keep them out "
                                                  "of git)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=200, help="rollouts per run (64 completions each)")
    parser.add_argument("--val-every", type=int, default=25, help="validate every this many rollouts")
    parser.add_argument("--collapse-margin", type=float, default=0.05)
    parser.add_argument("--rollback", action="store_true", help="rerun the collapsed settings with callbacks=protect")
    parser.add_argument("--quick", action="store_true", help="a tiny model and budget: checks the pipeline only")
    parser.add_argument("--summarize", action="store_true", help="tables and plots from the runs already in --out")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with cores / jobs threads)")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(VARIANTS),
                        help="the settings to compare (an objective, or an objective with an estimator or option)")
    parser.add_argument("--warm-starts", nargs="+", default=list(WARM_STARTS), choices=list(WARM_STARTS))
    parser.add_argument("--policies", nargs="+", default=list(OFF_POLICY), choices=list(OFF_POLICY))
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    args = parser.parse_args(argv)
    out = args.out
    runs = args.runs or out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    rollouts, val_every = (6, 3) if args.quick else (args.rollouts, args.val_every)
    cache = runs / "cache"
    threads = max(1, (os.cpu_count() or 1) // args.jobs)

    def runs_of(keys, mode):
        keys = [k for k in keys if not args.summarize or (runs / run_name(*k, mode)).is_dir()]
        with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process; the threads only wait
            return list(pool.map(lambda k: run(runs, *k, mode, rollouts, val_every, args.quick, cache, threads),
                                 keys))

    # seeds innermost: runs that start together have different warm starts (each cached once, atomically)
    grid = settings(args.quick, args.objectives, args.warm_starts, args.policies, args.lrs)
    rows = runs_of([(*s, seed) for s in grid for seed in args.seeds], "warn")
    for r in rows:
        r["collapsed"] = collapsed(r, args.collapse_margin)
    if args.rollback or args.summarize:
        keys = [(r["objective"], r["warm_start"], r["off_policy"], r["lr"], r["seed"]) for r in rows if r["collapsed"]]
        for again in runs_of(keys, "rollback"):
            again["collapsed"] = collapsed(again, args.collapse_margin)
            rows.append(again)
    write_csv(rows, out / "results.csv")
    write_curves(runs, rows, out / "curves.csv")
    print(summarize(rows, out))
    for path in plot(out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
