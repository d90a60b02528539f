"""The advantage estimators beyond GRPO (RLOO, REINFORCE++ with and without a group baseline) and the policy losses
beyond PPO's clip (CISPO, SAPO, the dual clip): each against a hand-written reference in values and gradients, and
against verl's or TRL's definition written out on the same tensors."""

import math

import pytest
import torch

from polopt_lightning.objectives import CISPO, GRPO, SAPO, build_objective
from polopt_lightning.step.advantages import (
    ADVANTAGE_ESTIMATORS,
    estimate_advantages,
    group_relative_advantages,
)
from polopt_lightning.step.experience import ExperienceConfig, ExperienceMaker

from .helpers import make, trainer

NAN = float("nan")


# --- advantage estimators ------------------------------------------------------------------------------------------
def test_rloo_measures_each_reward_against_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = estimate_advantages(rewards, 4, "rloo")  # its own scale: none
    expected = []
    for g in rewards.view(2, 4).tolist():
        expected += [r - (sum(g) - r) / 3 for r in g]  # r_i - mean of the other three, by hand
    torch.testing.assert_close(adv, torch.tensor(expected))
    # verl's compute_rloo_outcome_advantage: r * n/(n-1) - mean * n/(n-1)
    n, mean = 4, rewards.view(2, 4).mean(-1, keepdim=True)
    torch.testing.assert_close(adv.view(2, 4), rewards.view(2, 4) * n / (n - 1) - mean * n / (n - 1))
    # a missing reward: left out of its group (3 valid: each against the other two), advantage 0
    adv = estimate_advantages(torch.tensor([1.0, NAN, 0.0, 2.0]), 4, "rloo")
    torch.testing.assert_close(adv, torch.tensor([1 - 1.0, 0.0, 0 - 1.5, 2 - 0.5]))
    # group std on request: the same differences over the group's std
    torch.testing.assert_close(estimate_advantages(rewards, 4, "rloo", "group").view(2, 4),
                               torch.tensor(expected).view(2, 4) / rewards.view(2, 4).std(-1, keepdim=True))


def test_reinforce_pp_whitens_over_the_batch_and_keeps_equal_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    adv = estimate_advantages(rewards, 2, "reinforce_pp")  # its own scale: batch (whitened)
    torch.testing.assert_close(adv, (rewards - rewards.mean()) / rewards.std())
    assert adv[0] != 0 and adv[4] != 0  # groups of equal rewards still carry the batch-relative signal
    # with a group baseline: the group-mean differences, whitened; groups of equal rewards get 0
    base = estimate_advantages(rewards, 2, "reinforce_pp_baseline")
    x = rewards.view(3, 2) - rewards.view(3, 2).mean(-1, keepdim=True)
    torch.testing.assert_close(base, ((x - x.mean()) / x.std()).view(-1) * torch.tensor([0, 0, 1, 1, 0, 0.0]))
    # moments given (the whole batch over several processes) are used as they are
    torch.testing.assert_close(estimate_advantages(rewards, 2, "reinforce_pp", "batch", torch.tensor(0.5),
                                                   torch.tensor(2.0)), (rewards - 0.5) / 2.0)


def test_grpo_is_the_group_relative_estimator_unchanged():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.5, 1.5])
    for scale in ("group", "batch", "none"):
        assert torch.equal(estimate_advantages(rewards, 2, "grpo", scale), group_relative_advantages(rewards, 2, scale))
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "pass_at_k",
                                         "gae"}
    with pytest.raises(ValueError, match="experience.advantage_estimator must be one of"):
        estimate_advantages(rewards, 2, "ppo")
    with pytest.raises(ValueError, match=r"experience.advantage_estimator must be one of \['gae', 'grpo', 'pass_at_k'"):
        ExperienceConfig(advantage_estimator="trpo")


def test_a_group_of_one_is_refused_by_the_estimators_with_a_group_baseline():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    # a group of one has no other completion to measure against: these would give all-zero advantages, silently
    for estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match=r"experience.num_generations=1: the .* estimator .*\(experience.num_"
                                             r"generations >= 2\)"):
            estimate_advantages(rewards, 1, estimator)
        with pytest.raises(ValueError, match=r"experience.num_generations must be >= 2"):
            ExperienceConfig(num_generations=1, advantage_estimator=estimator)
    # REINFORCE++ without a baseline whitens over the batch: the group size does not enter
    torch.testing.assert_close(estimate_advantages(rewards, 1, "reinforce_pp"),
                               (rewards - rewards.mean()) / rewards.std())


def peer_batch(seed=0, groups=4, G=3, T=9):
    """Rewards with signal in every group, completions of 1..T tokens, their masks."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (groups * G,), generator=g).float()
    rewards.view(groups, G)[:, 0] += 5.0  # every group has unequal rewards
    lengths = torch.randint(1, T + 1, (groups * G,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return rewards, lengths, mask


def verl_masked_whiten(values, mask):
    """verl's masked_whiten: mean and unbiased variance over the masked entries, (x - mean) * rsqrt(var + 1e-8)."""
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = ((values - mean) ** 2 * mask).sum() / n * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def test_reinforce_pp_whitening_by_tokens_is_verls_on_the_same_tensors():
    rewards, lengths, mask = peer_batch()
    # verl's REINFORCE++: the outcome reward on each completion's last token, returns (gamma 1) summed from the end,
    # whitened over every token of the batch
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(lengths)), lengths - 1] = rewards
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    verl = verl_masked_whiten(returns, mask) * mask
    ours = estimate_advantages(rewards, 3, "reinforce_pp", token_counts=lengths)
    torch.testing.assert_close(ours[:, None] * mask, verl)
    # verl's REINFORCE++-baseline: each score minus its group's mean, on every token, whitened over the tokens
    centered = rewards.view(4, 3) - rewards.view(4, 3).mean(-1, keepdim=True)
    verl = verl_masked_whiten(centered.reshape(-1, 1) * mask, mask) * mask
    ours = estimate_advantages(rewards, 3, "reinforce_pp_baseline", token_counts=lengths)
    torch.testing.assert_close(ours[:, None] * mask, verl)
    # the default whitens each completion's value once: with lengths 1..9 the two forms differ
    per_completion = estimate_advantages(rewards, 3, "reinforce_pp_baseline")
    assert (per_completion - ours).abs().max() > 0.05
    x = centered.reshape(-1)
    torch.testing.assert_close(per_completion, (x - x.mean()) / x.std())
    # settings with nothing to weigh are refused
    with pytest.raises(ValueError, match="experience.whitening='token' weighs REINFORCE"):
        estimate_advantages(rewards, 3, "rloo", token_counts=lengths)
    with pytest.raises(ValueError, match="experience.whitening=token weighs REINFORCE"):
        ExperienceConfig(whitening="token")
    with pytest.raises(ValueError, match="advantage_scale=group does not whiten"):
        ExperienceConfig(advantage_estimator="reinforce_pp", advantage_scale="group", whitening="token")
    with pytest.raises(ValueError, match="experience.whitening must be one of"):
        ExperienceConfig(whitening="sequence")


def test_the_experience_whitens_by_the_completions_tokens():
    from polopt_lightning import PolicyOptimizationModule
    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)

    def varied(prompts, completions, **kw):
        return [float(sum(map(ord, c)) % 5) for c in completions]

    module = PolicyOptimizationModule(model, tok, reward_fns=[varied], generation={"max_new_tokens": 6}, seed=3,
                                      experience={"num_generations": 4, "advantage_estimator": "reinforce_pp_baseline",
                                                  "whitening": "token"})
    prompts = ["12+34=", "5+6=", "100+200+3="]
    enc = tok(prompts, padding=True, return_tensors="pt")
    exp, _ = module.make_experience({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask,
                                     "prompts": prompts, "columns": {}})
    rewards = module.experience.last_scored["rewards"][:, 0]
    tokens = exp.completion_mask.sum(-1)
    assert tokens.unique().numel() > 1  # lengths differ, or the check would not tell the forms apart
    torch.testing.assert_close(exp.advantages, estimate_advantages(rewards, 4, "reinforce_pp_baseline",
                                                                   token_counts=tokens))


def test_the_experience_uses_the_estimator_and_its_default_scale(tiny):
    model, tok = tiny
    from polopt_lightning.rewards import RewardComposer

    composer = RewardComposer([lambda prompts, completions, **kw: [1.0] * len(completions)])
    maker = ExperienceMaker(tok, composer, {"num_generations": 2, "advantage_estimator": "reinforce_pp"})
    assert maker.advantage_scale == "batch"
    maker = ExperienceMaker(tok, composer, {"num_generations": 2, "advantage_estimator": "rloo"})
    assert maker.advantage_scale == "none"
    # GRPO keeps the objective's own (Dr. GRPO: none)
    assert ExperienceMaker(tok, composer, {"num_generations": 2}, advantage_scale="none").advantage_scale == "none"


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_fit_with_each_estimator_moves_the_policy(estimator, tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, experience={"advantage_estimator": estimator})
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer(tmp_path, steps=2, limit_val_batches=0).fit(module, datamodule=dm)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


# --- policy losses -------------------------------------------------------------------------------------------------
def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


LP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]]
OLD = [[-1.3, -1.0, -0.5], [-0.1, -2.5, 0.0]]  # ratios exp(0.3), exp(-1), 1 ; exp(-0.2), exp(1.3)
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.5, -2.0]


def run(obj, lp=LP, old=OLD, adv=ADV, mask=MASK):
    lp = leaf(lp)
    out = obj(logprobs=lp, old_logprobs=torch.tensor(old, dtype=torch.float64),
              advantages=torch.tensor(adv, dtype=torch.float64), mask=torch.tensor(mask))
    out.loss.backward()
    return out, lp.grad


def by_hand(per_token):
    """Token-mean over the masked tokens of a per-token function of (lp, old, A), and its gradient by autograd on
    plain Python numbers per token."""
    total, grads, count = 0.0, [[0.0] * 3 for _ in LP], sum(map(sum, MASK))
    for i, (row, old_row, m_row) in enumerate(zip(LP, OLD, MASK)):
        for t, (lp, old, m) in enumerate(zip(row, old_row, m_row)):
            if not m:
                continue
            x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
            value = per_token(x, old, ADV[i]) / count
            value.backward()
            total += float(value)
            grads[i][t] = float(x.grad)
    return total, torch.tensor(grads, dtype=torch.float64)


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_detached_weight():
    cap = 1.0 + 0.2  # a low cap, so that the exp(0.3) and exp(1.3) tokens are capped
    out, grad = run(CISPO(clip_high=0.2))

    def token(lp, old, a):
        weight = min(math.exp(float(lp) - old), cap)  # a number: no gradient through the weight
        return -weight * a * lp

    loss, expected = by_hand(token)
    assert out.loss.item() == pytest.approx(loss)
    torch.testing.assert_close(grad, expected)
    assert all(g != 0 for row, m in zip(grad.tolist(), MASK) for g, k in zip(row, m) if k)  # no token loses it
    assert out.metrics["clip_frac_high"].item() == pytest.approx(2 / 5)
    # TRL's definition: -detach(min(r, epsilon_high)) * A * lp, token mean: the same with epsilon_high = 1 + clip_high
    lp, old, mask = leaf(LP), torch.tensor(OLD, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)
    r = torch.exp(lp - old)
    trl = (-torch.clamp(r, max=cap).detach() * torch.tensor(ADV, dtype=torch.float64)[:, None] * lp * mask).sum() / mask.sum()
    assert trl.item() == pytest.approx(out.loss.item())


def test_sapo_gates_softly_and_matches_grpo_on_policy():
    out, grad = run(SAPO(tau_pos=1.0, tau_neg=1.05, aggregation="token-mean"))  # by_hand's token mean

    def token(lp, old, a):
        tau = 1.0 if a > 0 else 1.05
        return -torch.sigmoid(tau * (torch.exp(lp - old) - 1)) * 4 / tau * a

    loss, expected = by_hand(token)
    assert out.loss.item() == pytest.approx(loss)
    torch.testing.assert_close(grad, expected)
    # on-policy (r = 1) the gate's slope is 1: GRPO's gradient exactly, under either aggregation
    _, sapo_grad = run(SAPO(), old=LP)
    _, grpo_grad = run(GRPO(), old=LP)
    torch.testing.assert_close(sapo_grad, grpo_grad)
    _, sapo_grad = run(SAPO(aggregation="token-mean"), old=LP)
    _, grpo_grad = run(GRPO(aggregation="token-mean"), old=LP)
    torch.testing.assert_close(sapo_grad, grpo_grad)
    with pytest.raises(ValueError, match="0 < tau_pos <= tau_neg"):
        SAPO(tau_pos=2.0, tau_neg=1.0)


def test_sapo_aggregates_as_the_paper_trl_and_verl_do():
    """The paper's objective is 1/G sum_i 1/|y_i| sum_t f(r_it) A_it; TRL 1.x reduces loss_type="sapo" with "grpo"
    (each sequence's token mean, then the mean over sequences) and verl's compute_policy_loss_sapo forces
    agg_loss(..., "seq-mean-token-mean"). SAPO's default is that; token-mean is an option."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    lengths = torch.tensor([1, 9, 3, 7, 2, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    lp0 = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp0 + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5  # ratios from e^-4 to e^4
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, 2.2, -0.1], dtype=torch.float64)

    def ours(objective):
        lp = lp0.clone().requires_grad_(True)
        poisoned = torch.where(mask.bool(), lp, torch.full_like(lp, float("nan")))  # padding never counts
        out = objective(logprobs=poisoned, old_logprobs=old, advantages=adv, mask=mask)
        out.loss.backward()
        return out.loss.detach(), lp.grad

    def per_token_loss(lp, tau_pos=1.0, tau_neg=1.05):  # both peers' gate: tau_pos where A > 0, tau_neg otherwise
        ratio = torch.exp(lp - old)
        a = adv[:, None]
        tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a

    def peer(reduce):
        lp = lp0.clone().requires_grad_(True)
        loss = reduce(per_token_loss(lp))
        loss.backward()
        return loss.detach(), lp.grad

    # TRL: ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    trl = peer(lambda x: ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean())
    # verl's agg_loss "seq-mean-token-mean": token sum / (count + 1e-8), over the sequences with a token
    verl = peer(lambda x: ((x * mask).sum(-1) / (mask.sum(-1) + 1e-8) * (mask.sum(-1) > 0)).sum()
                / (mask.sum(-1) > 0).sum())
    # the token mean over the batch (DAPO's; SAPO's default before issue 55)
    token_mean = peer(lambda x: (x * mask).sum() / mask.sum())
    default = ours(SAPO())
    assert SAPO().aggregation == build_objective("sapo").aggregation == "seq-mean-token-mean"
    for reference in (trl, verl):
        torch.testing.assert_close(default[0], reference[0])
        torch.testing.assert_close(default[1], reference[1])
    option = ours(SAPO(aggregation="token-mean"))
    torch.testing.assert_close(option[0], token_mean[0])
    torch.testing.assert_close(option[1], token_mean[1])
    assert abs(float(token_mean[0] - trl[0])) > 0.05  # the two reductions are far apart on these lengths


def test_dual_clip_bounds_negative_advantages_as_verl_and_trl_delta_do():
    dual = 2.5
    out, grad = run(GRPO(dual_clip=dual, aggregation="token-mean"), old=[[-1.3, -1.0, -0.5], [-2.0, -2.5, 0.0]])
    lp, mask = leaf(LP), torch.tensor(MASK, dtype=torch.float64)
    old = torch.tensor([[-1.3, -1.0, -0.5], [-2.0, -2.5, 0.0]], dtype=torch.float64)
    a = torch.tensor(ADV, dtype=torch.float64)[:, None]
    r = torch.exp(lp - old)
    # verl's compute_policy_loss with clip_ratio_c
    loss1, loss2 = -a * r, -a * r.clamp(0.8, 1.2)
    clipped = torch.maximum(loss1, loss2)
    verl = torch.where(a < 0, torch.minimum(-a * dual, clipped), clipped)
    # TRL's two-sided clip: the unclipped term's ratio capped at delta
    trl = -torch.minimum(torch.clamp(r, max=dual) * a, r.clamp(0.8, 1.2) * a)
    torch.testing.assert_close(verl, trl)
    reference = (verl * mask).sum() / mask.sum()
    reference.backward()
    assert out.loss.item() == pytest.approx(reference.item())
    torch.testing.assert_close(grad, lp.grad)
    assert out.metrics["clip_frac_dual"].item() == pytest.approx(2 / 5)  # r = e^1.7 and e^1.3 > 2.5 with A < 0
    with pytest.raises(ValueError, match=r"dual_clip must be > 1 \+ clip_high"):
        GRPO(dual_clip=1.1)


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_new_losses_by_name_train(name, tiny, arithmetic_rows, tmp_path):
    assert type(build_objective(name)).__name__ == name.upper()
    module, dm = make(tiny, arithmetic_rows, objective=name, update={"mini_batches": 2})
    before = [p.detach().clone() for p in module.policy.parameters()]
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert math.isfinite(float(t.logged_metrics["train/loss"])) and "train/clip_frac" in t.logged_metrics
