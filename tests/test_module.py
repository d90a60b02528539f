"""PolicyOptimizationModule as a drop-in LightningModule in a plain Trainer."""

import copy
import csv
import math

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.objectives import GRPO, GSPO

from .helpers import distinct_chars, make, trainer

REQUIRED = ["train/reward", "train/reward_std", "train/rewards/digit_match/mean", "train/rewards/exact_match/mean",
            "train/frac_zero_std", "train/entropy", "train/clip_frac", "train/completion_len", "train/grad_norm",
            "train/lr", "train/loss"]


@pytest.mark.parametrize("objective", [GRPO(), GSPO()], ids=["grpo", "gspo"])
def test_drop_in_trainer_updates_and_logs(tmp_path, tiny, arithmetic_rows, objective):
    module, dm = make(tiny, arithmetic_rows, objective=objective, update={"mini_batches": 2})
    before = [p.detach().clone() for p in module.policy.parameters()]
    t = trainer(tmp_path, steps=4, val_check_interval=1, check_val_every_n_epoch=None)
    t.validate(module, datamodule=dm, verbose=False)  # validating before fit, then during fit, must both work
    t.fit(module, datamodule=dm)
    assert t.global_step == 4  # 2 rollouts x 2 mini-batches
    assert "val/accuracy" in t.logged_metrics
    changed = sum(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert changed > 0
    assert all(p.grad is None for p in module.policy.parameters())  # freed after each step, before the next rollout
    for key in REQUIRED:
        assert key in t.logged_metrics, key
        assert math.isfinite(float(t.logged_metrics[key])), key
    assert "train/kl" not in t.logged_metrics  # beta = 0: no reference pass, no kl
    assert module.ref_model is None
    t.logger.save()
    rows = list(csv.DictReader(open(t.logger.log_dir + "/metrics.csv")))
    assert any(r.get("train/reward") for r in rows)
    # validation
    results = t.validate(module, datamodule=dm, verbose=False)[0]
    assert 0.0 <= results["val/accuracy"] <= 1.0 and "val/reward" in results


def test_kl_reference_and_off_policy_updates(tmp_path, tiny, arithmetic_rows):
    module, dm = make(tiny, arithmetic_rows, objective=GRPO(beta=0.1), update={"num_iterations": 2, "mini_batches": 2})
    assert module.ref_model is not None and not any(p.requires_grad for p in module.ref_model.parameters())
    ref_before = [p.clone() for p in module.ref_model.parameters()]
    t = trainer(tmp_path, steps=4)
    t.fit(module, datamodule=dm)
    assert t.global_step == 4  # one rollout, 2 passes x 2 mini-batches
    # the rollout's mean over its 4 steps: 0 at the first (the policy is the reference), then > 0 as the policy moves
    # (k3 is never negative: ">= 0" would hold for a KL taken against the policy itself)
    assert "train/kl" in t.logged_metrics and 0 < float(t.logged_metrics["train/kl"]) < 1
    # the second pass is off-policy: the ratio has moved away from 1
    assert all(torch.equal(a, b) for a, b in zip(ref_before, module.ref_model.parameters()))


def test_dynamic_sampling_drops_constant_groups(tmp_path, tiny, arithmetic_rows):
    calls = {"n": 0}

    def constant_for_first_draw(prompts, completions, **kw):
        calls["n"] += 1
        # first draw: every group constant (no signal); later draws: distinct rewards
        return [0.0] * len(completions) if calls["n"] == 1 else [float(i % 2) for i in range(len(completions))]

    module, dm = make(tiny, arithmetic_rows, reward_fns=[constant_for_first_draw], experience={"dynamic_sampling": True, "max_extra_draws": 2})
    t = trainer(tmp_path, steps=1)
    t.fit(module, datamodule=dm)
    assert float(t.logged_metrics["train/dynamic_sampling/dropped_groups"]) == 4
    assert float(t.logged_metrics["train/dynamic_sampling/extra_draws"]) == 1
    assert float(t.logged_metrics["train/frac_zero_std"]) == 1.0  # what the first draw looked like


def test_checkpoint_resumes(tmp_path, tiny, arithmetic_rows):
    module, dm = make(tiny, arithmetic_rows)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    t = L.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[ckpt_cb], enable_progress_bar=False,
                  num_sanity_val_steps=0, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2 and "polopt" in ckpt and ckpt["optimizer_states"]
    assert any(k.startswith("policy.") for k in ckpt["state_dict"])
    module2, dm2 = make(tiny, arithmetic_rows)
    t2 = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0)
    t2.fit(module2, datamodule=dm2, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert t2.global_step == 4


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"experience": {"num_generations": 1}}, ValueError, "experience.num_generations must be >= 2"),
        ({"objective": "trpo"}, KeyError,
         "unknown objective 'trpo'; known objectives: bnpo, cispo, dapo, dr_grpo, grpo, gspo, ppo, sapo"),
        ({"update": {"mini_batches": 0}}, ValueError, "update.mini_batches must be >= 1"),
        ({"reward_fns": None}, ValueError, "reward_fns is required"),
        ({"accuracy_reward": "nope"}, ValueError, "accuracy_reward='nope'"),
        ({"experience": {"advantage_scale": "std"}}, ValueError, "experience.advantage_scale must be one of"),
        ({"update": {"lr_schedule": "step"}}, ValueError, "update.lr_schedule must be one of"),
        ({"optimizer": {"lr": -1.0}}, ValueError, "optimizer.lr must be > 0, got -1.0"),
        ({"optimizer": {"betas": (0.9, 1.5)}}, ValueError,
         r"optimizer.betas must be two numbers in \[0, 1\), got \(0.9, 1.5\)"),
        ({"update": {"min_lr_ratio": 2}}, ValueError, r"update.min_lr_ratio must be in \[0, 1\]"),
        ({"update": {"warmup_steps": -1}}, ValueError, "update.warmup_steps must be >= 0"),
        ({"update": {"micro_batch_tokens": 0}}, ValueError, "update.micro_batch_tokens must be >= 1 or None"),
        ({"update": {"mini_batch": 2}}, ValueError, "update: unknown settings \\['mini_batch'\\]"),
        ({"mini_batch": 2}, TypeError, "unexpected keyword argument 'mini_batch'"),
    ],
)
def test_bad_module_input(tiny, arithmetic_rows, kwargs, error, match):
    with pytest.raises(error, match=match):
        make(tiny, arithmetic_rows, **kwargs)


def test_too_many_mini_batches_for_the_rollout(tmp_path, tiny, arithmetic_rows):
    module, dm = make(tiny, arithmetic_rows, update={"mini_batches": 64})
    with pytest.raises(ValueError, match="update.mini_batches=64 .* 16 completions"):
        trainer(tmp_path, steps=1).fit(module, datamodule=dm)


def test_failing_reward_names_function_and_sample(tmp_path, tiny, arithmetic_rows):
    def broken(prompts, completions, **kw):
        return [1.0] * (len(completions) - 1)

    module, dm = make(tiny, arithmetic_rows, reward_fns=[broken])
    with pytest.raises(Exception, match="'broken' returned 15 values for 16 completions"):
        trainer(tmp_path, steps=1).fit(module, datamodule=dm)


def test_validation_means_leave_none_rewards_out(tmp_path, tiny):
    """A validation batch whose accuracy reward is None for every sample counts for nothing (not as 0)."""
    model, tok = tiny

    def half_none(prompts, completions, idx=None, **kw):
        return [None if i < 4 else float(i % 2) for i in idx]

    rows = [{"prompt": f"{i}+1=", "idx": i} for i in range(8)]
    dm = PromptDataModule(train=rows, val=rows, tokenizer=tok, batch_size=4, val_batch_size=4)
    module = PolicyOptimizationModule(model, tok, reward_fns=[half_none], experience={"num_generations": 2},
                                      generation={"max_new_tokens": 2})
    results = trainer(tmp_path, steps=1).validate(module, datamodule=dm, verbose=False)[0]
    assert results["val/accuracy"] == pytest.approx(0.5)  # samples 4..7 only; the all-None batch is left out
    assert results["val/reward"] == pytest.approx(0.5)
    again = trainer(tmp_path, steps=1).validate(module, datamodule=dm, verbose=False)[0]
    assert again["val/accuracy"] == pytest.approx(0.5)  # the sums were reset between validations


def _misaligned(model):
    """``model`` with every weight moved 16 bytes past a cache line, as ``from_pretrained`` leaves a safetensors
    file's weights (anonymous memory here, so the test does not depend on the file's layout)."""
    with torch.no_grad():
        for p in model.parameters():
            view = torch.empty(p.numel() + 16)[4:4 + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
    assert all(p.data_ptr() % 64 == 16 for p in model.parameters())
    return model


def test_weights_off_a_cache_line_are_copied_into_aligned_memory(tmp_path, tiny, arithmetic_rows):
    from polopt_lightning.accel.cpu.weights import align_weights

    model, tok = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    values = [p.detach().clone() for p in _misaligned(model).parameters()]
    assert align_weights(model) == len(values)
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert align_weights(model) == 0  # nothing left to copy

    # in the drop-in module: the policy and a given reference, when training on the CPU
    ref_values = [p.detach().clone() for p in _misaligned(reference).parameters()]
    params = list(_misaligned(policy).parameters())
    module, dm = make((policy, tok), arithmetic_rows, objective=GRPO(beta=0.1), ref_model=reference)
    trainer(tmp_path, steps=1).fit(module, datamodule=dm)
    after = list(module.policy.parameters())
    assert len(after) == len(params) and all(a is b for a, b in zip(after, params))  # same objects, moved
    assert all(p.data_ptr() % 64 == 0 for p in [*params, *module.ref_model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(ref_values, module.ref_model.parameters()))


DROP_IN = """
import lightning as L
from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rewards import ExactMatchReward

model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
train, _ = ArithmeticTask(digits=1, train_size=20, val_size=4).splits()
data = PromptDataModule(train=train, tokenizer=tok, batch_size=2)
module = PolicyOptimizationModule(model, tok, reward_fns=[ExactMatchReward()], experience={"num_generations": 2},
                                  update={"mini_batches": 2}, generation={"max_new_tokens": 3})
trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, datamodule=data)
print("global_step", trainer.global_step)
"""


def test_a_drop_in_run_stops_at_max_steps_and_prints_no_dependency_deprecation(tmp_path):
    """A plain script, as a drop-in user runs it (Python's default warning filters, not pytest's): 2 updates a
    rollout and max_steps=3 make 3 optimizer steps, and Lightning's pytree deprecation is not printed."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DROP_IN], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global_step 3" in proc.stdout
    assert "LeafSpec" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_the_hyperparameters_hold_each_concerns_settings(tiny, arithmetic_rows):
    """The saved hyperparameters hold the settings each concern was given (the optimizer's: the factory's keywords,
    optimizer.lr being the learning rate's one home), not defaults that were never used."""
    from functools import partial

    from polopt_lightning.optim import build_optimizer

    module, _ = make(tiny, arithmetic_rows, optimizer=partial(build_optimizer, name="adamw", lr=3e-4, betas=(0.9, 0.99)),
                     update={"mini_batches": 2}, reference={"dtype": "bfloat16"})
    assert "lr" not in module.hparams and module.hparams["optimizer"] == {"name": "adamw", "lr": 3e-4,
                                                                          "betas": [0.9, 0.99]}
    assert module.hparams["update"]["mini_batches"] == 2 and module.hparams["experience"]["num_generations"] == 4
    assert module.hparams["reference"] == {"dtype": "bfloat16", "quantization": "none", "track_kl": False,
                                           "kl_in_reward": 0.0, "reward_kl_estimator": "k1"}
    assert make(tiny, arithmetic_rows, optimizer={"lr": 2e-3})[0].hparams["optimizer"] == {"lr": 2e-3}


def test_the_keyword_arguments_of_earlier_releases_still_work_with_a_warning(tiny, arithmetic_rows):
    """num_generations=, mini_batches=, ref_dtype=, lr=, ... (before the concerns' configs): the same settings, and a
    FutureWarning naming each one's new place."""
    model, tok = tiny
    with pytest.warns(FutureWarning, match=r"mini_batches= is now update.mini_batches, ref_dtype= is now "
                                           r"reference.dtype, lr= is now optimizer.lr"):
        old = PolicyOptimizationModule(model, tok, reward_fns=[distinct_chars], update={"num_iterations": 2},
                                       mini_batches=2, ref_dtype="bfloat16", lr=2e-3, objective={"beta": 0.1,
                                                                                               "name": "grpo"})
    assert old.update_config.mini_batches == 2 and old.update_config.num_iterations == 2
    assert old.reference_config.dtype == "bfloat16" and old.optimizer_factory.keywords == {"lr": 2e-3}
    with pytest.raises(ValueError, match="lr= beside a factory for optimizer"), pytest.warns(FutureWarning):
        PolicyOptimizationModule(model, tok, reward_fns=[distinct_chars], optimizer=torch.optim.SGD, lr=1.0)
