"""The default job on several seeds: the table in the README and docs/default_job.md, with median and spread.

Each seed runs `polopt-train seed=S` in its own process with an empty warm-start cache (the first run a user makes),
then the table is printed in Markdown and the per-seed results saved as JSON:

    python benchmarks/default_job.py --seeds 0 1 2 --json benchmarks/results/default_job_cpu.json
    python benchmarks/default_job.py --seeds 0 1 2 --threads 1      # another float summation order ("another CPU")
    python benchmarks/default_job.py --summarize benchmarks/results/default_job_cpu.json
    python benchmarks/default_job.py --seeds 0 1 2 --cache /tmp/warm -- trainer.precision=bf16-mixed

`--cache DIR` keeps the warm starts there (made by the first run that needs them, reused after): two settings compared
from the same warm starts, as the last command does after `--seeds 0 1 2 --cache /tmp/warm` without overrides.

Extra arguments after `--` go to every `polopt-train` call (e.g. `-- objective=gspo`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = {"after": 0.85, "gain": 0.10, "final_below_best": 0.02, "wall_s": 600}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_seed(seed: int, threads: int | None, extra: list[str], workdir: Path, cache: Path | None = None) -> dict:
    run_dir = workdir / f"seed{seed}"
    args = [sys.executable, "-m", "polopt_lightning", f"seed={seed}", "trainer.enable_progress_bar=false",
            f"hydra.run.dir={run_dir}", *extra]
    if threads:
        args.append(f"num_threads={threads}")
    env = {**os.environ, "POLOPT_CACHE": str(cache or workdir / "cache")}  # empty cache: the warm start runs
    start = time.perf_counter()
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed:\n{proc.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    results["process_wall_s"] = round(time.perf_counter() - start, 1)
    results.update(sampler_gap(run_dir))
    return results


GAP = ("train/sampler_kl", "train/is_weight_max", "train/is_capped_frac")


def sampler_gap(run_dir: Path) -> dict:
    """The sampler's log-prob gap from the trainer over the run (logged where the trainer computes the old log-probs:
    a sampler of other numerics, e.g. under `trainer.precision=bf16-mixed`): each metric's median and largest value
    over the rollouts; nothing where it was not logged (the sampler's log-probs were the old ones)."""
    values = {key: [] for key in GAP}
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                for key in GAP:
                    if row.get(key):
                        values[key].append(float(row[key]))
    return {f"{key.removeprefix('train/')}_{name}": fn(v) for key, v in values.items() if v
            for name, fn in (("median", statistics.median), ("max", max))}


def meets(r: dict) -> bool:
    after, before, best = r["val_accuracy_after"], r["val_accuracy_before"], r["val_accuracy_best"]
    return (after >= TARGET["after"] and after - before >= TARGET["gain"]
            and after >= best - TARGET["final_below_best"] and r["wall_s"] < TARGET["wall_s"])


def table(runs: list[dict], machine: str, overrides: list[str] | None = None) -> str:
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"machine: {machine}" + (f"; overrides: {' '.join(overrides)}" if overrides else ""), "",
             "| seed | warm start (steps, wall) | held-out before RL | best during RL (rollout) | final | gain | "
             "final - best | RL | whole job | target met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        warm = "cached" if r.get("warm_start_cached") else f"{r['warm_start_steps']} steps, {r['warm_start_wall_s']:.0f} s"
        lines.append(
            f"| {r['seed']} | {warm} | "
            f"{pct(r['val_accuracy_before'])} | {pct(r['val_accuracy_best'])} ({r['val_accuracy_best_rollout']}) | "
            f"{pct(r['val_accuracy_after'])} | {100 * (r['val_accuracy_after'] - r['val_accuracy_before']):+.1f} | "
            f"{100 * (r['val_accuracy_after'] - r['val_accuracy_best']):+.1f} | {r['rl_wall_s']:.0f} s | "
            f"{r['wall_s']:.0f} s | "
            f"{'yes' if meets(r) else 'no'} |")

    def summary(key, scale=100.0, unit="", fmt="{:.1f}"):
        values = [scale * v for v in key]
        return f"{fmt.format(statistics.median(values))}{unit} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    after = [r["val_accuracy_after"] for r in runs]
    gain = [r["val_accuracy_after"] - r["val_accuracy_before"] for r in runs]
    wall = [r["wall_s"] for r in runs]
    if any("sampler_kl_max" in r for r in runs):
        lines += ["", "sampler/trainer gap over each run's rollouts (median / largest): "
                  + "; ".join(f"seed {r['seed']}: k3 {r['sampler_kl_median']:.1e} / {r['sampler_kl_max']:.1e}, weight "
                              f"max {r['is_weight_max_median']:.3f} / {r['is_weight_max_max']:.3f}, share beyond the cap "
                              f"{r['is_capped_frac_median']:.1e} / {r['is_capped_frac_max']:.1e}" for r in runs if "sampler_kl_max" in r)]
    rl = [r["rl_wall_s"] for r in runs]
    lines += ["", f"median (range) over {len(runs)} seeds: final {summary(after, unit='%')}, gain "
                  f"{summary(gain)} points, RL {summary(rl, 1.0, ' s', '{:.0f}')}, whole job "
                  f"{summary(wall, 1.0, ' s', '{:.0f}')}; "
                  f"target met on {sum(meets(r) for r in runs)} of {len(runs)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", help="save the per-seed results here")
    parser.add_argument("--cache", type=Path, help="warm-start cache kept between runs (default: an empty one a seed)")
    parser.add_argument("--summarize", nargs="+", help="print the table of saved JSON files instead of running")
    args = parser.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            saved = json.loads(Path(path).read_text())
            print(table(saved["runs"], saved["machine"], saved.get("overrides")), end="\n\n")
        return
    machine = f"{cpu_name()}, {os.cpu_count()} cores, torch threads: {args.threads or 'default'}"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs.append(run_seed(seed, args.threads, extra, Path(tmp), args.cache))
            print(f"seed {seed}: before {runs[-1]['val_accuracy_before']:.3f} after {runs[-1]['val_accuracy_after']:.3f} "
                  f"best {runs[-1]['val_accuracy_best']:.3f} wall {runs[-1]['wall_s']:.0f} s", flush=True)
    for r in runs:
        r.pop("run_dir", None)
        r.pop("model_dir", None)
        r.pop("best_checkpoint", None)
    print(table(runs, machine, extra))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "overrides": extra, "warm_start_cache_kept": bool(args.cache),
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
