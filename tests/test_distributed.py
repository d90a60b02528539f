"""Several processes through Lightning's strategies: DDP and FSDP2 on CPU processes (gloo), the strategy group, the
data split, torchrun and SLURM launches.

The update under DDP is the single-process update over the same rollouts (gradients of every process's rows against
the whole mini-batch's normaliser); the advantages are the same whatever the number of processes; metrics are reduced
over the processes exactly; the strategy group composes and refuses what cannot run.
"""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from polopt_lightning.data import PromptDataModule
from polopt_lightning.data.sampling import PromptSampler, ResumableLoader, ShardSampler

from .helpers import FAST, compose_with, run_cli

HELPER = Path(__file__).parent / "helpers" / "ddp_update.py"


def _update(tmp_path, world, *args):
    out = tmp_path / f"update_{world}.pt"
    proc = subprocess.run([sys.executable, str(HELPER), str(out), str(world), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.distributed
@pytest.mark.parametrize("args", [# PPO: the critic's values, GAE whitened over every process's tokens, the value loss a
                                  # token mean over them (micro-batches), the KL penalty per token, the critic clipped
                                  # by its own norm
                                  ("ppo", "critic_lr=0.5", "micro_batch_tokens=40", "kl_in_reward=0.1",
                                   "mini_batches=2", "max_grad_norm=1.0"),
                                  ("gspo", "advantage_scale=batch", "anchor=0.5"),
                                  ("dr_grpo", "beta=0.5"),
                                  ("grpo", "micro_batch_tokens=40", "strategy=fsdp", "beta=0.5", "anchor=0.5"),
                                  ("grpo", "width=512", "beta=0.5"),
                                  ("cispo", "advantage_estimator=reinforce_pp_baseline"),
                                  ("grpo", "micro_batch_tokens=40", "entropy_coef=0.05", "top_entropy_quantile=0.5",
                                   "kl_in_reward=0.1", "beta=0.2", "kl_estimator=k2"),
                                  # the fused head (update.fused_head) and padding-free passes in every pass: also
                                  # against the padded, unfused update
                                  ("grpo", "micro_batch_tokens=40", "entropy_coef=0.05", "beta=0.2",
                                   "fused_head=true", "padding_free=true"),
                                  # the shipped update: clipping at 1.0, AdamW (its shipped settings), 2 mini-batches;
                                  # under FSDP2 Lightning clips the sharded gradients by their global norm
                                  ("grpo", "max_grad_norm=1.0", "optimizer=adamw", "mini_batches=2"),
                                  ("grpo", "strategy=fsdp", "max_grad_norm=1.0", "optimizer=adamw", "mini_batches=2"),
                                  # a sampler of other numerics: the gap's means and maximum over every process's rows
                                  ("gspo", "mini_batches=2", "sampler_noise=0.3"),
                                  # process 0 drew the long completions: balancing gives each process one long group
                                  # a step (update.balance_tokens: forced here; by default with micro-batches or
                                  # padding-free passes), also by mini-batch and under FSDP2
                                  ("grpo", "skew=true", "max_new_tokens=12", "beta=0.2", "anchor=0.5",
                                   "balance_tokens=true"),
                                  ("grpo", "skew=true", "max_new_tokens=12", "mini_batches=2", "strategy=fsdp",
                                   "micro_batch_tokens=40"),
                                  # PPO under FSDP2: the critic sharded too, in the optimizer's second group, each clipped
                                  # by its own norm (plain SGD: AdamW's first steps on the zero-started head's tiny
                                  # gradients amplify rounding)
                                  ("ppo", "strategy=fsdp", "critic_lr=0.5", "mini_batches=2", "max_grad_norm=1.0")],
                         ids=["ppo-critic-micro-batches-kl-in-reward-clip", "gspo-batch-scale-anchor", "dr_grpo-kl",
                              "fsdp-grpo-kl-anchor", "grpo-kl-onednn-linear", "cispo-reinforce-pp-whitened",
                              "grpo-entropy-bonus-top-mask-kl-in-reward", "fused-head-padding-free-entropy-bonus-kl",
                              "shipped-clip-adamw-2-mini-batches",
                              "fsdp-shipped-clip-adamw-2-mini-batches", "gspo-sampler-gap", "balanced-skewed-kl-anchor",
                              "fsdp-balanced-skewed-2-mini-batches", "fsdp-ppo-critic-2-mini-batches"])
def test_one_ddp_update_equals_the_single_process_update(args, tmp_path):
    one = _update(tmp_path, 1, *[a for a in args if not a.startswith("strategy=")])
    two = _update(tmp_path, 2, *args)  # DDP, or FSDP2 (the weights sharded over the 2 processes)
    assert (one["world"], two["world"]) == (1, 2)
    width = next((a.split("=")[1] for a in args if a.startswith("width=")), None)
    assert one["onednn"] is two["onednn"] is (width is not None)  # the 512-wide model's products go through oneDNN
    # the same advantages, prompt by prompt (each group normalised whole on the process that sampled it; the batch
    # scale from every process's rewards), and some learning signal in them
    assert one["advantages"].keys() == two["advantages"].keys() and len(one["advantages"]) == 4
    for prompt, values in one["advantages"].items():
        assert torch.allclose(torch.tensor(values), torch.tensor(two["advantages"][prompt]), atol=1e-6), prompt
    assert any(any(v != 0 for v in values) for values in one["advantages"].values())
    # the same weights after the step (plain SGD: any error in the gradient's scale would show; AdamW's steps, about
    # lr = 4e-5 each, are 40 times the tolerance, and its second step weighs the two mini-batches' gradients)
    moved = max((one["weights"][k] - w).abs().max().item() for k, w in _initial_weights(width).items())
    assert moved > (5e-5 if "optimizer=adamw" in args else 1e-2)
    if "max_grad_norm=1.0" in args:  # the clip acts: the steps' global norms (their mean logged) are above it
        assert one["metrics"]["train/grad_norm"] > 1.0
    if args[0] == "ppo":  # the critic's gradient, measured over its own parameters (FSDP2's sharded ones too)
        assert one["metrics"]["train/critic/grad_norm"] > 0 and two["metrics"]["train/critic/grad_norm"] > 0
    for name, weight in one["weights"].items():
        assert torch.allclose(weight, two["weights"][name], atol=1e-6, rtol=1e-5), name
    # how even the processes' tokens were, before and after balancing: logged where it runs, under data parallelism
    balance = {k: two["metrics"].pop(f"train/{k}", None) for k in ("token_imbalance", "token_imbalance_before")}
    balanced = "balance_tokens=true" in args or any(a.startswith(("micro_batch_tokens", "padding_free=true"))
                                                     for a in args)
    assert (balance["token_imbalance"] is not None) is balanced, balance
    if balanced:
        assert 1.0 <= balance["token_imbalance"] <= balance["token_imbalance_before"]
    if "skew=true" in args:  # 2 long groups against 2 short ones: one of each on each process
        assert balance["token_imbalance_before"] > 1.3 and balance["token_imbalance"] < 1.05, balance
        unbalanced = _update(tmp_path, 2, *[a for a in args if a != "balance_tokens=true"], "balance_tokens=false")
        assert not any(k.startswith("train/token_imbalance") for k in unbalanced["metrics"])
        for name, weight in unbalanced["weights"].items():  # the steps held the same completions
            assert torch.allclose(weight, two["weights"][name], atol=1e-6, rtol=1e-5), name
    gap = {"train/sampler_kl", "train/is_weight_mean", "train/is_weight_max", "train/is_capped_frac"}
    assert (gap <= one["metrics"].keys()) is any(a.startswith("sampler_noise") for a in args)
    if gap <= one["metrics"].keys():  # a gap to reduce: far from float rounding, some sequences beyond the cap
        assert one["metrics"]["train/sampler_kl"] > 1e-3 and 0 < one["metrics"]["train/is_capped_frac"] < 1
    # the same logged metrics: token-weighted, maxima, whole-batch reward statistics
    assert one["metrics"].keys() == two["metrics"].keys()
    for name, value in one["metrics"].items():
        assert math.isclose(value, two["metrics"][name], rel_tol=1e-5, abs_tol=1e-6), (name, value, two["metrics"][name])
    if "fused_head=true" in args:  # the fused, padding-free update is the padded one within float tolerance
        plain = _update(tmp_path, 1, *[a.replace("=true", "=false") for a in args])
        for name, weight in plain["weights"].items():
            assert torch.allclose(weight, one["weights"][name], atol=1e-6, rtol=1e-5), name


def _initial_weights(width=None):
    from polopt_lightning.models import build_tiny_model

    from .helpers.ddp_update import model_shape

    return build_tiny_model(**model_shape(width), seed=0)[0].state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_ddp_cpu_from_the_command_line(objective, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(FAST + ["strategy=ddp_cpu", f"objective={objective}", "trainer.max_steps=4", "num_threads=1",
                        "trainer.val_check_interval=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("polopt-train summary") == 1  # one summary, from the first process
    results = json.loads((run / "results.json").read_text())
    assert results["world_size"] == 2 and results["strategy"] == "ddp" and results["steps"] == 4
    assert (run / "model" / "config.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    rows = [r for r in csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")) if r.get("train/reward")]
    assert len(rows) == 2  # one row per rollout of the 2 processes together
    assert any(r.get("val/accuracy") for r in csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")))


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp_cpu", "fsdp"])
def test_two_process_resume_continues_every_process(strategy, tmp_path):
    """Every process's random states come back: a 2-process run resumed from its checkpoint logs what the
    uninterrupted one does (FSDP2: the sharded weights and optimizer state gathered into one file and back)."""
    args = FAST + [f"strategy={strategy}", "trainer.devices=2", "num_threads=1", "task.val_size=9", "data.batch_size=3", "experience.num_generations=3",
                   "callbacks.checkpoint.every_n_train_steps=2", "optimizer.lr=1e-3"]
    whole = run_cli(args + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path}/whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli(args + ["trainer.max_steps=2", f"hydra.run.dir={tmp_path}/part"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(args + ["trainer.max_steps=6", f"ckpt_path={tmp_path}/part/checkpoints/last.ckpt",
                           f"hydra.run.dir={tmp_path}/part"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ckpt = torch.load(tmp_path / "part" / "checkpoints" / "last.ckpt", weights_only=True)
    assert len(ckpt["polopt"]["rng"]) == 2  # one set of random states per process

    def train_rows(path):
        return {r["step"]: r for r in csv.DictReader(open(path)) if r.get("train/reward")}

    expected = train_rows(tmp_path / "whole" / "csv" / "version_0" / "metrics.csv")
    got = train_rows(tmp_path / "part" / "csv" / "version_1" / "metrics.csv")
    assert sorted(got) == ["1", "2"]
    for step, row in got.items():
        for key in ("train/reward", "train/entropy", "train/loss", "train/grad_norm", "train/completion_len"):
            assert math.isclose(float(row[key]), float(expected[step][key]), rel_tol=1e-6, abs_tol=1e-7), (step, key)


def _free_port():
    """A free port below the kernel's ephemeral range. A process that retries connecting to a port inside that range
    before its server listens can be given that very port as its own source port and connect to itself (TCP
    self-connect); the server then fails to bind it and the client waits for ever: once in CI."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    # a generator of its own: the global one is seeded by the tests before (seed_everything), so two workers running
    # the two variants at once drew the same port (EADDRINUSE in CI); checked on every interface, as the store listens
    for port in random.Random().sample(range(min(low, 32768) - 8000, min(low, 32768)), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found below the ephemeral range")


def _wait_all(procs, files, timeout):
    """Wait for every process; when one fails or the time runs out, stop the others (a survivor would wait for its
    peer until the process group's timeout) and fail with every process's stderr. Returns (stdout, stderr) each."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:  # the whole session: torchrun's worker too
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    outputs = [(out.read_text(), err.read_text()) for out, err in files]
    report = "\n".join(f"--- process {i}: exit {p.returncode}\nstdout: {out[-1500:]}\nstderr: {err[-3000:]}"
                        for i, (p, (out, err)) in enumerate(zip(procs, outputs)))
    assert all(p.returncode == 0 for p in procs), report
    return outputs


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_nodes_launched_by_torchrun_or_slurm(launcher, tmp_path):
    """The multi-node launch of docs/distributed.md, with two "nodes" of one process each on this machine: every
    process writes into the one run directory, the first one the results."""
    import os

    run, port = tmp_path / "run", _free_port()
    args = [*FAST, "strategy=ddp_cpu", "trainer.devices=1", "trainer.num_nodes=2", "num_threads=1",
            f"hydra.run.dir={run}"]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                       "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "-m",
                       "polopt_lightning", *args]
        else:  # what srun sets for each task of `sbatch --nodes=2 --ntasks-per-node=1`
            env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NAME="polopt", SLURM_JOB_ID="4242",
                       SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node),
                       MASTER_PORT=str(port))
            command = [sys.executable, "-m", "polopt_lightning", *args]
        out, err = (open(tmp_path / f"node{node}.{kind}", "w+") for kind in ("out", "err"))
        procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err, text=True,
                                      start_new_session=True))
    outputs = _wait_all(procs, [(tmp_path / f"node{n}.out", tmp_path / f"node{n}.err") for n in (0, 1)], timeout=300)
    results = json.loads((run / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 2
    assert (run / "train_ddp_process_1.log").is_file() and (run / "model" / "config.json").is_file()
    assert "polopt-train summary" in outputs[0][0] and "polopt-train summary" not in outputs[1][0]


def test_an_externally_launched_process_needs_a_named_run_directory(tmp_path):
    import os

    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning", *FAST], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "give hydra.run.dir=" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------------
def test_strategy_group_builds_lightning_strategies(tmp_path):
    from hydra.utils import instantiate

    from polopt_lightning.models import build_tiny_model
    from polopt_lightning.strategies import decoder_layer_classes, no_inference_mode

    model, _ = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    cfg = compose_with(["strategy=ddp_cpu"], tmp_path)
    assert cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu"
    strategy = instantiate(cfg.strategy)(model=model)
    assert isinstance(strategy, L.pytorch.strategies.DDPStrategy) and strategy._process_group_backend == "gloo"
    cfg = compose_with(["strategy=ddp_cpu", "trainer.devices=4", "trainer.num_nodes=2"], tmp_path)
    assert cfg.trainer.devices == 4 and cfg.trainer.num_nodes == 2  # command-line overrides win
    fsdp = instantiate(compose_with(["strategy=fsdp"], tmp_path).strategy)(model=model)
    assert isinstance(fsdp, L.pytorch.strategies.ModelParallelStrategy) and fsdp.reshard_after_forward
    assert not fsdp._save_distributed_checkpoint  # one file: polopt-export reads it
    # evaluation under no_grad, as Lightning's FSDPStrategy: checkpoints saved at a validation's end under nccl
    # failed inside inference mode (seen on an H200; docs/distributed.md)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=fsdp, logger=False)
    assert trainer.validate_loop.inference_mode  # Lightning's default (its validation inside fit has no_grad)
    no_inference_mode(trainer)
    assert not any(loop.inference_mode for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop))
    assert {c.__name__ for c in decoder_layer_classes(model)} == {"Qwen2DecoderLayer"}


@pytest.mark.parametrize("overrides,message", [
    (["strategy=fsdp", "strategy.process_group_backend=nccl"], "strategy.process_group_backend=gloo"),
    (["strategy=deepspeed_zero3"], "needs CUDA devices"),
    (["strategy=fsdp", "trainer=gpu", "quantization=nf4", "adapter=lora"], "quantization=nf4 with strategy=fsdp"),
    (["strategy=deepspeed_zero2", "trainer=gpu", "update.micro_batch_tokens=512"], "update.micro_batch_tokens"),
    (["strategy=deepspeed_zero2", "trainer=gpu", "optimizer=adamw_8bit"], "optimizer=adamw_8bit"),
])
def test_impossible_strategies_are_refused_naming_their_keys(overrides, message, tmp_path):
    proc = run_cli(FAST + overrides + [f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------------
def test_one_process_order_is_the_shuffled_dataloaders():
    """The resumable sampler keeps the order runs had before it: DataLoader(shuffle=True) with a seeded generator,
    iterated as Lightning does (len(loader) batches an epoch, never to the iterator's end)."""
    from itertools import islice

    for size in (37, 40):  # with a remainder, and a whole number of batches
        rows = list(range(size))
        old = DataLoader(rows, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(5))
        sampler = PromptSampler(rows, seed=5)
        new = DataLoader(rows, batch_size=4, sampler=sampler, drop_last=True)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            expected = [b.tolist() for b in islice(iter(old), len(old))]
            assert [b.tolist() for b in new] == expected, (size, epoch)


def test_processes_split_each_epoch_and_validation_counts_each_sample_once():
    rows = list(range(23))
    shards = [list(PromptSampler(rows, num_replicas=3, rank=r, seed=1)) for r in range(3)]
    assert all(len(s) == 7 for s in shards) and not set(shards[0]) & set(shards[1])
    whole = PromptSampler(rows, seed=1).permutation(0)
    assert [i for group in zip(*shards) for i in group] == whole[:21]
    val = [list(ShardSampler(rows, 3, r)) for r in range(3)]
    assert sorted(i for s in val for i in s if i >= 0) == rows  # each sample once
    assert {len(s) for s in val} == {8} and val[2][-1] == -1  # even shares: the short one ends with a padding row


def test_loader_position_round_trips_and_refuses_another_split(tok_rows):
    tok, rows = tok_rows
    dm = PromptDataModule(train=rows, tokenizer=tok, batch_size=2, seed=3)
    batches = [b["prompts"] for b in dm.train_dataloader()]
    loader = dm.train_dataloader()
    loader.load_state_dict({"epoch": 0, "consumed": 3, "batch_size": 2, "num_replicas": 1, "seed": 3})
    assert [b["prompts"] for b in loader] == batches[3:]
    assert [b["prompts"] for b in loader] == batches  # the skip applies to the saved epoch only
    with pytest.raises(ValueError, match="data.batch_size"):
        loader.load_state_dict({"epoch": 0, "consumed": 3, "batch_size": 4, "num_replicas": 1, "seed": 3})
    assert isinstance(loader, ResumableLoader)


def test_dynamic_sampling_extra_batches_are_a_function_of_their_index(tok_rows):
    tok, rows = tok_rows
    dm = PromptDataModule(train=rows, tokenizer=tok, batch_size=2, seed=3)
    assert dm.extra_batch(7)["prompts"] == dm.extra_batch(7)["prompts"]
    assert dm.extra_batch(0)["prompts"] != next(iter(dm.train_dataloader()))["prompts"]


def test_epoch_boundary_resume_continues_with_the_next_epoch(tok_rows, tmp_path):
    """A checkpoint saved on an epoch's last batch resumes with the next epoch's first batch."""
    tok, rows = tok_rows

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def training_step(self, batch, i):
            self.seen.append(tuple(batch["prompts"]))
            return self.w * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(steps, ckpt=None):
        module = Recorder()
        trainer = L.Trainer(max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                            enable_checkpointing=False)
        trainer.fit(module, datamodule=PromptDataModule(train=rows, tokenizer=tok, batch_size=2, seed=3),
                    ckpt_path=ckpt)
        return trainer, module

    _, whole = fit(9)
    per_epoch = len(rows) // 2
    for stop in (per_epoch - 1, per_epoch):  # mid-epoch, and on the epoch's last batch
        trainer, part = fit(stop)
        trainer.save_checkpoint(tmp_path / f"stop{stop}.ckpt")
        _, rest = fit(9, tmp_path / f"stop{stop}.ckpt")
        assert part.seen + rest.seen == whole.seen, stop


@pytest.fixture
def tok_rows():
    from polopt_lightning.models import build_tiny_model

    _, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    return tok, [{"prompt": f"{i}+1="} for i in range(8)]
