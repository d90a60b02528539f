"""Objectives against hand-computed cases and a naive element-by-element reference (loss and gradient)."""

import math
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from polopt_lightning.confschema import option
from polopt_lightning.objectives import (
    GRPO,
    GSPO,
    Objective,
    ObjectiveOutput,
    available_objectives,
    build_objective,
    register_objective,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
E = math.exp


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def run(obj, lp, old, adv, mask, ref=None):
    out = obj(logprobs=lp, old_logprobs=old, advantages=torch.tensor(adv, dtype=torch.float64),
              mask=torch.tensor(mask), ref_logprobs=ref)
    out.loss.backward()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Hand-computed cases. Two sequences, ragged: lengths 2 and 1, advantages +1 and -2, on-policy (ratio 1).
MASK = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    "aggregation,loss,grad",
    [
        # per token -A; seq means [-1, 2], mean 0.5; d/dlp = -A / |o_i| / B
        ("seq-mean-token-mean", 0.5, [[-0.25, -0.25, 0], [1.0, 0, 0]]),
        # (-1 -1 +2) / 3 tokens; d/dlp = -A / 3
        ("token-mean", 0.0, [[-1 / 3, -1 / 3, 0], [2 / 3, 0, 0]]),
        # token sums [-2, 2] / L=4, mean 0; d/dlp = -A / (L * B)
        ("seq-mean-token-sum-norm", 0.0, [[-1 / 8, -1 / 8, 0], [2 / 8, 0, 0]]),
    ],
)
def test_grpo_on_policy_aggregations(aggregation, loss, grad):
    lp = leaf([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    obj = GRPO(aggregation=aggregation, max_completion_length=4)
    out = run(obj, lp, lp.detach(), [1.0, -2.0], MASK)
    assert out.loss.item() == pytest.approx(loss)
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64))
    assert out.metrics["clip_frac"].item() == 0 and out.metrics["ratio_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "log_ratio,adv,loss,grad,low,high",
    [
        # r = e^.5 > 1.2, A > 0: clipped at the top, loss -1.2 A, no gradient
        (0.5, 1.0, -1.2, 0.0, 0, 1),
        # r = e^.5, A < 0: the unclipped term is the pessimistic one, gradient -A r
        (0.5, -1.0, E(0.5), E(0.5), 0, 0),
        # r = e^-.5 < 0.8, A < 0: clipped at the bottom, loss 0.8 |A|, no gradient
        (-0.5, -1.0, 0.8, 0.0, 1, 0),
        # r = e^-.5, A > 0: unclipped, loss -r, gradient -r
        (-0.5, 1.0, -E(-0.5), -E(-0.5), 0, 0),
        # inside the range: plain ratio
        (0.1, 2.0, -2 * E(0.1), -2 * E(0.1), 0, 0),
    ],
)
def test_grpo_clipping_bounds(log_ratio, adv, loss, grad, low, high):
    lp = leaf([[-1.0]])
    out = run(GRPO(clip_low=0.2), lp, lp.detach() - log_ratio, [adv], [[1]])
    assert out.loss.item() == pytest.approx(loss)
    assert lp.grad.item() == pytest.approx(grad)
    assert out.metrics["clip_frac_low"].item() == low and out.metrics["clip_frac_high"].item() == high
    assert out.metrics["ratio_max"].item() == pytest.approx(E(log_ratio))


def test_grpo_clip_high_is_asymmetric():
    lp = leaf([[-1.0]])
    # r = e^.25 = 1.284: inside clip-higher 0.28 (ceiling 1.28)? No: 1.284 > 1.28, clipped.
    out = run(GRPO(clip_low=0.2, clip_high=0.28), lp, lp.detach() - 0.25, [1.0], [[1]])
    assert out.loss.item() == pytest.approx(-1.28) and lp.grad.item() == 0.0
    lp = leaf([[-1.0]])
    # r = e^.24 = 1.271 < 1.28: not clipped, although it is above the symmetric 1.2.
    out = run(GRPO(clip_low=0.2, clip_high=0.28), lp, lp.detach() - 0.24, [1.0], [[1]])
    assert out.loss.item() == pytest.approx(-E(0.24)) and lp.grad.item() == pytest.approx(-E(0.24))


def test_grpo_kl_term():
    lp = leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    out = run(GRPO(beta=0.1), lp, lp.detach(), [0.0], [[1, 1]], ref)
    k3 = E(-0.5) + 0.5 - 1  # exp(ref-lp) - (ref-lp) - 1 at the first token; 0 at the second
    assert out.loss.item() == pytest.approx(0.1 * k3 / 2)
    assert out.metrics["kl"].item() == pytest.approx(k3 / 2)
    # d k3 / d lp = 1 - exp(ref - lp)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.1 * (1 - E(-0.5)) / 2, 0.0]], dtype=torch.float64))


def test_gspo_hand_case():
    lp = leaf([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    old = lp.detach() - torch.tensor([[0.1, 0.3, 0.0], [-0.4, 0.0, 0.0]], dtype=torch.float64)
    out = run(GSPO(clip_low=0.5, clip_high=0.5), lp, old, [1.0, 1.0], MASK)
    s1, s2 = E(0.2), E(-0.4)  # length-normalised: (0.1 + 0.3) / 2 and -0.4 / 1
    assert out.loss.item() == pytest.approx(-(s1 + s2) / 2)
    # d s_i / d lp_t = s_i / |y_i|
    torch.testing.assert_close(lp.grad, torch.tensor([[-s1 / 4, -s1 / 4, 0], [-s2 / 2, 0, 0]], dtype=torch.float64))
    assert out.metrics["ratio_max"].item() == pytest.approx(s1)
    assert out.metrics["ratio_mean"].item() == pytest.approx((s1 + s2) / 2)


@pytest.mark.parametrize("variant", ["sequence", "token"])
def test_gspo_paper_clip_range(variant):
    # s = e^.2 is far outside 1 + 4e-4: clipped for A > 0 (no gradient), unclipped for A < 0.
    lp = leaf([[-1.0, -2.0], [-1.0, -2.0]])
    old = lp.detach() - 0.2
    out = run(GSPO(variant=variant), lp, old, [1.0, -1.0], [[1, 1], [1, 1]])
    assert out.loss.item() == pytest.approx((-(1 + 4e-4) + E(0.2)) / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[0, 0], [E(0.2) / 4] * 2], dtype=torch.float64))
    assert out.metrics["clip_frac_high"].item() == pytest.approx(0.5)
    assert out.metrics["clip_frac_low"].item() == 0
    # below the floor with A < 0: clipped at the bottom
    lp = leaf([[-1.0, -2.0]])
    out = run(GSPO(variant=variant), lp, lp.detach() + 0.2, [-1.0], [[1, 1]])
    assert out.loss.item() == pytest.approx(1 - 3e-4) and lp.grad.abs().sum() == 0
    assert out.metrics["clip_frac_low"].item() == 1


def test_gspo_kl_is_sequence_mean_of_token_means():
    lp = leaf([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    out = run(GSPO(beta=0.5), lp, lp.detach(), [0.0, 0.0], MASK, ref)
    k3 = lambda d: E(d) - d - 1  # noqa: E731
    kl = ((k3(-0.5) + 0) / 2 + k3(0.5)) / 2
    assert out.metrics["kl"].item() == pytest.approx(kl)
    assert out.loss.item() == pytest.approx(0.5 * kl)


# ---------------------------------------------------------------------------------------------------------------------
# A naive element-by-element reference, straight from the formulas in DESIGN.md, for random ragged batches.

def naive_grpo(lp, old, adv, mask, ref, clip_low, clip_high, beta, aggregation, L):
    per_seq, tokens, total = [], 0, 0.0
    for i in range(lp.shape[0]):
        terms = []
        for t in range(lp.shape[1]):
            if not mask[i][t]:
                continue
            r = torch.exp(lp[i, t] - old[i, t])
            x = -torch.minimum(r * adv[i], torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv[i])
            if beta:
                d = ref[i, t] - lp[i, t]
                x = x + beta * (torch.exp(d) - d - 1)
            terms.append(x)
        if not terms:
            continue
        s = sum(terms)
        tokens += len(terms)
        total = total + s
        per_seq.append(s / len(terms) if aggregation == "seq-mean-token-mean" else s / L)
    if aggregation == "token-mean":
        return total / tokens
    return sum(per_seq) / len(per_seq)


def naive_gspo(lp, old, adv, mask, ref, clip_low, clip_high, beta):
    per_seq, kls = [], []
    for i in range(lp.shape[0]):
        idx = [t for t in range(lp.shape[1]) if mask[i][t]]
        if not idx:
            continue
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / len(idx))
        per_seq.append(-torch.minimum(s * adv[i], torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv[i]))
        if beta:
            kls.append(sum(torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1 for t in idx) / len(idx))
    loss = sum(per_seq) / len(per_seq)
    return loss + beta * sum(kls) / len(kls) if beta else loss


def random_batch(seed, B=5, T=7, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0  # an empty sequence contributes nothing
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("clip", [(0.2, None), (0.2, 0.28)])
def test_grpo_matches_naive_reference(aggregation, beta, on_policy, clip):
    # a seed of the parameters that every process draws alike (hash() of a str changes with PYTHONHASHSEED)
    lp0, old, ref, adv, mask = random_batch(seed=zlib.crc32(repr((aggregation, beta, on_policy, clip)).encode()) % 1000)
    old = lp0.clone() if on_policy else old
    obj = GRPO(clip_low=clip[0], clip_high=clip[1], beta=beta, aggregation=aggregation, max_completion_length=7)
    lp = lp0.clone().requires_grad_()
    out = obj(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref if beta else None)
    out.loss.backward()
    lp_ref = lp0.clone().requires_grad_()
    expected = naive_grpo(lp_ref, old, adv, mask.tolist(), ref, clip[0], clip[1] or clip[0], beta, aggregation, 7)
    expected.backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(lp.grad, lp_ref.grad)
    assert ("kl" in out.metrics) == (beta > 0)


@pytest.mark.parametrize("variant", ["sequence", "token"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.05, 0.1)])
def test_gspo_matches_naive_reference(variant, beta, on_policy, clip):
    lp0, old, ref, adv, mask = random_batch(seed=7 + int(on_policy), spread=0.05)
    old = lp0.clone() if on_policy else old
    lp = lp0.clone().requires_grad_()
    out = GSPO(clip_low=clip[0], clip_high=clip[1], beta=beta, variant=variant)(
        logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref if beta else None
    )
    out.loss.backward()
    lp_ref = lp0.clone().requires_grad_()
    expected = naive_gspo(lp_ref, old, adv, mask.tolist(), ref, clip[0], clip[1], beta)
    expected.backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(lp.grad, lp_ref.grad)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_token_equals_sequence_for_sequence_advantages(seed):
    lp0, old, ref, adv, mask = random_batch(seed, spread=0.01)
    grads, losses = [], []
    for variant in ("sequence", "token"):
        lp = lp0.clone().requires_grad_()
        out = GSPO(clip_low=0.01, clip_high=0.012, beta=0.02, variant=variant)(
            logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref
        )
        out.loss.backward()
        losses.append(out.loss)
        grads.append(lp.grad)
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])
    # per-token advantages equal to the broadcast sequence advantage give the same again
    lp = lp0.clone().requires_grad_()
    GSPO(clip_low=0.01, clip_high=0.012, beta=0.02, variant="token")(
        logprobs=lp, old_logprobs=old, advantages=adv[:, None].expand_as(lp0), mask=mask, ref_logprobs=ref
    ).loss.backward()
    torch.testing.assert_close(lp.grad, grads[0])


def test_gspo_sequence_variant_rejects_token_advantages():
    lp0, old, _, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="advantages must be"):
        GSPO()(logprobs=lp0, old_logprobs=old, advantages=adv[:, None].expand_as(lp0), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# Numerics

@pytest.mark.parametrize("obj", [GRPO(beta=0.1), GRPO(aggregation="token-mean"), GSPO(beta=0.1), GSPO(variant="token")])
def test_masked_positions_hold_inf_and_nan(obj):
    lp0, old, ref, adv, mask = random_batch(3)
    clean = lp0.clone().requires_grad_()
    out_clean = obj(logprobs=clean, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref)
    out_clean.loss.backward()
    poisoned = lp0.clone()
    poisoned[~mask] = float("-inf")
    poisoned[~mask & (torch.arange(7) % 2 == 0)] = float("nan")
    old_p, ref_p = old.clone(), ref.clone()
    old_p[~mask], ref_p[~mask] = float("nan"), float("inf")
    poisoned.requires_grad_()
    out = obj(logprobs=poisoned, old_logprobs=old_p, advantages=adv, mask=mask, ref_logprobs=ref_p)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_clean.loss)
    assert torch.isfinite(poisoned.grad).all()
    assert (poisoned.grad[~mask] == 0).all()
    torch.testing.assert_close(poisoned.grad, clean.grad)
    for v in out.metrics.values():
        assert torch.isfinite(v)


@pytest.mark.parametrize("obj", [GRPO(), GRPO(aggregation="token-mean"), GSPO(), GSPO(variant="token")])
def test_empty_sequences_contribute_nothing(obj):
    lp0, old, _, adv, mask = random_batch(4)
    full = obj(logprobs=lp0, old_logprobs=old, advantages=adv, mask=mask)
    keep = mask.any(-1)
    only = obj(logprobs=lp0[keep], old_logprobs=old[keep], advantages=adv[keep], mask=mask[keep])
    torch.testing.assert_close(full.loss, only.loss)
    # all sequences empty: zero loss, zero gradient, no NaN
    lp = lp0.clone().requires_grad_()
    out = obj(logprobs=lp, old_logprobs=old, advantages=adv, mask=torch.zeros_like(mask))
    out.loss.backward()
    assert out.loss.item() == 0 and (lp.grad == 0).all()


@pytest.mark.parametrize("obj", [GRPO(), GSPO(), GRPO(beta=0.1)])
def test_log_ratio_overflow_is_guarded(obj):
    lp = leaf([[-1.0, -2.0]])
    out = obj(logprobs=lp, old_logprobs=lp.detach() - 500.0, advantages=torch.tensor([-1.0], dtype=torch.float64),
              mask=torch.ones(1, 2, dtype=torch.bool), ref_logprobs=lp.detach() + 500.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()


# ---------------------------------------------------------------------------------------------------------------------
# Validation, registry, configs

@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: GRPO(aggregation="seq-mean"), "aggregation must be one of"),
        (lambda: GRPO(aggregation="seq-mean-token-sum-norm"), "max_completion_length"),
        (lambda: GRPO(clip_low=1.5), "clip_low"),
        (lambda: GRPO(beta=-1), "beta"),
        (lambda: GSPO(variant="tokens"), "variant"),
        (lambda: GRPO(advantage_scale="std"), "advantage_scale"),
    ],
)
def test_bad_arguments_name_the_culprit(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_beta_needs_reference_and_shapes_are_checked():
    lp0, old, _, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        GRPO(beta=0.1)(logprobs=lp0, old_logprobs=old, advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="old_logprobs"):
        GRPO()(logprobs=lp0, old_logprobs=old[:, :3], advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="advantages"):
        GRPO()(logprobs=lp0, old_logprobs=old, advantages=adv[:2], mask=mask)
    # ref_logprobs is ignored (may be None) without beta
    GRPO()(logprobs=lp0, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=None)


def test_registry_and_presets():
    assert {"grpo", "gspo", "dapo", "dr_grpo"} <= set(available_objectives())
    dapo = build_objective("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token-mean")
    dr = build_objective("dr_grpo", max_completion_length=64)
    assert (dr.aggregation, dr.max_completion_length, dr.advantage_scale) == ("seq-mean-token-sum-norm", 64, "none")
    with pytest.raises(KeyError, match="known objectives: .*dapo.*grpo.*ppo"):
        build_objective("trpo")
    ppo = build_objective("ppo")
    assert (ppo.aggregation, ppo.clip_low, ppo.advantage_estimator) == ("token-mean", 0.2, "gae")


@pytest.mark.parametrize(
    "key,cls,attrs",
    [
        ("grpo", GRPO, {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "seq-mean-token-mean"}),
        ("dapo", GRPO, {"clip_high": 0.28, "aggregation": "token-mean"}),
        ("dr_grpo", GRPO, {"aggregation": "seq-mean-token-sum-norm", "advantage_scale": "none"}),
        ("gspo", GSPO, {"clip_low": 3e-4, "clip_high": 4e-4, "variant": "sequence"}),
        ("gspo_token", GSPO, {"variant": "token"}),
    ],
)
def test_shipped_objective_configs(key, cls, attrs):
    obj = instantiate(option("objective", key))
    assert type(obj) is cls
    for name, value in attrs.items():
        assert getattr(obj, name) == pytest.approx(value) if isinstance(value, float) else getattr(obj, name) == value


def test_new_objective_is_one_class_plus_one_config(tmp_path):
    @register_objective("test_only_scaled_pg")
    class ScaledPolicyGradient(Objective):
        """Vanilla REINFORCE-style loss, scaled: enough to prove the extension point."""

        def __init__(self, scale: float = 1.0) -> None:
            self.scale = scale

        def compute(self, logprobs, old_logprobs, advantages, mask, ref_logprobs):
            per_token = -advantages[:, None] * logprobs
            loss = self.scale * (per_token * mask).sum() / mask.sum()
            return ObjectiveOutput(loss=loss, metrics={"clip_frac": loss.new_zeros(())})

    (tmp_path / "objective").mkdir()
    (tmp_path / "objective" / "scaled_pg.yaml").write_text(
        "_target_: polopt_lightning.objectives.build_objective\nname: test_only_scaled_pg\nscale: 2.0\n"
    )
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(config_name="objective/scaled_pg")
    obj = instantiate(cfg.objective)
    assert isinstance(obj, ScaledPolicyGradient) and obj.scale == 2.0
    lp = leaf([[-1.0, -3.0]])
    out = obj(logprobs=lp, old_logprobs=lp.detach(), advantages=torch.tensor([1.0]), mask=torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(4.0)
