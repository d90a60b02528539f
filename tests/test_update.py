"""The sampler correction (truncated importance sampling) by hand, and through the update: weights of 1 change
nothing; the metrics reach the log."""

import math

import pytest
import torch

from polopt_lightning.update import sampler_weights

from .helpers import make, trainer


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


def test_token_weights_need_an_objective_that_takes_token_advantages(tmp_path, tiny, arithmetic_rows):
    module, dm = make(tiny, arithmetic_rows, objective="gspo", update={"is_correction": True, "mini_batches": 1})
    with pytest.raises(ValueError, match="update.is_mode=token_truncate: GSPO takes one advantage a sequence"):
        trainer(tmp_path, steps=1, limit_val_batches=0).fit(module, datamodule=dm)
