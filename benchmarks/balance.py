"""Token balancing between data-parallel processes (``update.balance_tokens``): how long each step's update waits.

Two CPU processes (DDP, gloo, one thread each) train the module under Lightning with and without balancing, run after
run alternating. Each process samples its own prompts; each group's completions are cut to a length drawn for the
group (uniform in ``--min-tokens``..``--new-tokens``, a little spread inside the group, the same draws in both
settings), so one process often holds more tokens than the other, as with real reasoning completions. Timed: the
update (``Updater.run``: the passes, the backward, the gradient's reduction, the optimizer step) from a barrier after
the rollout, on the process that finishes last; also each step's ``token_imbalance_before``/``token_imbalance``
(the larger process's tokens over the mean). The rollout's own wait (sampling runs before balancing) is not counted.

    python benchmarks/balance.py --padding-free      # 4 prompts x 4 completions a process, up to 256 tokens
    python benchmarks/balance.py                     # the padded passes (where update.balance_tokens=null is off)
    python benchmarks/balance.py --steps 2 --runs 1 --new-tokens 32 --hidden 64   # a smoke run (a minute)

Lightning relaunches this script for the second process (its ``popen`` launcher); ``--child`` runs one setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch


def child(args: argparse.Namespace) -> None:
    import lightning as L

    from polopt_lightning import PolicyOptimizationModule, PromptDataModule
    from polopt_lightning.data import ArithmeticTask
    from polopt_lightning.distributed import close_process_group
    from polopt_lightning.models import build_tiny_model

    torch.set_num_threads(1)
    model, tok = build_tiny_model(hidden_size=args.hidden, num_layers=4, num_heads=4,
                                  max_position_embeddings=args.new_tokens + 64, seed=0)
    times: list[float] = []
    imbalance: list[tuple[float, float]] = []

    class Timed(PolicyOptimizationModule):
        def make_experience(self, batch):
            exp, metrics = super().make_experience(batch)
            G = self.experience.num_generations
            for i, prompt in enumerate(batch["prompts"]):  # the group's length, drawn from its prompt and the step
                g = torch.Generator().manual_seed(zlib.crc32(f"{prompt}/{self.global_step}".encode()))
                base = int(torch.randint(args.min_tokens, args.new_tokens + 1, (1,), generator=g))
                lengths = (base * (0.8 + 0.2 * torch.rand(G, generator=g))).long().clamp(1, args.new_tokens)
                cut = torch.arange(exp.completion_mask.shape[1])[None] >= lengths[:, None]
                exp.completion_mask[i * G:(i + 1) * G][cut] = 0
            return exp, metrics

        def _training_step(self, batch):
            exp, metrics = self.make_experience(batch)
            torch.distributed.barrier()
            start = time.perf_counter()
            out = self.updater.run(exp, self.optimizers(), self.lr_schedulers())
            # the process that finishes last sets the step's time: the others wait for it at the next collective
            elapsed = torch.tensor(time.perf_counter() - start)
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            times.append(float(elapsed))
            if "token_imbalance" in out:
                imbalance.append((float(out["token_imbalance_before"]), float(out["token_imbalance"])))

    data = PromptDataModule(task=ArithmeticTask(digits=2, train_size=64, val_size=4, seed=0), tokenizer=tok,
                            batch_size=args.prompts, shuffle=True)
    module = Timed(model, tok, objective="grpo", reward_fns=[lambda prompts, completions, **kw: [
                       float(len(c) % 3) for c in completions]],
                   experience={"num_generations": args.generations},
                   generation={"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens},
                   update={"balance_tokens": args.balance, "micro_batch_tokens": args.micro_batch_tokens,
                           "padding_free": args.padding_free})
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        strategy=L.pytorch.strategies.DDPStrategy(process_group_backend="gloo"),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"times": times, "imbalance": imbalance}))
    close_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps a run (the first is left out)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a process a step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--padding-free", action="store_true", help="update.padding_free=true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balance", type=lambda v: v == "true", default=True, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    import tempfile

    results: dict[bool, dict[str, list]] = {True: {"times": [], "imbalance": []}, False: {"times": [], "imbalance": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for balance in (False, True):
                out = Path(tmp) / f"{balance}_{run}.json"
                cmd = [sys.executable, __file__, "--child", f"--balance={str(balance).lower()}", f"--out={out}",
                       *sys.argv[1:]]
                subprocess.run(cmd, check=True, cwd=tmp)
                got = json.loads(out.read_text())
                results[balance]["times"] += got["times"][1:]  # the first step warms up
                results[balance]["imbalance"] += got["imbalance"][1:]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    off, on = results[False]["times"], results[True]["times"]
    before = [b for b, _ in results[True]["imbalance"]]
    after = [a for _, a in results[True]["imbalance"]]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import cpu_description

    passes = "padding-free" if args.padding_free else f"padded, micro_batch_tokens={args.micro_batch_tokens}"
    print(f"{cpu_description()}; {passes} passes; 2 processes x 1 thread, {args.prompts} prompts x {args.generations} completions a process, lengths "
          f"{args.min_tokens}..{args.new_tokens} by group, hidden {args.hidden}; {len(on)} steps a setting")
    print(f"token imbalance (largest process / mean): unbalanced {spread(before)}, balanced {spread(after)}")
    print(f"update s/step (the last process): unbalanced {spread(off)}, balanced {spread(on)}, "
          f"{statistics.median(off) / statistics.median(on):.2f}x")
    print("RESULT " + json.dumps({"unbalanced_s": statistics.median(off), "balanced_s": statistics.median(on),
                                  "imbalance_before": statistics.median(before),
                                  "imbalance_after": statistics.median(after)}))


if __name__ == "__main__":
    main()
