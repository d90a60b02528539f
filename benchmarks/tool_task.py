"""The tool task's learning: `experiment=tool_arithmetic` (5-digit addition, an `add` tool, multi-turn rollouts) against
the same run without the tool (`rollout=hf`: one turn; a call gets no result), the same warm start, seeds and budget,
and against a run without the tool whose warm start taught direct answers only (`task.tool_share=0`).

Every run is `polopt-train` in its own process; the warm start (on demonstrations that call the tool half of the time)
is cached, so the no-tool run of a seed reuses its tool run's.

    python benchmarks/tool_task.py --out docs/multi_turn                # 3 seeds (about 30 minutes on 2 cores)
    python benchmarks/tool_task.py --out /tmp/t --quick                 # a minute: the pipeline, not a result

Writes `<out>/results.csv` (one row per run: setting, seed, held-out accuracy before and after RL, the best and its
rollout, the tool calls per completion at the start and the end of RL, wall time) and `<out>/summary.md` (median
and range over seeds, and the difference the tool makes on each seed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the overrides of each setting over experiment=tool_arithmetic: with the tool; without it (one turn: a call gets no
# result); and without it after a warm start spent on direct answers alone (no demonstration calls the tool)
SETTINGS = {"tool": [], "no_tool": ["rollout=hf"], "direct": ["rollout=hf", "task.tool_share=0"]}
COLUMNS = ["setting", "seed", "accuracy_before", "accuracy_after", "accuracy_best", "best_rollout",
           "tool_calls_first", "tool_calls_last", "rl_wall_s"]


def run(runs: Path, setting: str, seed: int, quick: bool, cache: Path, threads: int) -> dict:
    run_dir = runs / f"{setting}-s{seed}"
    if not (run_dir / "results.json").is_file():
        args = [sys.executable, "-m", "polopt_lightning", "experiment=tool_arithmetic", *SETTINGS[setting],
                f"seed={seed}", "trainer.enable_progress_bar=false", "callbacks.checkpoint=null", "callbacks.best=null",
                f"num_threads={threads}", f"hydra.run.dir={run_dir}"]
        if quick:
            args += ["warm_start.steps=20", "trainer.max_steps=4", "trainer.val_check_interval=2", "task.val_size=16",
                     "task.train_size=64", "data.val_batch_size=16"]
        start = time.perf_counter()
        proc = subprocess.run(args, env={**os.environ, "POLOPT_CACHE": str(cache)}, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr[-3000:]}")
        print(f"{run_dir.name}: {time.perf_counter() - start:.0f} s", flush=True)
    results = json.loads((run_dir / "results.json").read_text())
    calls = [float(line["train/tool_calls"]) for line in csv.DictReader(open(run_dir / "csv" / "version_0" /
                                                                              "metrics.csv"))
             if line.get("train/tool_calls")]
    return {"setting": setting, "seed": seed, "accuracy_before": round(results["val_accuracy_before"], 4),
            "accuracy_after": round(results["val_accuracy_after"], 4),
            "accuracy_best": round(results["val_accuracy_best"], 4) if results.get("val_accuracy_best") else None,
            "best_rollout": results.get("val_accuracy_best_rollout"),
            "tool_calls_first": round(calls[0], 3) if calls else None,
            "tool_calls_last": round(calls[-1], 3) if calls else None, "rl_wall_s": results.get("rl_wall_s")}


def median_range(values: list[float]) -> str:
    return f"{100 * statistics.median(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def summarize(rows: list[dict], out: Path) -> str:
    lines = ["| setting | seeds | accuracy before RL | after RL | tool calls per completion, first / last rollout |",
             "|---|---|---|---|---|"]
    for setting in SETTINGS:
        rs = [r for r in rows if r["setting"] == setting]
        if not rs:
            continue
        first = [r["tool_calls_first"] for r in rs if r["tool_calls_first"] is not None]
        last = [r["tool_calls_last"] for r in rs if r["tool_calls_last"] is not None]
        calls = (f"{statistics.median(first):.2f} / {statistics.median(last):.2f}" if first and last
                 else "- (one turn: a call is not run)")
        lines.append(f"| {setting} | {len(rs)} | {median_range([r['accuracy_before'] for r in rs])} | "
                     f"{median_range([r['accuracy_after'] for r in rs])} | {calls} |")
    tool = {r["seed"]: r["accuracy_after"] for r in rows if r["setting"] == "tool"}
    lines.append("")
    for other in ("no_tool", "direct"):
        base = {r["seed"]: r["accuracy_after"] for r in rows if r["setting"] == other}
        seeds = sorted(set(tool) & set(base))
        if seeds:
            diffs = [tool[s] - base[s] for s in seeds]
            lines.append(f"- tool minus {other}, after RL, same seeds: median {100 * statistics.median(diffs):+.1f} "
                         f"points (per seed: {', '.join(f'{100 * d:+.1f}' for d in diffs)})")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results.csv and summary.md")
    parser.add_argument("--runs", type=Path, help="the runs' own folders (default <out>/runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="a tiny budget: checks the pipeline only")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with cores / jobs threads)")
    args = parser.parse_args(argv)
    out, runs = args.out, args.runs or args.out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    cache = runs / "cache"
    # the tool run of a seed first: it makes the warm start its no-tool run then loads from the cache
    keys = [(setting, seed) for seed in args.seeds for setting in SETTINGS]
    with ThreadPoolExecutor(args.jobs) as pool:
        first = list(pool.map(lambda k: run(runs, *k, args.quick, cache, threads),
                              [k for k in keys if k[0] != "no_tool"]))
        rows = first + list(pool.map(lambda k: run(runs, *k, args.quick, cache, threads),
                                     [k for k in keys if k[0] == "no_tool"]))
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(summarize(rows, out))


if __name__ == "__main__":
    main()
