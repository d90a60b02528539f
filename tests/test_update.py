"""The sampler correction (truncated importance sampling) by hand, and through the update: weights of 1 change
nothing; the metrics reach the log."""

import math

import pytest
import torch

from polopt_lightning.step.terms import SamplerCorrection, sampler_weights

from .helpers import make, trainer
from .helpers.step import term_advantages


def test_token_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, -2.0, -1.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights, metrics = sampler_weights(old, sampler, mask, "token_truncate", cap=2.0)
    e = math.e
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 1 / e], [1.0, 1.0, 1.0]]))  # e capped at 2
    raw = torch.tensor([1.0, e, 1 / e, 1.0])  # the 4 completion tokens' weights before the cap
    assert float(metrics["is_weight_mean"]) == pytest.approx(float(raw.mean()))
    assert float(metrics["is_weight_max"]) == pytest.approx(e)
    assert float(metrics["is_capped_frac"]) == pytest.approx(0.25)
    assert float(metrics["sampler_kl"]) == pytest.approx(float((raw - 1 - raw.log()).mean()))
    masked, _ = sampler_weights(old, sampler, mask, "token_mask", cap=2.0)
    assert torch.allclose(masked, torch.tensor([[1.0, 0.0, 1 / e], [1.0, 1.0, 1.0]]))


def test_sequence_weights_are_the_product_of_the_tokens():
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.1, 0.0]])
    sampler = torch.tensor([[0.0, -2.0, -2.5], [-0.7, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, metrics = sampler_weights(old, sampler, mask, "sequence_truncate", cap=3.0)
    assert weights.shape == (2, 1)
    assert torch.allclose(weights.squeeze(-1), torch.tensor([3.0, math.exp(0.2)]))  # e^1.5 = 4.48 capped at 3
    assert float(metrics["is_capped_frac"]) == pytest.approx(0.5)
    masked, _ = sampler_weights(old, sampler, mask, "sequence_mask", cap=3.0)
    assert torch.allclose(masked.squeeze(-1), torch.tensor([0.0, math.exp(0.2)]))


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_the_update_multiplies_each_advantage_by_its_sampler_weight(mode):
    """What the update trains on (its loss terms' advantages) with the correction on: each advantage times its token's (or
    sequence's) weight, by hand, for a sampler far from the trainer (weights of 2, 1/e, 3, e^0.2); off, unchanged."""
    from types import SimpleNamespace

    from polopt_lightning.objectives import GRPO
    from polopt_lightning.step.loop import TorchLoop
    from polopt_lightning.step.update import UpdateConfig, Updater

    e = math.e
    if mode == "token_truncate":
        old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
        sampler = torch.tensor([[0.0, -2.0, -1.0], [-0.5, 0.0, 0.0]])
        mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        want = torch.tensor([[2.0, 2.0 * 2.0, 2.0 / e], [-1.0, -1.0, -1.0]])  # weights 1, e capped at 2, 1/e; 1
    else:
        old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.1, 0.0]])
        sampler = torch.tensor([[0.0, -2.0, -2.5], [-0.7, -0.1, 0.0]])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        want = torch.tensor([2.0 * 3.0, -1.0 * math.exp(0.2)])  # e^1.5 capped at 3; e^0.2
    exp = SimpleNamespace(advantages=torch.tensor([2.0, -1.0]), sampling_logprobs=sampler)
    rows = torch.arange(2)
    for on in (True, False):
        config = UpdateConfig(is_correction=on, is_mode=mode, is_cap=3.0 if mode.startswith("sequence") else 2.0)
        advantages, metrics = term_advantages(Updater(None, GRPO(), None, None, config, TorchLoop()), exp, rows, old,
                                              mask)
        if on:
            torch.testing.assert_close(advantages, want)
            assert "is_weight_mean" in metrics
        else:
            assert torch.equal(advantages, exp.advantages) and metrics == {}


def test_the_shipped_learning_rate_schedule_warms_up_for_20_steps_then_decays_by_a_cosine(tiny, tmp_path):
    """The shipped settings (update=default, optimizer=adamw, trainer=cpu: cosine to 0 over trainer.max_steps, 20
    warm-up steps, peak optimizer.lr) through the module's own optimizer and scheduler, stepped as a fit steps them:
    the learning rate of each step, by hand."""
    import lightning as L
    from hydra.utils import instantiate

    from polopt_lightning import PolicyOptimizationModule

    from .helpers import compose_with

    cfg = compose_with([], tmp_path)
    shipped = instantiate(cfg["update"])  # cfg.update is the DictConfig method
    assert (shipped.lr_schedule, shipped.warmup_steps, shipped.min_lr_ratio) == ("cosine", 20, 0.0)
    peak, total = float(cfg.optimizer.lr), int(cfg.trainer.max_steps)
    assert (peak, total) == (4e-5, 3000)
    module = PolicyOptimizationModule(*tiny, reward_fns=[lambda prompts, completions, **kw: [0.0] * len(completions)],
                                      update=shipped, optimizer=instantiate(cfg.optimizer))
    module.trainer = L.Trainer(max_steps=total, accelerator="cpu", logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, enable_model_summary=False)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(total + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: moves nothing
        scheduler.step()
    decay = total - 20  # cosine over the steps after the warm-up
    by_hand = {0: peak / 20, 1: peak * 2 / 20, 9: peak / 2, 19: peak, 20: peak,
               20 + decay // 4: peak * (1 + math.cos(math.pi / 4)) / 2, 20 + decay // 2: peak / 2,
               20 + 3 * decay // 4: peak * (1 - math.cos(math.pi / 4)) / 2, total - 1: peak * (1 - math.cos(
                   math.pi / decay)) / 2, total: 0.0}
    assert {step: lrs[step] for step in by_hand} == pytest.approx(by_hand, rel=1e-9, abs=1e-15)
    assert all(a < b for a, b in zip(lrs[:19], lrs[1:20]))  # rising through the warm-up, to the peak at step 19
    assert all(a > b for a, b in zip(lrs[20:total], lrs[21:total + 1]))  # then falling every step


def test_with_the_trainers_own_sampler_the_correction_changes_nothing(tmp_path, tiny, arithmetic_rows):
    """The transformers backend samples with the trainer's numerics: weights of 1 within float32 rounding (its decoding
    steps and the training forward round differently), the same update as without the correction, and the metrics
    logged."""
    import copy

    results = []
    for on in (False, True):
        model = (copy.deepcopy(tiny[0]), tiny[1])
        module, dm = make(model, arithmetic_rows, update={"is_correction": on, "mini_batches": 1}, seed=0)
        t = trainer(tmp_path / str(on), steps=1, limit_val_batches=0)
        t.fit(module, datamodule=dm)
        results.append(([p.detach().clone() for p in module.policy.parameters()], t.logged_metrics))
    (plain, _), (corrected, logged) = results
    for a, b in zip(plain, corrected):
        torch.testing.assert_close(a, b)
    assert float(logged["train/is_weight_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(logged["train/is_weight_max"]) == pytest.approx(1.0, abs=1e-4)
    assert float(logged["train/sampler_kl"]) == pytest.approx(0.0, abs=1e-8)


def test_a_sampler_of_other_numerics_logs_its_gap_without_the_correction(tmp_path, tiny, arithmetic_rows):
    """With the correction off, an off-policy update whose old log-probs the trainer computes logs the sampler's
    distance from the trainer (what the correction would see): a bf16 sampling copy's is far above float32 rounding
    (the trainer's own numerics, old log-probs recomputed) and far below the cap. Where the sampler's log-probs are the
    old ones (the default), nothing."""
    import copy

    logged = {}
    for name, rollout, reuse in (("bf16", {"dtype": "bfloat16"}, True), ("fp32", {"dtype": None}, False),
                                 ("reused", {"dtype": None}, True)):
        model = (copy.deepcopy(tiny[0]), tiny[1])
        module, dm = make(model, arithmetic_rows, update={"mini_batches": 2, "reuse_sampling_logprobs": reuse},
                          rollout_engine=rollout, seed=0)
        t = trainer(tmp_path / name, steps=2, limit_val_batches=0)
        t.fit(module, datamodule=dm)
        assert not any(isinstance(term, SamplerCorrection) for term in module.updater.terms)  # the correction is off
        logged[name] = {k.removeprefix("train/"): float(v) for k, v in t.logged_metrics.items()}
    bf16, fp32 = logged["bf16"], logged["fp32"]
    assert "sampler_kl" not in logged["reused"] and "is_weight_max" not in logged["reused"]
    assert 0 <= fp32["sampler_kl"] < 1e-10 and abs(fp32["is_weight_max"] - 1) < 1e-4
    assert 1e3 * max(fp32["sampler_kl"], 1e-12) < bf16["sampler_kl"] < 1e-3
    assert 0.99 < bf16["is_weight_mean"] < 1.01 and 1.0001 < bf16["is_weight_max"] < 1.5
    assert bf16["is_capped_frac"] == fp32["is_capped_frac"] == 0.0


def test_token_weights_need_an_objective_that_takes_token_advantages(tmp_path, tiny, arithmetic_rows):
    """Refused when the module is built, before any rollout; by default (``is_mode=None``) GSPO takes a weight a
    sequence, GRPO one a token."""
    with pytest.raises(ValueError, match="update.is_mode=token_truncate: GSPO takes one advantage a sequence"):
        make(tiny, arithmetic_rows, objective="gspo",
             update={"is_correction": True, "is_mode": "token_truncate", "mini_batches": 1})
    module, dm = make(tiny, arithmetic_rows, objective="gspo", update={"is_correction": True, "mini_batches": 1})
    assert [(t.name, t.mode) for t in module.updater.terms[:1]] == [("sampler_correction", "sequence_truncate")]
    trainer(tmp_path, steps=1, limit_val_batches=0).fit(module, datamodule=dm)
    assert module.trainer.global_step == 1 and 0 < module.trainer.logged_metrics["train/is_weight_mean"] < 2
    grpo, _ = make(tiny, arithmetic_rows, objective="grpo", update={"is_correction": True})
    assert grpo.updater.terms[0].mode == "token_truncate"
