"""What running code in the sandbox costs (polopt_lightning/sandbox): the overhead of one execution against the same
program run bare (``subprocess.run``, no isolation, no limits: the floor), executions per second through the pool at
several concurrencies, and the code reward's throughput on the code task's reference solutions.

    python benchmarks/sandbox.py                       # ~1 minute on 2 cores
    python benchmarks/sandbox.py --json benchmarks/results/sandbox_cpu.json

Each figure is the median of ``--repeats`` rounds, with its range; say which machine (CPU, cores, kernel) it had.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

from polopt_lightning.data import CodeTask
from polopt_lightning.rewards import CodeExecutionReward
from polopt_lightning.sandbox import Limits, Sandbox

PROGRAM = "print(sum(range(1000)))"


def bare(n: int) -> float:
    """Seconds per run of PROGRAM as a plain child process (``python -E -s -S -B -c``), one after another."""
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-E", "-s", "-S", "-B", "-c", PROGRAM], capture_output=True, check=True)
    return (time.perf_counter() - start) / n


def serial(box: Sandbox, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        assert box.run_python(PROGRAM).ok
    return (time.perf_counter() - start) / n


def pooled(box: Sandbox, n: int) -> float:
    """Executions per second, ``n`` submitted at once to the pool."""
    start = time.perf_counter()
    results = box.map([lambda sb: sb.run_python(PROGRAM)] * n)
    assert all(r.ok for r in results)
    return n / (time.perf_counter() - start)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="executions per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hold-gib", type=float, default=4.0,
                        help="then once more while this process holds this many GiB (a trainer's memory)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    out: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "kernel": platform.release(),
                             "python": platform.python_version()}}
    try:
        with open("/proc/cpuinfo") as f:
            out["machine"]["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    out["machine"]["cores"] = len(os.sched_getaffinity(0))
    limits = Limits()
    box = Sandbox(limits)
    with_packages = Sandbox(limits, packages=True)
    rows = {"bare subprocess": [], "sandbox": [], "sandbox, packages": []}
    for _ in range(args.repeats):
        rows["bare subprocess"].append(1000 * bare(args.runs))
        rows["sandbox"].append(1000 * serial(box, args.runs))
        rows["sandbox, packages"].append(1000 * serial(with_packages, args.runs))
    out["ms_per_execution"] = {k: spread(v) for k, v in rows.items()}
    floor = out["ms_per_execution"]["bare subprocess"]["median"]
    print(f"machine: {out['machine']}")
    print("| one execution, one after another | ms (median, min-max) | x bare |")
    print("|---|---|---|")
    for k, v in out["ms_per_execution"].items():
        print(f"| {k} | {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f}) | {v['median'] / floor:.2f} |")
    out["executions_per_s"] = {}
    print("\n| pool concurrency | executions/s (median, min-max) |\n|---|---|")
    for c in args.concurrency:
        pool = Sandbox(limits, max_concurrency=c)
        figures = spread([pooled(pool, args.runs * 2) for _ in range(args.repeats)])
        out["executions_per_s"][str(c)] = figures
        print(f"| {c} | {figures['median']:.1f} ({figures['min']:.1f}-{figures['max']:.1f}) |")
    train, _ = CodeTask().splits()
    rows64 = train[:64]
    reward = CodeExecutionReward(sandbox=box)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        scores = reward([r["prompt"] for r in rows64], [r["solution"] for r in rows64],
                        tests=[r["tests"] for r in rows64])
        rates.append(len(rows64) / (time.perf_counter() - start))
        assert scores == [1.0] * len(rows64)
    out["code_reward_completions_per_s"] = spread(rates)
    out["code_reward_tests_per_completion"] = len(rows64[0]["tests"])
    print(f"\ncode reward, the code task's reference solutions ({out['code_reward_tests_per_completion']} tests each, "
          f"concurrency {box.max_concurrency}): {out['code_reward_completions_per_s']['median']:.1f} completions/s "
          f"({out['code_reward_completions_per_s']['min']:.1f}-{out['code_reward_completions_per_s']['max']:.1f})")
    if args.hold_gib:
        import torch

        held = torch.ones(int(args.hold_gib * 2**30) // 4)  # written: resident, as a trainer's weights are
        figures = spread([1000 * serial(box, args.runs) for _ in range(args.repeats)])
        out[f"ms_per_execution_holding_{args.hold_gib:g}_gib"] = figures
        print(f"one execution while this process holds {args.hold_gib:g} GiB: {figures['median']:.1f} ms "
              f"({figures['min']:.1f}-{figures['max']:.1f}; the sandbox starts its launcher without copying the "
              "trainer)")
        del held
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
