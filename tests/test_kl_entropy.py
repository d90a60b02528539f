"""The KL estimators (k1, k2, k3, k3+) as a loss term and as a reward penalty, BNPO, the entropy bonus (fixed and
adaptive) and the top-entropy token mask: each against a hand-written reference in values and gradients, against
verl's or TRL's definition written out on the same tensors, and exact under micro-batching."""

import copy
import math

import pytest
import torch

from polopt_lightning import PolicyOptimizationModule
from polopt_lightning.models import Adapter, apply_adapter, build_tiny_model
from polopt_lightning.objectives import GRPO, KL_ESTIMATORS, build_objective, kl_estimate
from polopt_lightning.step.advantages import estimate_advantages
from polopt_lightning.step.entropy import EntropyControl
from polopt_lightning.step.logprobs import completion_logprobs, selective_log_softmax
from polopt_lightning.step.update import UpdateConfig

from .helpers import make, trainer
from .helpers.step import tiny_rollout, varied

LP = [[-1.2, -0.4, -2.0], [-0.3, -1.7, -0.9]]
REF = [[-1.0, -0.9, -1.1], [-0.3, -2.5, -0.2]]
MASK = [[1, 1, 1], [1, 1, 0]]


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


# --- KL estimators ---------------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand_and_as_verl_writes_them():
    assert KL_ESTIMATORS == ("k1", "k2", "k3", "k3+")
    ref = torch.tensor(REF, dtype=torch.float64)
    for name in KL_ESTIMATORS:
        lp = leaf(LP)
        kl = kl_estimate(lp, ref, name)
        kl.sum().backward()
        for i in range(2):
            for j in range(3):
                x, r = LP[i][j], REF[i][j]
                k1, k2, k3 = x - r, 0.5 * (x - r) ** 2, math.exp(r - x) - (r - x) - 1
                value = {"k1": k1, "k2": k2, "k3": k3, "k3+": k3}[name]
                # d/dx: k1 -> 1, k2 -> x - r, k3 -> 1 - exp(r - x); k3+ takes k2's gradient (straight-through)
                grad = {"k1": 1.0, "k2": x - r, "k3": 1 - math.exp(r - x), "k3+": x - r}[name]
                assert kl[i, j].item() == pytest.approx(value) and lp.grad[i, j].item() == pytest.approx(grad)
    # verl's kl_penalty on the same tensors ("kl", "mse", "low_var_kl" and its "+" straight-through form)
    lp = leaf(LP)
    delta = (ref - lp).clamp(-20, 20)
    verl_k3 = (delta.exp() - delta - 1).clamp(-10, 10)  # verl clamps the value at 10 too: none is that large here
    verl_k2 = 0.5 * (lp - ref).square()
    verl_k3_plus = verl_k2 - verl_k2.detach() + verl_k3.detach()
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), verl_k3)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3+"), verl_k3_plus)
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), lp - ref)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_estimate(lp, ref, "k4")
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        GRPO(kl_estimator="abs")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3+"])
def test_objectives_take_the_kl_estimator_in_their_beta_term(estimator):
    beta, adv = 0.3, torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask, ref = torch.tensor(MASK), torch.tensor(REF, dtype=torch.float64)
    for name in ("grpo", "dapo", "cispo", "sapo", "gspo_token"):
        kwargs = {"variant": "token"} if name == "gspo_token" else {}
        objective = build_objective("gspo" if name == "gspo_token" else name, beta=beta, kl_estimator=estimator,
                                    **kwargs)
        lp = leaf(LP)
        out = objective(logprobs=lp, old_logprobs=lp.detach(), advantages=adv, mask=mask, ref_logprobs=ref)
        out.loss.backward()
        # the same objective without the KL term, plus beta x the estimator under the objective's aggregation
        lp2 = leaf(LP)
        plain = build_objective("gspo" if name == "gspo_token" else name, **kwargs)
        base = plain(logprobs=lp2, old_logprobs=lp2.detach(), advantages=adv, mask=mask).loss
        kl = kl_estimate(lp2, ref, estimator) * mask
        per_seq = kl.sum(-1) / mask.sum(-1)
        token_mean = getattr(objective, "aggregation", "seq-mean-token-mean") == "token-mean"
        reference = base + beta * (kl.sum() / mask.sum() if token_mean else per_seq.mean())
        reference.backward()
        assert out.loss.item() == pytest.approx(reference.item()), name
        torch.testing.assert_close(lp.grad, lp2.grad, msg=name)
        assert out.metrics["kl"].item() == pytest.approx((kl.sum() / mask.sum() if token_mean
                                                          else per_seq.mean()).item())


def test_bnpo_is_trls_bnpo_with_the_mini_batch_as_its_batch():
    lp, old = leaf(LP), torch.tensor([[-1.0, -0.6, -1.5], [-0.2, -1.2, 0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([0.7, -1.1], dtype=torch.float64), torch.tensor(MASK)
    out = build_objective("bnpo")(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask)
    out.loss.backward()
    # TRL: coef_1 = exp(lp - old), coef_2 = clamp(coef_1, 1 - 0.2, 1 + 0.2), loss over the local batch's tokens
    lp2 = leaf(LP)
    coef_1 = torch.exp(lp2 - old)
    coef_2 = coef_1.clamp(0.8, 1.2)
    per_token = -torch.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    trl = (per_token * mask).sum() / mask.sum()
    trl.backward()
    assert out.loss.item() == pytest.approx(trl.item())
    torch.testing.assert_close(lp.grad, lp2.grad)
    # the normaliser is the token count: pieces of the mini-batch add up to it (micro-batching changes nothing)
    objective = build_objective("bnpo")
    parts = [objective(logprobs=leaf([LP[i]]), old_logprobs=old[i:i + 1], advantages=adv[i:i + 1],
                       mask=mask[i:i + 1]).loss * objective.normaliser(mask[i:i + 1]) for i in range(2)]
    assert (sum(parts) / objective.normaliser(mask)).item() == pytest.approx(trl.item())


# --- entropy with its gradient -----------------------------------------------------------------------------------------
def test_entropy_comes_with_its_gradient_and_leaves_the_log_probs_bits_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11, requires_grad=True)
    index = torch.randint(0, 11, (5, 7))
    w1, w2 = torch.randn(5, 7), torch.randn(5, 7)
    lp, h = selective_log_softmax(logits, index, temperature=0.7, chunk_rows=3, with_entropy=True)
    ((w1 * lp).sum() + (w2 * h).sum()).backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits / 0.7, dim=-1)
    ref_lp = logp.gather(-1, index[..., None]).squeeze(-1)
    ref_h = -(logp.exp() * logp).sum(-1)
    ((w1 * ref_lp).sum() + (w2 * ref_h).sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    # with the entropy unused, the log-probs' gradient is the one without entropies, to the bit
    a = logits.detach().clone().requires_grad_(True)
    b = logits.detach().clone().requires_grad_(True)
    (w1 * selective_log_softmax(a, index, 0.7, 3, with_entropy=True)[0]).sum().backward()
    (w1 * selective_log_softmax(b, index, 0.7, 3)[0]).sum().backward()
    assert torch.equal(a.grad, b.grad)


# --- the entropy controls ------------------------------------------------------------------------------------------
def test_top_entropy_mask_is_trls_quantile_mask():
    entropies = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.5, 0.2, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    for rho in (0.2, 0.5, 1.0, 0.0):
        got = EntropyControl(top_quantile=rho).top_mask(entropies, mask)
        # TRL's get_high_entropy_mask(entropies, mask, 1 - rho) on one process
        threshold = torch.quantile(entropies[mask.bool()], 1 - rho)
        trl = (entropies * mask >= threshold) & mask.bool()
        assert torch.equal(got, trl), rho
    kept = EntropyControl(top_quantile=0.5).top_mask(entropies, mask)
    assert kept.sum() == 4 and not kept[0, 3]  # the masked 9.0 is neither counted nor kept
    assert EntropyControl(top_quantile=0.0).top_mask(entropies, mask).sum() == 1  # only the highest


def test_adaptive_entropy_coefficient_follows_trls_rule_and_survives_a_checkpoint():
    control = EntropyControl(coef=0.01, target=0.5, delta=0.005, coef_min=0.0, coef_max=0.02)
    assert control.bonus and control.applied() == 0.0  # no measurement yet: TRL's last entropy starts at inf
    applied = []
    for entropy in (0.4, 0.3, 0.6, 0.7, 0.7, 0.7, 0.45):
        control.observe(entropy)
        applied.append((round(control.coef, 6), control.applied()))
    # up by delta at or below the target (capped at coef_max), down above it (floored at coef_min); applied only
    # after a step at or below the target
    assert applied == [(0.015, 0.015), (0.02, 0.02), (0.015, 0.0), (0.01, 0.0), (0.005, 0.0), (0.0, 0.0),
                       (0.005, 0.005)]
    restored = EntropyControl(coef=0.01, target=0.5)
    restored.load_state_dict(control.state_dict())
    assert restored.coef == control.coef and restored.last == control.last
    fixed = EntropyControl(coef=0.02)
    fixed.observe(5.0)
    assert fixed.applied() == 0.02 and not EntropyControl().bonus
    with pytest.raises(ValueError, match="update.entropy_coef_min=0.5 must be <= update.entropy_coef_max=0.1"):
        UpdateConfig(entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="update.top_entropy_quantile"):
        UpdateConfig(top_entropy_quantile=1.5)


# --- in the update: exact against a hand-written loss, and under micro-batching ----------------------------------------
def experience(update, objective="grpo", adapter=None, **kwargs):
    return tiny_rollout(objective, None if adapter is None else (lambda model: apply_adapter(model, adapter)),
                        update={"mini_batches": 1, **update}, **kwargs)


def gradients(module, exp, rows, **settings):
    module = copy.deepcopy(module)
    for key, value in settings.items():
        setattr(module.update_config, key, value)
    metrics = module.accumulate_gradients(exp, rows)
    return metrics, {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


def hand_gradients(module, exp, per_token_weight=None, bonus=0.0, verl_entropy=False):
    """TRL's loss written out on the module's own log-probs: GRPO's per-token loss (on-policy: the ratio is 1 with
    gradient), times the top-entropy mask, each sequence's token mean, the mean over sequences, minus ``bonus`` x the
    mean entropy over the tokens the mask keeps. ``verl_entropy``: the bonus as verl's actor writes it, the entropy
    through ``agg_loss`` with the loss's ``loss_agg_mode`` (here ``seq-mean-token-mean``: each sequence's token sum
    over its count + 1e-8, summed over the sequences with a token, over their number)."""
    module = copy.deepcopy(module)
    mask = exp.completion_mask
    lp, h = completion_logprobs(module.policy, exp.prompt_ids, exp.prompt_mask, exp.completion_ids, mask,
                                module.scorer.temperature, with_entropy=True)
    coef_1 = torch.exp(lp - lp.detach())
    adv = exp.advantages[:, None]
    per_token = -torch.minimum(coef_1 * adv, coef_1.clamp(0.8, 1.2) * adv)
    keep = mask.float() if per_token_weight is None else per_token_weight.float()
    per_token = per_token * keep
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if verl_entropy:
        counts = keep.sum(-1)
        per_seq = (h * keep).sum(-1) / (counts + 1e-8)
        has_tokens = (counts > 0).float()
        loss = loss - bonus * (per_seq * has_tokens).sum() / has_tokens.sum()
    else:
        loss = loss - bonus * (h * keep).sum() / keep.sum().clamp(min=1)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, h.detach()


def assert_same(got, expected):
    assert got.keys() == expected.keys() and got
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)


def test_entropy_bonus_is_the_loss_minus_coef_times_the_mean_entropy_under_any_micro_batching():
    module, exp, _ = experience({"entropy_coef": 0.3})
    rows = torch.arange(exp.num_rows)
    metrics, whole = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=None)
    expected, h = hand_gradients(module, exp, bonus=0.3)
    assert_same(whole, expected)
    assert metrics["entropy_coef"].item() == pytest.approx(0.3)
    _, split = gradients(module, exp, rows, share_prompt=True, micro_batch_tokens=30)
    probe = copy.deepcopy(module)
    probe.update_config.micro_batch_tokens = 30
    assert len(probe.updater.micro_batches(exp, rows)) > 1
    assert_same(split, expected)
    # and it is a real term: without it the gradient differs
    plain, _ = hand_gradients(module, exp)
    assert any(not torch.allclose(plain[n], expected[n], atol=1e-6) for n in plain)


def test_entropy_aggregation_objective_is_verls_entropy_term_under_any_micro_batching():
    """update.entropy_aggregation="objective": the bonus's entropy aggregated as the objective aggregates its loss,
    verl's ``agg_loss(entropy, response_mask, loss_agg_mode)``; GRPO's seq-mean-token-mean here."""
    module, exp, _ = experience({"entropy_coef": 0.3, "entropy_aggregation": "objective"})
    rows = torch.arange(exp.num_rows)
    metrics, whole = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=None)
    expected, h = hand_gradients(module, exp, bonus=0.3, verl_entropy=True)
    assert_same(whole, expected)
    _, split = gradients(module, exp, rows, share_prompt=True, micro_batch_tokens=30)
    assert_same(split, expected)
    # the completions' lengths differ, so the two forms differ: the default stays the token mean
    token_mean, _ = hand_gradients(module, exp, bonus=0.3)
    assert any(not torch.allclose(token_mean[n], expected[n], atol=1e-6) for n in token_mean)
    _, default = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=None,
                           entropy_aggregation="token-mean")
    assert_same(default, token_mean)
    # train/entropy is the token mean either way
    mask = exp.completion_mask.bool()
    assert metrics["entropy"].item() == pytest.approx(h[mask].mean().item(), rel=1e-5)
    # an objective whose loss is one token mean (DAPO, verl's default token-mean): the two forms are the same
    module, exp, _ = experience({"entropy_coef": 0.3, "entropy_aggregation": "objective"}, objective="dapo")
    _, by_objective = gradients(module, exp, torch.arange(exp.num_rows), micro_batch_tokens=30)
    _, by_token = gradients(module, exp, torch.arange(exp.num_rows), micro_batch_tokens=30,
                            entropy_aggregation="token-mean")
    assert_same(by_objective, by_token)
    with pytest.raises(ValueError, match="update.entropy_aggregation must be one of"):
        UpdateConfig(entropy_aggregation="seq-mean")


def test_top_entropy_mask_trains_only_the_highest_entropy_tokens_of_the_mini_batch():
    module, exp, _ = experience({"top_entropy_quantile": 0.3, "entropy_coef": 0.1})
    rows = torch.arange(exp.num_rows)
    _, h = hand_gradients(module, exp)
    exp.entropies = h  # what the update's first pass gives (the sampling policy's entropies)
    mask = exp.completion_mask.bool()
    keep = mask & (h >= torch.quantile(h[mask], 0.7))
    metrics, whole = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=None)
    expected, _ = hand_gradients(module, exp, per_token_weight=keep, bonus=0.1)
    assert_same(whole, expected)
    assert metrics["top_entropy_frac"].item() == pytest.approx(keep.sum().item() / mask.sum().item())
    # the threshold is the mini-batch's, whatever pieces it is cut into
    _, split = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=30)
    assert_same(split, expected)


def test_entropy_settings_train_from_a_fit_and_sequence_objectives_refuse_the_mask(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, update={"top_entropy_quantile": 0.2, "entropy_coef": 0.01,
                                                     "entropy_target": 5.0, "mini_batches": 2})
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    logged = t.logged_metrics
    assert 0 < float(logged["train/top_entropy_frac"]) < 0.5
    # one rollout, two optimizer steps, its metrics their mean: the first step waits for a measurement (0); the tiny
    # model's entropy is below 5 nats, so the coefficient rose to 0.015 for the second, then to 0.02
    assert float(logged["train/entropy_coef"]) == pytest.approx(0.0075)
    assert module.updater.entropy.coef == pytest.approx(0.02)
    with pytest.raises(ValueError, match="update.top_entropy_quantile=0.2 .* GSPO takes one advantage a sequence"):
        make(tiny, arithmetic_rows, objective="gspo", update={"top_entropy_quantile": 0.2})


def test_adaptive_coefficient_is_in_the_checkpoint(tiny, arithmetic_rows):
    module, _ = make(tiny, arithmetic_rows, update={"entropy_coef": 0.01, "entropy_target": 1.0})
    module.updater.entropy.observe(0.5)
    module._hf_metadata = {}  # what a Trainer's checkpoint adds: not needed here
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    fresh, _ = make(tiny, arithmetic_rows, update={"entropy_coef": 0.01, "entropy_target": 1.0})
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.updater.entropy.state_dict() == module.updater.entropy.state_dict() == {"coef": 0.015, "last": 0.5}


# --- the KL as a reward penalty ----------------------------------------------------------------------------------------
def test_kl_in_reward_lowers_each_reward_by_its_summed_kl_before_the_advantages():
    ref_model, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    module, exp, metrics = experience({}, reference={"kl_in_reward": 0.5}, ref_model=ref_model)
    assert exp.ref_logprobs is not None
    mask = exp.completion_mask.bool()
    # the reference's log-probs by hand (not through the scorer that made them): each row alone, its unpadded prompt
    # and completion in one plain forward, at the sampling temperature (1)
    ref, training = torch.zeros_like(exp.sampling_logprobs), ref_model.training
    with torch.no_grad():
        ref_model.eval()
        for i in range(exp.num_rows):
            prompt = exp.prompt_ids[i][exp.prompt_mask[i].bool()]
            completion = exp.completion_ids[i][mask[i]]
            logits = ref_model(input_ids=torch.cat([prompt, completion])[None]).logits[0].float()
            picked = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, completion[:, None])[:, 0]
            ref[i, :len(completion)] = picked
        ref_model.train(training)
    assert module.scorer.temperature == 1.0
    torch.testing.assert_close(exp.ref_logprobs[mask], ref[mask], atol=1e-5, rtol=1e-5)
    scores = module.experience.last_scored["rewards"][:, 0]
    # verl: token-level rewards = the score on the last token - beta x KL_t on every token; GRPO's outcome advantage
    # sums them per sequence
    kl_t = torch.where(mask, exp.sampling_logprobs - ref, torch.zeros_like(ref))
    token_rewards = -0.5 * kl_t
    last = mask.sum(-1) - 1
    token_rewards[torch.arange(len(last)), last] += scores
    penalised = token_rewards.sum(-1)
    assert (penalised - scores).abs().max() > 1e-3  # the reference differs: the penalty is not nothing
    torch.testing.assert_close(exp.advantages, estimate_advantages(penalised, 4, "grpo", "group"))
    assert metrics["train/kl_reward_penalty"].item() == pytest.approx((0.5 * kl_t.sum(-1)).mean().item(), rel=1e-5)
    # the update does not take the reference's pass again
    module.scorer.reference = lambda exp: pytest.fail("the reference pass ran twice")
    optim = module.configure_optimizers()
    out = module.updater.run(exp, optim["optimizer"], optim["lr_scheduler"]["scheduler"])
    assert "kl" in out  # logged under the one name


def exp_batch(module):
    tok = module.tokenizer
    prompts = ["12+34=", "5+6="]
    enc = tok(prompts, padding=True, return_tensors="pt")
    return {"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask, "prompts": prompts, "columns": {}}


def reference_pass_grad_modes(module):
    """Whether grad was on in each reference pass the module runs from now on."""
    modes, run = [], module.scorer.logprobs

    def spy(model, *args, **kwargs):
        if model is module.ref_model or module.shared_reference:
            modes.append(torch.is_grad_enabled())
        return run(model, *args, **kwargs)

    module.scorer.logprobs = spy
    return modes


def test_a_given_reference_is_frozen_and_a_kl_reward_penalty_keeps_no_graph():
    ref_model, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2,
                                    dropout=0.5)
    assert all(p.requires_grad for p in ref_model.parameters())
    module, exp, _ = experience({}, reference={"kl_in_reward": 0.5}, ref_model=ref_model)
    assert module.ref_model is ref_model and not any(p.requires_grad for p in ref_model.parameters())
    # the reward penalty's reference pass ran inside make_experience: nothing it made carries a graph
    assert not exp.ref_logprobs.requires_grad and exp.ref_logprobs.grad_fn is None
    assert not exp.advantages.requires_grad and exp.advantages.grad_fn is None
    modes = reference_pass_grad_modes(module)
    again = module.reference_logprobs(exp)
    assert modes == [False]
    # its passes run in eval mode: its dropout (0.5) is off, so every pass gives the same log-probs
    mask = exp.completion_mask.bool()
    assert torch.equal(again[mask], exp.ref_logprobs[mask])
    # a reference that is (or shares weights with) the policy would be frozen with it: refused
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    with pytest.raises(ValueError, match="ref_model shares parameters with the policy"):
        PolicyOptimizationModule(model, tok, reward_fns=[varied], experience={"num_generations": 2},
                                 reference={"kl_in_reward": 0.5}, ref_model=model)


@pytest.mark.filterwarnings("ignore:Careful, disabling adapter layers:UserWarning")  # peft, on bias="all"
def test_the_adapter_disabled_reference_of_a_lora_policy_keeps_no_graph():
    # bias="all": the base's biases train, and the adapter-disabled pass goes through them
    module, exp, _ = experience({}, reference={"kl_in_reward": 0.5}, adapter=Adapter(kind="lora", r=4, bias="all"))
    assert module.shared_reference and module.ref_model is None
    assert any(p.requires_grad for n, p in module.policy.named_parameters() if "lora_" not in n)
    assert not exp.ref_logprobs.requires_grad and exp.ref_logprobs.grad_fn is None
    assert not exp.advantages.requires_grad and exp.advantages.grad_fn is None
    modes = reference_pass_grad_modes(module)
    exp2, _ = module.make_experience(exp_batch(module))
    assert modes == [False] and not exp2.ref_logprobs.requires_grad


def test_kl_in_reward_settings_are_checked(tiny, arithmetic_rows):
    with pytest.raises(ValueError, match="reference.reward_kl_estimator must be one of"):
        make(tiny, arithmetic_rows, reference={"kl_in_reward": 0.1, "reward_kl_estimator": "k3+"})
    with pytest.raises(ValueError, match="reference.kl_in_reward must be >= 0"):
        make(tiny, arithmetic_rows, reference={"kl_in_reward": -1.0})
    module, _ = make(tiny, arithmetic_rows, reference={"kl_in_reward": 0.1})
    assert module.ref_model is not None  # made for the penalty alone (beta = 0, track_kl off)
