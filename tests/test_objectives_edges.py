"""Edges of GRPO, CISPO, SAPO and GSPO that mutation testing (tests/mutation.sh, docs/testing.md) found unchecked: the optional
floor, the boundaries of the clip metrics, the arguments handed on to GRPO."""

import pytest
import torch

from polopt_lightning.objectives import CISPO, GRPO, GSPO, SAPO, kl_estimate
from polopt_lightning.objectives.grpo import aggregate


def test_cispo_defaults_and_the_arguments_it_hands_on():
    o = CISPO()
    assert (o.clip_low, o.clip_high, o.floor, o.aggregation) == (0.0, 4.0, False, "token-mean")
    o = CISPO(clip_low=0.2, clip_high=0.2, max_completion_length=7, advantage_scale="none", kl_estimator="k1")
    assert (o.clip_low, o.floor, o.max_completion_length, o.advantage_scale, o.kl_estimator) == (0.2, True, 7, "none",
                                                                                                  "k1")
    with pytest.raises(ValueError, match="clip_high must be > 0, got 0"):
        CISPO(clip_high=0)


def test_cispo_floor_cap_and_clip_metrics_at_their_bounds():
    # ratios below, at and above the floor 0.8 and the cap 1.2; the last token is masked out
    ratio = torch.tensor([[0.5, 0.8, 1.0, 1.2, 1.5, 0.1]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    per_token, m = CISPO(clip_low=0.2, clip_high=0.2).surrogate(ratio, torch.ones(1, 1), torch.ones(1, 6), mask)
    torch.testing.assert_close(per_token, -torch.tensor([[0.8, 0.8, 1.0, 1.2, 1.2, 0.8]]))
    assert set(m) == {"clip_frac_low", "clip_frac_high", "clip_frac"}
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)  # strictly below the floor, masked token aside
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)  # strictly above the cap
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    # no floor by default: the weight is not bounded below and nothing counts as floored
    per_token, m = CISPO(clip_high=0.2).surrogate(ratio, torch.ones(1, 1), torch.ones(1, 6), mask)
    torch.testing.assert_close(per_token, -torch.tensor([[0.5, 0.8, 1.0, 1.2, 1.2, 0.1]]))
    assert m["clip_frac_low"].item() == 0.0 and m["clip_frac"].item() == pytest.approx(1 / 5)


def test_sapo_arguments_and_its_temperatures_bounds():
    o = SAPO(tau_pos=1.0, tau_neg=1.0, max_completion_length=7, advantage_scale="none", kl_estimator="k1")  # equal: ok
    assert (o.max_completion_length, o.advantage_scale, o.kl_estimator) == (7, "none", "k1")
    with pytest.raises(ValueError, match="0 < tau_pos <= tau_neg"):
        SAPO(tau_pos=0.0, tau_neg=1.0)


def test_sapo_gate_slope_metrics_are_the_gates_derivative():
    o = SAPO(tau_pos=1.0, tau_neg=2.0)
    ratio = torch.tensor([[1.0, 3.0, 2.0, 0.5, 9.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0, -1.0, 1.0]])  # per token; a zero advantage takes tau_neg
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    _, m = o.surrogate(ratio, adv, torch.zeros(1, 5), mask)
    tau = torch.tensor([[1.0, 1.0, 2.0, 2.0, 1.0]])
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    (slope,) = torch.autograd.grad(gate.sum(), ratio)  # d gate / d ratio, token by token
    assert set(m) == {"clip_frac", "gate_slope_mean"}
    torch.testing.assert_close(m["gate_slope_mean"], (slope * mask).sum() / mask.sum())
    assert slope[0, :4].tolist() == pytest.approx([1.0, 0.41997, 0.41997, 0.78645], abs=1e-4)
    assert m["clip_frac"].item() == pytest.approx(2 / 4)  # slopes below 0.5: tokens 1 and 2 (token 4 is masked)


def test_gspo_sequence_clip_metrics_and_the_ratios_overflow_guard():
    lp = torch.zeros(4, 2)
    old = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [-1000.0, -1000.0]])  # s: e^-.5, e^.5, 1, huge
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(4, 2)
    out = GSPO().compute(lp, old, adv, mask, lp)
    m = out.metrics
    # sequence 0 clipped low, sequence 1 clipped high; a clipped sequence clips all its tokens
    assert m["clip_frac_low"].item() == pytest.approx(1 / 4) and m["clip_frac_high"].item() == pytest.approx(1 / 4)
    assert m["clip_frac"].item() == pytest.approx(2 / 4) and m["clip_frac_seq"].item() == pytest.approx(2 / 4)
    assert m["ratio_max"].item() == pytest.approx(torch.exp(torch.tensor(20.0)).item())  # clamped, not inf
    out = GSPO().compute(lp[3:], -old[3:], adv[3:], mask[3:], lp[3:])  # s = e^-1000: clamped at e^-20, not 0
    assert out.metrics["ratio_mean"].item() == pytest.approx(torch.exp(torch.tensor(-20.0)).item(), rel=1e-5)
    assert "clip_frac_seq" not in GSPO(variant="token").compute(lp, old, adv, mask, lp).metrics


def test_gspo_kl_uses_its_estimator():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    out = GSPO(beta=0.1, kl_estimator="k1").compute(lp, lp, torch.ones(1), torch.ones(1, 2), ref)
    torch.testing.assert_close(out.metrics["kl"], kl_estimate(lp, ref, "k1").mean())
    assert GSPO(advantage_scale="none").advantage_scale == "none"


def test_grpo_dual_clip_bound_and_clip_metrics_at_their_bounds():
    o = GRPO(dual_clip=3.0)  # clip 0.2 both sides
    ratio = torch.tensor([[5.0, 3.0, 2.0, 2.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, -2.0, 0.5, -1.0]])
    per_token, m = o.surrogate(ratio, adv, torch.zeros(1, 5), torch.ones(1, 5))
    # -A*r bounded at -3*A only above it, for A < 0: token 0 (5 > 3); token 1 sits on the bound, token 2 under it (4 < 6)
    torch.testing.assert_close(per_token, torch.tensor([[3.0, 3.0, 4.0, -0.6, 1.0]]))
    assert m["clip_frac_dual"].item() == pytest.approx(1 / 5)
    assert (m["clip_frac_low"].item(), m["clip_frac"].item()) == (0.0, pytest.approx(1 / 5))  # low + high
    GRPO(clip_low=0.2, dual_clip=1.3)  # just above 1 + clip_high
    with pytest.raises(ValueError, match=r"dual_clip must be > 1 \+ clip_high = 1.2, got 1.2"):
        GRPO(clip_low=0.2, dual_clip=1.2)
    assert GRPO(aggregation="seq-mean-token-sum-norm", max_completion_length=1).max_completion_length == 1
    with pytest.raises(ValueError, match=r"aggregation='seq-mean-token-sum-norm' needs max_completion_length > 0 "
                                         r"\(the constant normaliser\), got 0"):
        GRPO(aggregation="seq-mean-token-sum-norm", max_completion_length=0)


def test_grpo_compute_guards_the_ratio_takes_token_advantages_and_its_kl_estimator():
    lp = torch.zeros(1, 2)
    for shift, expected in ((1000.0, 20.0), (-1000.0, -20.0)):  # log-ratio clamped at +-20 both ways
        out = GRPO().compute(lp, lp - shift, torch.zeros(1), torch.ones(1, 2), lp)
        assert out.metrics["ratio_max"].item() == pytest.approx(torch.exp(torch.tensor(expected)).item(), rel=1e-5)
    adv = torch.tensor([[1.0, -1.0]])  # per token, on-policy: loss = -mean(A)... token by token
    out = GRPO(aggregation="token-mean").compute(lp, lp, adv, torch.tensor([[1.0, 1.0]]), lp)
    assert out.loss.item() == pytest.approx(0.0)
    out = GRPO(aggregation="token-mean").compute(lp, lp, adv, torch.tensor([[1.0, 0.0]]), lp)
    assert out.loss.item() == pytest.approx(-1.0)  # one token counted: divided by 1
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    out = GRPO(beta=0.1, kl_estimator="k1").compute(lp, lp, torch.ones(1), torch.ones(1, 2), ref)
    torch.testing.assert_close(out.metrics["kl"], kl_estimate(lp, ref, "k1").mean())
    assert aggregate(torch.ones(1, 2), torch.tensor([[True, False]]), "token-mean", None).item() == 1.0
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2).bool(), "sum", None)
