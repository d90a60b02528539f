"""Levers for real-scale models (0.5B, 152k-token vocabularies): the inverse-CDF sampler and clipping with the norm
already measured. Neither changes a loss or gradient (the clip: not a bit; the sampler draws from the same
distribution)."""

import copy

import pytest
import torch

from polopt_lightning.module import _grad_norm, _scale_gradients
from polopt_lightning.rollout.engine import INVERSE_CDF_VOCAB, sample_tokens


def test_inverse_cdf_sampler_draws_the_distribution_and_never_a_zero_probability_token():
    V = INVERSE_CDF_VOCAB + 5
    probs = torch.zeros(V)
    probs[[3, 1000, V - 1]] = torch.tensor([0.5, 0.3, 0.2])
    rows = probs.expand(40_000, V)
    tokens = sample_tokens(rows, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {3, 1000, V - 1}
    shares = torch.bincount(tokens, minlength=V)[[3, 1000, V - 1]].float() / len(tokens)
    assert torch.allclose(shares, torch.tensor([0.5, 0.3, 0.2]), atol=0.01)  # 40k draws: sd ~0.0025
    # every row its own distribution; the same generator state gives the same tokens
    peaked = torch.eye(V)[:4] * 0.9 + 0.1 / V
    assert sample_tokens(peaked / peaked.sum(-1, keepdim=True), torch.Generator().manual_seed(1)).shape == (4,)
    again = sample_tokens(rows[:100], torch.Generator().manual_seed(7))
    assert torch.equal(again, sample_tokens(rows[:100], torch.Generator().manual_seed(7)))


def test_small_vocabularies_keep_torch_multinomial():
    probs = torch.softmax(torch.randn(6, 100), -1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).squeeze(-1)
    assert torch.equal(sample_tokens(probs, torch.Generator().manual_seed(3)), expected)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_with_the_measured_norm_is_torchs_clip_to_the_bit(max_norm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    twin = copy.deepcopy(model)
    x = torch.randn(8, 50)
    for m in (model, twin):
        m(x).pow(2).sum().backward()
    norm = _grad_norm(model)
    _scale_gradients(model, max_norm, norm)
    expected = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
