"""Checks that need CUDA (marker `gpu`, deselected by default; `pytest -m gpu` on a GPU machine; the device tool's
script: benchmarks/gpu_check.sh). Where they ran and passed: docs/distributed.md and docs/quantization.md."""

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.models import Adapter, Quantization, build_tiny_model, load_pretrained, prepare_policy
from polopt_lightning.rewards import ExactMatchReward

from .helpers import distinct_chars, run_if

pytestmark = [pytest.mark.gpu, run_if("cuda")]


@pytest.mark.parametrize("optimizer", ["paged_adamw_8bit", "adamw_8bit"])
def test_qlora_on_cuda_with_bitsandbytes_optimizers(tmp_path, optimizer):
    from functools import partial

    from polopt_lightning.optim import build_optimizer

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    quant = Quantization(mode="nf4", compute_dtype="bfloat16")
    base, tok = load_pretrained(str(tmp_path / "base"), dtype="float32", quantization=quant, device_map={"": 0})
    policy = prepare_policy(base, quant, Adapter(kind="lora", r=8))
    train, val = ArithmeticTask(digits=1, train_size=40, val_size=8).splits()
    data = PromptDataModule(train=train, val=val, tokenizer=tok, batch_size=2)
    module = PolicyOptimizationModule(policy, tok, objective={"name": "gspo", "beta": 0.04}, update={"mini_batches": 2},
                                      reward_fns=[distinct_chars, ExactMatchReward()], experience={"num_generations": 4},
                                      generation={"max_new_tokens": 4},
                                      optimizer=partial(build_optimizer, name=optimizer, lr=1e-2))
    assert module.ref_model is None and module.shared_reference
    frozen = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" not in k}
    trainer = L.Trainer(max_steps=4, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    # Lightning's teardown moves the module back to the CPU: compare there
    assert all(torch.equal(v.cpu(), policy.state_dict()[k].cpu()) for k, v in frozen.items())
    assert torch.isfinite(torch.tensor(float(trainer.logged_metrics["train/kl"])))
    module.save_pretrained(tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Strategies on CUDA (docs/distributed.md). With one device the sharded paths run whole (FSDP's wrapping and forward
# gathers, ZeRO-3's gathered sampling) and must log what the plain single-device run logs; with two or more devices
# they also run across processes.
STRATEGY_RUN = ["trainer=gpu", "trainer.precision=32-true", "model.hidden_size=64", "model.num_layers=2",
                "model.num_heads=2", "model.intermediate_size=128", "task.digits=1", "task.train_size=40",
                "task.val_size=8", "data.batch_size=2", "experience.num_generations=4", "generation.max_new_tokens=4",
                "warm_start.steps=3", "warm_start.batch_size=4", "trainer.max_steps=4",
                "trainer.enable_progress_bar=false", "optimizer.lr=1e-3"]


def _strategy_run(tmp_path, name, overrides):
    import json
    import subprocess
    import sys

    run = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning", *STRATEGY_RUN, *overrides, f"hydra.run.dir={run}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import csv

    rows = [r for r in csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")) if r.get("train/reward")]
    return json.loads((run / "results.json").read_text()), rows


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_strategy_on_one_device_logs_what_the_plain_run_logs(strategy, tmp_path):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="pip install 'polopt-lightning[deepspeed]'")
    _, plain = _strategy_run(tmp_path, "plain", [])
    results, rows = _strategy_run(tmp_path, strategy, [f"strategy={strategy}", "trainer.devices=1"])
    assert results["strategy"] == strategy.split("_")[0] and results["steps"] == 4
    assert (tmp_path / strategy / "model" / "config.json").is_file()
    for a, b in zip(plain, rows):
        for key in ("train/reward", "train/completion_len", "train/entropy"):
            assert abs(float(a[key]) - float(b[key])) < 1e-4, (strategy, key, a[key], b[key])


@run_if("2 cuda")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_zero3"])
def test_strategy_on_two_devices(strategy, tmp_path):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="pip install 'polopt-lightning[deepspeed]'")
    results, rows = _strategy_run(tmp_path, strategy, [f"strategy={strategy}", "trainer.devices=2"])
    assert results["world_size"] == 2 and len(rows) == 2
    assert all(float(r["train/entropy"]) > 0 for r in rows)


def test_a_server_on_cuda_receives_the_weights_over_nccl_and_samples_the_trainers_tokens():
    """``rollout=server`` with the policy and the server on CUDA: the weight group is NCCL's (the server on the last
    device: another GPU where there are two), and after each push the server's greedy tokens are the trainer's."""
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig, build_engine

    from .helpers import free_port, start_server

    port = free_port()
    proc = start_server(port, "--device", f"cuda:{torch.cuda.device_count() - 1}")
    try:
        model, tok = build_tiny_model(hidden_size=64, num_layers=2, seed=0)
        model = model.cuda()
        engine = build_engine({"name": "server", "servers": f"127.0.0.1:{port}", "timeout_s": 120})
        enc = tok(["12+34=", "7*8="], return_tensors="pt", padding=True, padding_side="left").to("cuda")
        greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
        for push in (1, 2):
            got = engine.generate(model, enc.input_ids, enc.attention_mask, 2, greedy, tok.eos_token_id,
                                  tok.pad_token_id)
            want = HFRolloutEngine().generate(model, enc.input_ids, enc.attention_mask, 2, greedy, tok.eos_token_id,
                                              tok.pad_token_id)
            assert engine._wire == "nccl" and engine.version == push
            assert torch.equal(got.completion_ids, want.completion_ids), push
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            engine.policy_updated(model)
    finally:
        proc.kill()
        proc.wait()
