"""The default job on several seeds: the table in the README and docs/default_job.md, with median and spread.

Each seed runs `polopt-train seed=S` in its own process with an empty warm-start cache (the first run a user makes),
then the table is printed in Markdown and the per-seed results saved as JSON:

    python benchmarks/default_job.py --seeds 0 1 2 --json benchmarks/results/default_job_cpu.json
    python benchmarks/default_job.py --seeds 0 1 2 --threads 1      # another float summation order ("another CPU")
    python benchmarks/default_job.py --summarize benchmarks/results/default_job_cpu.json

Extra arguments after `--` go to every `polopt-train` call (e.g. `-- objective=gspo`).
"""

from __future__ import annotations

import argparse
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


def run_seed(seed: int, threads: int | None, extra: list[str], workdir: Path) -> dict:
    run_dir = workdir / f"seed{seed}"
    args = [sys.executable, "-m", "polopt_lightning", f"seed={seed}", "trainer.enable_progress_bar=false",
            f"hydra.run.dir={run_dir}", *extra]
    if threads:
        args.append(f"num_threads={threads}")
    env = {**os.environ, "POLOPT_CACHE": str(workdir / "cache")}  # empty cache: the warm start runs
    start = time.perf_counter()
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed:\n{proc.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    results["process_wall_s"] = round(time.perf_counter() - start, 1)
    return results


def meets(r: dict) -> bool:
    after, before, best = r["val_accuracy_after"], r["val_accuracy_before"], r["val_accuracy_best"]
    return (after >= TARGET["after"] and after - before >= TARGET["gain"]
            and after >= best - TARGET["final_below_best"] and r["wall_s"] < TARGET["wall_s"])


def table(runs: list[dict], machine: str) -> str:
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"machine: {machine}", "",
             "| seed | warm start (steps, wall) | held-out before RL | best during RL (rollout) | final | gain | "
             "final - best | whole job | target met |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['warm_start_steps']} steps, {r['warm_start_wall_s']:.0f} s | "
            f"{pct(r['val_accuracy_before'])} | {pct(r['val_accuracy_best'])} ({r['val_accuracy_best_rollout']}) | "
            f"{pct(r['val_accuracy_after'])} | {100 * (r['val_accuracy_after'] - r['val_accuracy_before']):+.1f} | "
            f"{100 * (r['val_accuracy_after'] - r['val_accuracy_best']):+.1f} | {r['wall_s']:.0f} s | "
            f"{'yes' if meets(r) else 'no'} |")

    def summary(key, scale=100.0, unit="", fmt="{:.1f}"):
        values = [scale * v for v in key]
        return f"{fmt.format(statistics.median(values))}{unit} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    after = [r["val_accuracy_after"] for r in runs]
    gain = [r["val_accuracy_after"] - r["val_accuracy_before"] for r in runs]
    wall = [r["wall_s"] for r in runs]
    lines += ["", f"median (range) over {len(runs)} seeds: final {summary(after, unit='%')}, gain "
                  f"{summary(gain)} points, whole job {summary(wall, 1.0, ' s', '{:.0f}')}; "
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
    parser.add_argument("--summarize", nargs="+", help="print the table of saved JSON files instead of running")
    args = parser.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            saved = json.loads(Path(path).read_text())
            print(table(saved["runs"], saved["machine"]), end="\n\n")
        return
    machine = f"{cpu_name()}, {os.cpu_count()} cores, torch threads: {args.threads or 'default'}"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs.append(run_seed(seed, args.threads, extra, Path(tmp)))
            print(f"seed {seed}: before {runs[-1]['val_accuracy_before']:.3f} after {runs[-1]['val_accuracy_after']:.3f} "
                  f"best {runs[-1]['val_accuracy_best']:.3f} wall {runs[-1]['wall_s']:.0f} s", flush=True)
    for r in runs:
        r.pop("run_dir", None)
        r.pop("model_dir", None)
        r.pop("best_checkpoint", None)
    print(table(runs, machine))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "overrides": extra, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
