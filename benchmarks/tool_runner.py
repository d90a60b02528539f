"""What a tool call costs the trainer on each runner (polopt_lightning/rollout/tool_runner.py): a tool that returns at
once, called in batches of 8, by a process that imported torch and holds ``--gib`` GiB of tensors besides (a trainer's
resident memory). The process runner forks the trainer for each call, and a fork copies the page tables of its
resident memory: its cost grows with the trainer's size; the thread runner's does not.

    python benchmarks/tool_runner.py                  # 0, 1 and 4 GiB held, 80 calls each (a minute on 2 cores)

Prints, for each size, the median milliseconds a call costs in a batch of 8 (the batch's wall time / 8) and alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from polopt_lightning.rollout.tool_runner import ToolCall, ToolRunner


def noop() -> int:
    return 1


def per_call(runner: ToolRunner, batch: int, rounds: int) -> float:
    """The median wall time of a batch of ``batch`` calls, per call, in ms."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        runner.run([ToolCall(noop, timeout=30) for _ in range(batch)])
        times.append((time.perf_counter() - start) / batch)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[0, 1, 4], help="GiB of tensors the process holds")
    parser.add_argument("--calls", type=int, default=80, help="calls per size and runner")
    args = parser.parse_args()
    with open("/proc/self/status") as f:
        base = next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 2**20
    print(f"torch imported: {base:.2f} GiB anonymous resident memory before the tensors")
    print("| GiB held | process: ms a call, 8 at once | alone | thread: ms a call, 8 at once | alone |")
    print("|---|---|---|---|---|")
    for gib in args.gib:
        held = torch.ones(int(gib * 2**30) // 4) if gib else None  # written: resident, as a trainer's weights are
        process, thread = ToolRunner("process", 8), ToolRunner("thread", 8)
        process.run([ToolCall(noop)])
        cells = [per_call(r, b, max(args.calls // b, 3)) for r in (process, thread) for b in (8, 1)]
        print(f"| {gib:g} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        del held


if __name__ == "__main__":
    main()
