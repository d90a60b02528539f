"""Micro-batches by completion length: the training pass of one mini-batch with mixed completion lengths.

Compares, in one process and alternating, ``PolicyOptimizationModule``'s split under ``micro_batch_tokens`` (rows
longest first, each piece at its own width and filled to the token budget; groups kept together with
``share_prompt``) against a plain split of the same rows in their random order into equal pieces sized for the
widest row. Same model as ``throughput.py``'s long-prompt workload (25M, 128-token prompts), 2 prompts x 8
completions of lengths drawn uniformly from 8..128 (what free-running sampling gives; ``throughput.py`` forces
full length, where sorting cannot matter). The gradient is the same either way (tests/test_performance_equivalence.py).

    python benchmarks/micro_batches.py --budget 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from throughput import WORKLOADS, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=1024, help="micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from polopt_lightning import PolicyOptimizationModule

    workload = WORKLOADS["long-prompt"]
    model, tok, prompts = build(workload)
    T = workload["new_tokens"]
    for share_prompt in (True, False):
        module = PolicyOptimizationModule(
            model, tok, objective="grpo", reward_fns=[lambda prompts, completions, **kw: [float(len(c) % 3)
                                                                                         for c in completions]],
            experience={"num_generations": workload["generations"]}, generation={"max_new_tokens": T, "min_new_tokens": T},
            update={"micro_batch_tokens": args.budget, "share_prompt": share_prompt})
        enc = tok(prompts[:2], return_tensors="pt", padding=True)
        exp, _ = module.make_experience({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask,
                                         "prompts": prompts[:2], "columns": {}})
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, T + 1, (exp.completion_ids.shape[0],), generator=g)
        exp.completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
        rows = torch.randperm(len(lengths), generator=g)
        by_length = module.updater.micro_batches

        def plain(exp, rows, budget=args.budget):
            width = int(exp.completion_mask[rows].sum(-1).max())
            return list(rows.split(max(1, budget // (exp.prompt_ids.shape[1] + width))))

        times: dict[str, list[float]] = {"plain split": [], "by length": []}
        for _ in range(args.repeats):
            for name, split in (("plain split", plain), ("by length", by_length)):
                module.updater.micro_batches = split
                start = time.perf_counter()
                module.accumulate_gradients(exp, rows)
                times[name].append(time.perf_counter() - start)
                module.policy.zero_grad(set_to_none=True)
        a, b = statistics.median(times["plain split"]), statistics.median(times["by length"])
        print(f"share_prompt={share_prompt}: plain split {a:.2f} s, by length {b:.2f} s ({a / b:.2f}x), "
              f"budget {args.budget} tokens, {args.repeats} alternating repeats")


if __name__ == "__main__":
    main()
