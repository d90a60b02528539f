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


QUICK = ["warm_start.steps=20", "trainer.max_steps=4", "trainer.val_check_interval=2", "task.val_size=16",
         "task.train_size=64", "data.val_batch_size=16"]


def train_run(run_dir: Path, overrides: list[str], seed: int, quick: bool, cache: Path, threads: int
              ) -> tuple[dict, list[dict]]:
    """``polopt-train`` with ``overrides`` in ``run_dir`` (skipped where its ``results.json`` exists), the warm start
    cached in ``cache``: its results and its logged metrics' rows."""
    if not (run_dir / "results.json").is_file():
        args = [sys.executable, "-m", "polopt_lightning", *overrides, f"seed={seed}", "trainer.enable_progress_bar=false",
                "callbacks.checkpoint=null", "callbacks.best=null", f"num_threads={threads}",
                f"hydra.run.dir={run_dir}", *(QUICK if quick else [])]
        start = time.perf_counter()
        proc = subprocess.run(args, env={**os.environ, "POLOPT_CACHE": str(cache)}, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr[-3000:]}")
        print(f"{run_dir.name}: {time.perf_counter() - start:.0f} s", flush=True)
    results = json.loads((run_dir / "results.json").read_text())
    return results, list(csv.DictReader(open(run_dir / "csv" / "version_0" / "metrics.csv")))


def run(runs: Path, setting: str, seed: int, quick: bool, cache: Path, threads: int) -> dict:
    results, lines = train_run(runs / f"{setting}-s{seed}", ["experiment=tool_arithmetic", *SETTINGS[setting]], seed,
                               quick, cache, threads)
    calls = [float(line["train/tool_calls"]) for line in lines if line.get("train/tool_calls")]
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
    lines.append("")
    for other in ("no_tool", "direct"):
        lines += seed_differences(rows, "tool", other, "tool minus " + other)
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def seed_differences(rows: list[dict], mine: str, base: str, label: str, key: str = "setting") -> list[str]:
    """One line: the median and per-seed difference of ``mine``'s accuracy after RL less ``base``'s (rows whose
    ``key`` is each), over their common seeds; none without one."""
    after = {name: {r["seed"]: r["accuracy_after"] for r in rows if r[key] == name} for name in (mine, base)}
    seeds = sorted(set(after[mine]) & set(after[base]))
    if not seeds:
        return []
    diffs = [after[mine][s] - after[base][s] for s in seeds]
    return [f"- {label}, after RL, same seeds: median {100 * statistics.median(diffs):+.1f} points (per seed: "
            f"{', '.join(f'{100 * d:+.1f}' for d in diffs)})"]


def study_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The arguments of a study of runs: ``--out``, ``--runs``, ``--seeds``, ``--quick``, ``--jobs``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results.csv and summary.md")
    parser.add_argument("--runs", type=Path, help="the runs' own folders (default <out>/runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="a tiny budget: checks the pipeline only")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with cores / jobs threads)")
    return parser


def run_study(args: argparse.Namespace, run_one, firsts: list[tuple], seconds: list[tuple], columns: list[str]
              ) -> list[dict]:
    """``run_one(runs, *key, quick, cache, threads)`` for every key, ``args.jobs`` at a time, ``firsts`` before
    ``seconds`` (a seed's first run makes the warm start that its others load from the cache); the rows written to
    ``<out>/results.csv``."""
    out, runs = args.out, args.runs or args.out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    cache = runs / "cache"
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda k: run_one(runs, *k, args.quick, cache, threads), firsts))
        rows += list(pool.map(lambda k: run_one(runs, *k, args.quick, cache, threads), seconds))
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = study_arguments(__doc__).parse_args(argv)
    # the tool run of a seed first: it makes the warm start its no-tool run then loads from the cache
    keys = [(setting, seed) for seed in args.seeds for setting in SETTINGS]
    rows = run_study(args, run, [k for k in keys if k[0] != "no_tool"], [k for k in keys if k[0] == "no_tool"],
                     COLUMNS)
    print(summarize(rows, args.out))


if __name__ == "__main__":
    main()
