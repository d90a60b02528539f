"""Small models at equal samples against TRL: the default job's shape (the 2.6M tiny model, 8 prompts x 8 completions
of up to 6 tokens a rollout, two optimizer steps a rollout), both trainers from the same warm-started weights for the
same number of rollouts, no validation while training; the RL's wall time and the held-out greedy accuracy after, per
task and seed.

    python benchmarks/small_models.py                                      # arithmetic and reverse, seeds 0-2
    python benchmarks/small_models.py --tasks arithmetic --seeds 0 --rollouts 5 --val-size 50 --warm warm_start.steps=20
    python benchmarks/small_models.py --polopt trainer.precision=bf16-mixed --polopt rollout.dtype=bfloat16 --trl bf16=true

For each (task, seed): the default job's warm start (``polopt-train``'s, cached) is run once and saved; then polopt
trains as a user runs it (``polopt-train task=... model=pretrained model.name_or_path=<saved> warm_start.enabled=false
validate_before=false +trainer.limit_val_batches=0``: its logger, checkpoints and callbacks included) and TRL's
GRPOTrainer trains with the same settings (GRPO, beta 0, clipping 0.2, group-scaled advantages, ``loss_type="grpo"``,
AdamW at 4e-5 with a cosine schedule after 20 warm-up steps, gradient norm clipped at 1, temperature 1, the task's two
reward functions with their weights, gradient checkpointing off as in polopt, nothing saved), each in a process of its
own, the order alternating by seed. Both final policies are then scored by one function (greedy completions, exact
match, the task's held-out prompts). Printed: per run the RL's seconds and the accuracy before and after, then per task
the median time ratio (TRL / polopt) with its range and whether polopt ended at or above TRL's accuracy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import cpu_description  # noqa: E402
from throughput import CHILD_ENV, child_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def compose(task: str, seed: int, extra: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from polopt_lightning.confschema import config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[f"task={task}", f"seed={seed}", *extra])


def prepare(task: str, seed: int, folder: Path, val_size: int | None, extra: list[str]) -> None:
    """The default job's warm start on ``task`` (cached as ``polopt-train`` caches it), saved to ``folder`` with the
    task's rows (``rows.json``)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from polopt_lightning.cli import _container, _warm_start
    from polopt_lightning.data import PromptDataModule

    cfg = compose(task, seed, ([f"task.val_size={val_size}"] if val_size else []) + extra)
    model, tokenizer = instantiate(cfg.model)
    task_obj = instantiate(_container(cfg, "task"), _convert_="all")
    data = PromptDataModule(task=task_obj, tokenizer=tokenizer, **OmegaConf.to_container(cfg.data, resolve=True))
    warm = _warm_start(cfg, model, tokenizer, data, "none", False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "rows.json").write_text(json.dumps({"train": list(data.train_rows), "val": list(data.val_rows),
                                                  "warm_start": {k: v for k, v in warm.items()
                                                                 if isinstance(v, (int, float, bool, str))}}))


def train_polopt(task: str, seed: int, folder: Path, rollouts: int, val_size: int | None, out: Path,
                 extra: list[str]) -> dict:
    """``polopt-train`` from the saved weights, as a user runs it; its RL's wall time (``results.json``)."""
    run_dir = out / "polopt_run"
    mini = int(compose(task, seed, extra)["update"].mini_batches)  # optimizer steps a rollout
    cmd = [sys.executable, "-m", "polopt_lightning", f"task={task}", f"seed={seed}", "model=pretrained",
           f"model.name_or_path={folder}", "warm_start.enabled=false", "validate_before=false",
           "+trainer.limit_val_batches=0", f"trainer.max_steps={mini * rollouts}", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={run_dir}"] + ([f"task.val_size={val_size}"] if val_size else []) + extra
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if proc.returncode:
        raise SystemExit(f"polopt-train failed:\n{proc.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    return {"rl_s": results["rl_wall_s"], "model": str(run_dir / "model")}


def train_trl(task: str, seed: int, folder: Path, rollouts: int, threads: int, out: Path, extra: list[str]) -> dict:
    """TRL's GRPOTrainer from the saved weights with polopt's default settings; ``train()``'s wall time."""
    import torch
    from datasets import Dataset
    from hydra.utils import instantiate
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    cfg = compose(task, seed, [])
    rows = json.loads((folder / "rows.json").read_text())["train"]
    generation, update, optimizer = cfg["generation"], cfg["update"], cfg["optimizer"]  # (cfg.update: a method)
    prompts, generations = int(cfg.data.get("batch_size", 8)), int(cfg.experience.get("num_generations", 8))
    mini = int(update.mini_batches)
    functions = instantiate(cfg.reward.functions)  # the task's reward functions, TRL's form: (prompts, completions, **columns)
    weights = dict(cfg.reward.get("weights") or {})
    settings = dict(
        output_dir=str(out / "trl_run"), use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=prompts * generations // mini, steps_per_generation=mini,
        gradient_accumulation_steps=1, num_generations=generations, max_completion_length=int(generation.max_new_tokens),
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        num_iterations=1, learning_rate=float(optimizer.lr), lr_scheduler_type="cosine",
        warmup_steps=int(update.warmup_steps), max_grad_norm=1.0, weight_decay=0.0, max_steps=mini * rollouts,
        disable_dropout=True, gradient_checkpointing=False, dataloader_num_workers=0, seed=seed,
        reward_weights=[float(weights.get(name, 1.0)) for name in functions], logging_steps=10,
    )
    settings.update({k: json.loads(v) for k, v in (item.split("=", 1) for item in extra)})  # --trl bf16=true ...
    config = GRPOConfig(**settings)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=list(functions.values()), args=config,
                          train_dataset=Dataset.from_list(rows))
    start = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - start
    trainer.model.save_pretrained(out / "trl_model")
    trainer.processing_class.save_pretrained(out / "trl_model")
    return {"rl_s": rl_s, "model": str(out / "trl_model")}


def accuracy(model_dir: str, folder: Path, threads: int) -> float:
    """Greedy exact-match accuracy on the task's held-out prompts (``folder``'s rows), one function for every policy
    (each saved with the warm start's tokenizer)."""
    import torch

    from polopt_lightning.models import load_pretrained
    from polopt_lightning.warmstart import greedy_accuracy

    torch.set_num_threads(threads)
    model, tokenizer = load_pretrained(model_dir, dtype="float32")
    return greedy_accuracy(model.eval(), tokenizer, json.loads((folder / "rows.json").read_text())["val"])


def child(args) -> None:
    folder, out = Path(args.folder), Path(args.out)
    if args.child == "prepare":
        prepare(args.task, args.seed, folder, args.val_size, args.warm)
        result = {}
    elif args.child == "polopt":
        result = train_polopt(args.task, args.seed, folder, args.rollouts, args.val_size, out, args.polopt)
    else:
        result = train_trl(args.task, args.seed, folder, args.rollouts, args.threads, out, args.trl)
    if args.child != "prepare":
        result["accuracy"] = accuracy(result["model"], folder, args.threads)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(kind: str, args, task: str, seed: int, folder: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--task", task, "--seed", str(seed), "--folder", str(folder),
           "--out", str(out), "--rollouts", str(args.rollouts), "--threads", str(args.threads)]
    cmd += ["--val-size", str(args.val_size)] if args.val_size else []
    cmd += [f"--polopt={item}" for item in args.polopt] + [f"--trl={item}" for item in args.trl]
    cmd += [f"--warm={item}" for item in args.warm]
    return child_result(cmd, f"{kind} ({task}, seed {seed})", env={**CHILD_ENV, "OMP_NUM_THREADS": str(args.threads)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["arithmetic", "reverse"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--val-size", type=int, help="held-out prompts (default: the task's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--polopt", action="append", default=[], metavar="OVERRIDE",
                        help="an override for polopt-train (repeat: --polopt trainer.precision=bf16-mixed ...); "
                             "polopt's only: TRL keeps the default job's settings")
    parser.add_argument("--trl", action="append", default=[], metavar="KEY=JSON",
                        help="a GRPOConfig argument for TRL, its value as JSON (repeat: --trl bf16=true)")
    parser.add_argument("--warm", action="append", default=[], metavar="OVERRIDE",
                        help="an override for the warm start's configuration (a smoke run: --warm warm_start.steps=20)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", choices=["prepare", "polopt", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks/small_models.py compares against TRL, which is not installed: "
                         "pip install -e '.[bench]'")
    runs = []
    for task in args.tasks:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory(prefix="polopt_small_") as tmp:
                folder = Path(tmp) / "warm"
                folder.mkdir()
                run_child("prepare", args, task, seed, folder, Path(tmp))
                warm = json.loads((folder / "rows.json").read_text())["warm_start"]
                run = {"task": task, "seed": seed, "before": accuracy(str(folder), folder, args.threads),
                       "warm_start": warm}
                order = ["polopt", "trl"] if seed % 2 == 0 else ["trl", "polopt"]
                for impl in order:
                    out = Path(tmp) / impl
                    out.mkdir()
                    run[impl] = run_child(impl, args, task, seed, folder, out)
                    run[impl].pop("model")
                runs.append(run)
                print(f"{task} seed {seed}: accuracy {run['before']:.3f} -> polopt {run['polopt']['accuracy']:.3f} "
                      f"in {run['polopt']['rl_s']:.1f} s, TRL {run['trl']['accuracy']:.3f} in {run['trl']['rl_s']:.1f} s",
                      flush=True)
    print(f"\n{cpu_description()}, {args.threads} threads; {args.rollouts} rollouts of 8 x 8 completions; polopt "
          f"{' '.join(args.polopt) or '(defaults)'}; TRL {' '.join(args.trl) or '(the settings above)'}")
    print("| task | seeds | polopt RL s (median, range) | TRL RL s | TRL / polopt time (median, range) | accuracy "
          "before -> polopt / TRL (median) | polopt at or above TRL |")
    print("|---|---|---|---|---|---|---|")
    for task in args.tasks:
        rs = [r for r in runs if r["task"] == task]
        ratios = [r["trl"]["rl_s"] / r["polopt"]["rl_s"] for r in rs]
        p, t = [r["polopt"]["rl_s"] for r in rs], [r["trl"]["rl_s"] for r in rs]
        at_or_above = sum(r["polopt"]["accuracy"] >= r["trl"]["accuracy"] for r in rs)
        print(f"| {task} | {len(rs)} | {statistics.median(p):.1f} ({min(p):.1f}-{max(p):.1f}) | "
              f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) | **{statistics.median(ratios):.2f}x** "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(r['before'] for r in rs):.3f} -> "
              f"{statistics.median(r['polopt']['accuracy'] for r in rs):.3f} / "
              f"{statistics.median(r['trl']['accuracy'] for r in rs):.3f} | {at_or_above} of {len(rs)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_description(), "threads": args.threads,
                                               "rollouts": args.rollouts, "polopt": args.polopt, "trl": args.trl,
                                               "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
