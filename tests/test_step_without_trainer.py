"""The step without a Trainer: ``Updater.run`` on a module that no Trainer holds equals the update written out by hand
(the log-probs from the model's logits, every mini-batch whole, torch's own clipping), step by step."""

import copy
import math
import re
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from polopt_lightning.models import build_tiny_model
from polopt_lightning.step.loop import TorchLoop
from polopt_lightning.step.terms import TERMS, AnchorTerm, LossTerm, register_term, sampler_weights
from polopt_lightning.step.update import Updater, lr_factor, mini_batch_order

from .helpers.step import ANSWERS, tiny_rollout


def module_and_experience(objective=None, reference=None, anchor=None, equal_lengths=True, ref_model=None, **update):
    """A module (no Trainer) and one rollout of 3 prompts x 4 completions of up to 6 tokens. ``equal_lengths``: every
    completion counted at the full 6 tokens (random tokens in place of the EOS and the padding after it)."""
    module, exp, _ = tiny_rollout(objective or {"name": "grpo"}, columns={"answer": ANSWERS}, update=update,
                                  reference=reference, anchor=anchor, ref_model=ref_model)
    tok = module.tokenizer
    assert exp.advantages.abs().sum() > 0
    if equal_lengths:  # random tokens in place of the EOS and the padding after it, the sampler's log-probs of them
        ended = exp.completion_mask == 0
        ended |= torch.zeros_like(ended).scatter(1, (exp.completion_mask.sum(-1, keepdim=True) - 1).clamp(min=0),
                                                 (exp.completion_ids == tok.eos_token_id).any(-1, keepdim=True))
        filler = torch.randint(10, 90, exp.completion_ids.shape, generator=torch.Generator().manual_seed(0))
        exp.completion_ids = torch.where(ended, filler, exp.completion_ids)
        exp.completion_mask = torch.ones_like(exp.completion_mask)
        with torch.no_grad():
            exp.sampling_logprobs = scores(module.policy, exp, torch.arange(len(exp.completion_ids)))[0]
    else:
        assert len(set(exp.completion_mask.sum(-1).tolist())) > 1
    return module, exp


def scores(model, exp, rows):
    """Log-probs and entropies ``[n, T]`` of the rows' completions, from the model's full logits."""
    return answer_scores(model, exp.prompt_ids[rows], exp.prompt_mask[rows], exp.completion_ids[rows],
                         exp.completion_mask[rows])


def answer_scores(model, prompt_ids, prompt_mask, answer_ids, answer_mask):
    ids = torch.cat([prompt_ids, answer_ids], 1)
    mask = torch.cat([prompt_mask, answer_mask.to(prompt_mask.dtype)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    T = answer_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -T - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, answer_ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def kl(estimator, logprobs, ref):
    """Per-token KL estimates of the policy from the reference (Schulman's k1, k2, k3; k3+ has k3's value)."""
    log_ratio = ref - logprobs
    return {"k1": -log_ratio, "k2": log_ratio ** 2 / 2}.get(estimator, log_ratio.exp() - log_ratio - 1)


def by_hand(module, exp, global_step=0, steps=None, old_logprobs=None):
    """The rollout's updates as the docs describe them; returns the updated policy and each step's metrics."""
    policy, objective, config = copy.deepcopy(module.policy), module.objective, module.update_config
    optimizer = module.optimizer_factory([p for p in policy.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_factor, schedule=config.lr_schedule, warmup=config.warmup_steps, total=0, floor=config.min_lr_ratio))
    n = exp.completion_ids.shape[0]
    size = math.ceil(n / config.mini_batches)
    with torch.no_grad():  # before any update: the sampling policy's (and the reference's) log-probs
        start_logprobs = scores(policy, exp, torch.arange(n))[0]
        ref_logprobs = start_logprobs if module.ref_model is None else scores(module.ref_model, exp, torch.arange(n))[0]
        # its entropies as the update's scorer computes them (tested against the full softmax in test_kl_entropy.py):
        # a tiny random model's entropies tie to 1e-6 near a quantile, where two ways of summing pick different tokens
        start_entropy = module.scorer.logprobs(policy, exp, slice(None), with_entropy=True)[1]
    start_logprobs = start_logprobs if old_logprobs is None else old_logprobs  # or the sampler's, reused
    updates = [(i, start) for i in range(config.num_iterations) for start in range(0, n, size)][:steps]
    metrics = []
    coef, last = config.entropy_coef, math.inf  # the bonus's coefficient; adaptive: the last step's entropy
    for i, start in updates:
        order = mini_batch_order(exp.group_index, module.seed + global_step + i * config.mini_batches,
                                 config.share_prompt)
        rows = order[start:start + size]
        optimizer.zero_grad()
        logprobs, entropy = scores(policy, exp, rows)
        mask = exp.completion_mask[rows]
        old = start_logprobs[rows] if config.off_policy else logprobs.detach()
        advantages, keep = exp.advantages[rows], mask.bool()
        step = {}
        if config.is_correction:  # the sampler correction: advantages times the sampler's importance weights
            # the mode's default: a weight a token for a token-level objective, one a sequence for GSPO
            mode = config.is_mode or ("token_truncate" if objective.accepts_token_advantages else "sequence_truncate")
            weights, step = sampler_weights(old, exp.sampling_logprobs[rows], mask, mode, config.is_cap)
            advantages = advantages[:, None] * weights if weights.shape[-1] > 1 else advantages * weights[:, 0]
        if config.top_entropy_quantile < 1:  # the policy gradient on the mini-batch's most uncertain tokens only
            keep = keep & (start_entropy[rows] >= torch.quantile(start_entropy[rows][keep],
                                                                 1 - config.top_entropy_quantile))
            advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * keep
        ref = ref_logprobs[rows] if module.ref_model is not None else None
        out = objective(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask, ref_logprobs=ref)
        if config.entropy_aggregation == "objective":  # the bonus aggregated over tokens as the objective's loss is
            bonus = objective.aggregate_tokens(entropy, keep)
        else:
            bonus = (entropy * keep).sum() / keep.sum()
        applied = coef if config.entropy_target is None or last <= config.entropy_target else 0.0
        loss = out.loss - applied * bonus
        if module.anchor is not None:  # lambda x the NLL of the mini-batch's prompts' reference answers, a token mean
            groups = exp.group_index[rows].unique()
            first = groups * module.experience_config.num_generations
            answer_mask = exp.anchor_mask[groups]
            answer = answer_scores(policy, exp.prompt_ids[first], exp.prompt_mask[first], exp.anchor_ids[groups],
                                   answer_mask)[0]
            nll = -(answer * answer_mask).sum() / answer_mask.sum()
            loss = loss + module.anchor.value * nll
            step.update(anchor_nll=nll, anchor_coef=torch.tensor(module.anchor.value))
        loss.backward()
        step.update({"loss": out.loss.detach(), **out.metrics, "entropy": (entropy * mask).sum() / mask.sum()})
        if ref is not None and "kl" not in out.metrics:  # watched, not trained on: the mean of per-token estimates
            step["kl"] = kl(objective.kl_estimator, logprobs.detach(), ref)[mask.bool()].mean()
        if config.top_entropy_quantile < 1:
            step["top_entropy_frac"] = keep.sum() / mask.sum()
        if config.entropy_coef or config.entropy_target is not None:
            step["entropy_coef"] = torch.tensor(applied)
        if config.entropy_target is not None:  # Skywork-OR1's rule, on the bonus tokens' mean entropy
            last = float((entropy.detach() * keep).sum() / keep.sum())
            step["_observed"] = torch.tensor(last)
            coef += config.entropy_coef_delta if last <= config.entropy_target else -config.entropy_coef_delta
            coef = min(max(coef, config.entropy_coef_min), config.entropy_coef_max)
            step["_coef"] = torch.tensor(coef)
        step["grad_norm"] = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm or math.inf)
        optimizer.step()
        scheduler.step()
        metrics.append({k: float(v.detach()) for k, v in step.items()})
    return policy, metrics


def hand_gap(module, exp, reused):
    """The sampler's gap from the trainer that the update logs over the whole rollout where it computes the old
    log-probs itself, off-policy, with the correction off (``sampler_weights``' metrics of the starting policy's
    log-probs against the sampler's); ``None`` where it takes the sampler's (``reused``) or needs none. Call it
    before the update moves the policy."""
    config = module.update_config
    if reused or not config.off_policy or config.is_correction:
        return None
    with torch.no_grad():
        old = scores(module.policy, exp, torch.arange(exp.completion_ids.shape[0]))[0]
    mode = config.is_mode or ("token_truncate" if module.objective.accepts_token_advantages else "sequence_truncate")
    _, gap = sampler_weights(old, exp.sampling_logprobs, exp.completion_mask, mode, config.is_cap)
    return {key: float(value) for key, value in gap.items()}


def assert_same_metrics(metrics, steps, keys=None, gap=None):
    """The run's metrics are the means of its steps' (the ``*_max`` ones too); skipped steps are counted; ``gap``:
    the rollout's sampler gap (:func:`hand_gap`) where it is logged."""
    expected = {key: sum(step[key] for step in steps) / len(steps) for key in steps[0] if not key.startswith("_")}
    assert set(metrics) == {*expected, "skipped_updates", *(gap or {})}
    for key, value in {**expected, **(gap or {})}.items():
        if keys is not None and key not in keys:
            continue
        torch.testing.assert_close(float(metrics[key]), value, atol=1e-6, rtol=1e-4, msg=key)


def run(module, exp, trainer=None):
    """``Updater.run`` on the module's parts in plain PyTorch (:class:`TorchLoop`), or through the module's own loop
    over a stand-in Trainer; counts the steps the engine is told of."""
    if trainer is None:
        module.updater.loop = TorchLoop()
    else:
        module.manual_backward = lambda loss: loss.backward()
        module._trainer = trainer
    told = []
    module.engine.policy_updated = lambda policy: told.append(policy)
    optim = module.configure_optimizers()
    metrics = module.updater.run(exp, optim["optimizer"], optim["lr_scheduler"]["scheduler"])
    assert all(policy is module.policy for policy in told)  # the backend syncs the policy itself
    return metrics, len(told), optim["optimizer"]


def assert_same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("objective, update", [
    ({"name": "grpo"}, {}),  # the shipped update: one on-policy step, clipped at 1.0
    ({"name": "grpo", "beta": 0.04}, {"mini_batches": 2, "num_iterations": 2, "micro_batch_tokens": 30}),
    ({"name": "gspo"}, {"mini_batches": 3, "share_prompt": False, "max_grad_norm": 0.05}),
    ({"name": "dr_grpo", "max_completion_length": 6}, {"mini_batches": 2, "entropy_coef": 0.01}),
    ({"name": "grpo"}, {"top_entropy_quantile": 0.5, "entropy_coef": 0.01}),
    ({"name": "dapo"}, {"mini_batches": 2, "num_iterations": 2, "top_entropy_quantile": 0.3,
                        "micro_batch_tokens": 40}),
    ({"name": "grpo"}, {"mini_batches": 2, "top_entropy_quantile": 0.5, "reuse_sampling_logprobs": False}),
    ({"name": "grpo"}, {"mini_batches": 12}),  # a completion a mini-batch
    ({"name": "grpo"}, {"mini_batches": 2, "micro_batch_tokens": 30, "reference": {"track_kl": True}}),
    ({"name": "gspo", "kl_estimator": "k1"}, {"mini_batches": 2, "reference": {"track_kl": True}}),
    ({"name": "gspo", "beta": 0.04, "kl_estimator": "k2"}, {"micro_batch_tokens": 30}),
    ({"name": "dr_grpo", "max_completion_length": 6}, {"entropy_coef": 0.01, "entropy_aggregation": "objective",
                                                       "top_entropy_quantile": 0.5, "micro_batch_tokens": 30}),
    ({"name": "grpo"}, {"mini_batches": 2, "anchor": {"coef": 0.5, "column": "answer"}, "micro_batch_tokens": 30}),
    ({"name": "grpo"}, {"anchor": {"coef": 0.0, "column": "answer"}}),  # the NLL watched, no gradient
    # the fused head in every pass: the training, reference, entropy and anchor passes
    ({"name": "grpo", "beta": 0.04}, {"fused_head": True, "mini_batches": 2, "top_entropy_quantile": 0.5,
                                      "entropy_coef": 0.01, "anchor": {"coef": 0.5, "column": "answer"}}),
    # padding-free passes, completions of their own lengths, with the fused head and under gradient checkpointing
    ({"name": "grpo", "beta": 0.04}, {"padding_free": True, "mini_batches": 2, "micro_batch_tokens": 30,
                                      "entropy_coef": 0.01, "equal_lengths": False}),
    ({"name": "gspo"}, {"padding_free": True, "fused_head": True, "gradient_checkpointing": True,
                        "num_iterations": 2, "reuse_sampling_logprobs": False, "equal_lengths": False}),
])
def test_the_updates_equal_the_hand_written_ones(objective, update, monkeypatch):
    from polopt_lightning.step import logprobs

    module, exp = module_and_experience(objective, **update)
    reused = module.reuse_sampling_logprobs and module.engine.logprobs_match(module.policy)
    if not reused:  # the sampler's log-probs then feed only the gap: made to differ from the trainer's, so it measures
        noise = torch.randn(exp.sampling_logprobs.shape, generator=torch.Generator().manual_seed(1))
        exp.sampling_logprobs = exp.sampling_logprobs + 0.3 * noise * exp.completion_mask
    expected, steps_by_hand = by_hand(module, exp)
    gap = hand_gap(module, exp, reused)
    if gap is not None:
        assert gap["is_weight_max"] > 1.2 and gap["sampler_kl"] > 1e-3
    fused, real = [], logprobs._HeadLogProbs.apply
    packed, real_packed = [], logprobs.padding_free_logprobs
    monkeypatch.setattr(logprobs, "padding_free_logprobs", lambda *a, **k: packed.append(1) or real_packed(*a, **k))
    monkeypatch.setattr(logprobs._HeadLogProbs, "apply", lambda *a: fused.append(a[6]) or real(*a))
    metrics, steps, optimizer = run(module, exp)
    # fused in the training passes (with the entropy's gradient), the anchor's and the top-entropy mask's
    assert bool(fused) is bool(update.get("fused_head"))
    if fused and update.get("entropy_coef"):  # with the entropy's gradient in the training pass, without elsewhere
        assert {True, False} <= set(fused)
    assert bool(packed) is bool(update.get("padding_free"))
    assert steps == len(steps_by_hand) == module.update_config.mini_batches * module.update_config.num_iterations
    assert optimizer.state_dict()["state"][0]["step"] == steps
    assert all(p.grad is None for p in module.policy.parameters())  # freed after the step
    assert_same_weights(module.policy, expected)
    assert_same_metrics(metrics, steps_by_hand, gap=gap)
    assert float(metrics["skipped_updates"]) == 0 and float(metrics["grad_norm"]) > 0


def test_the_update_runs_from_its_parts_alone_in_plain_pytorch():
    """No LightningModule and no Trainer: the policy, objective, scorer, engine and settings handed to an ``Updater``
    with a :class:`TorchLoop` train exactly as written by hand, and the loop counts the steps."""
    module, exp = module_and_experience({"name": "grpo", "beta": 0.04}, mini_batches=2, num_iterations=2,
                                        micro_batch_tokens=30, anchor={"coef": 0.5, "column": "answer"})
    expected, steps_by_hand = by_hand(module, exp)
    gap = hand_gap(module, exp, reused=False)  # the Updater's own default: the old log-probs computed
    policy, engine, loop = module.policy, module.engine, TorchLoop()
    engine.policy_updated = lambda policy: None
    updater = Updater(policy, module.objective, module.scorer, engine, module.update_config, loop,
                      anchor=module.anchor, reference=True, seed=module.seed)
    config = module.update_config
    optimizer = module.optimizer_factory([p for p in policy.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_factor, schedule=config.lr_schedule, warmup=config.warmup_steps, total=0, floor=config.min_lr_ratio))
    metrics = updater.run(exp, optimizer, scheduler)
    assert loop.global_step == 4 == len(steps_by_hand)
    assert_same_weights(policy, expected)
    assert_same_metrics(metrics, steps_by_hand, gap=gap)


def test_the_weights_move_and_a_clip_limits_them():
    module, exp = module_and_experience()
    start = copy.deepcopy(module.policy)
    metrics, _, _ = run(module, exp)
    moved = sum(float((p - q).abs().sum()) for p, q in zip(module.policy.parameters(), start.parameters()))
    assert moved > 0 and float(metrics["grad_norm"]) > 0.05  # so the clip at 0.05 below acts
    unclipped, _ = by_hand(module_and_experience(max_grad_norm=None)[0], exp)
    clipped, _ = by_hand(module_and_experience(max_grad_norm=0.05)[0], exp)
    assert any(not torch.allclose(p, q) for p, q in zip(unclipped.parameters(), clipped.parameters()))


def test_a_non_finite_loss_skips_the_update_and_the_step_still_counts():
    module, exp = module_and_experience(mini_batches=2, share_prompt=False)
    exp.advantages = exp.advantages.clone()
    exp.advantages[:] = float("inf")  # (a NaN advantage counts as 0: base.Objective)
    start = copy.deepcopy(module.policy)
    with pytest.warns(UserWarning, match=r"step 0: non-finite loss \(-?inf\) or gradient norm \((nan|-?inf)\); the "
                                         "update is skipped"):
        metrics, steps, optimizer = run(module, exp)
    assert float(metrics["skipped_updates"]) == 2 and steps == 2
    assert_same_weights(module.policy, start)
    assert optimizer.state_dict()["state"] == {}  # no parameter stepped: no Adam state either


@pytest.mark.parametrize("global_step, max_steps, made", [(0, 3, 3), (2, 3, 1), (3, 3, 1), (0, 1, 1), (0, 4, 4),
                                                         (0, 0, 4), (0, -1, 4)])
def test_the_rollouts_updates_stop_at_max_steps(global_step, max_steps, made, caplog):
    module, exp = module_and_experience(mini_batches=2, num_iterations=2)
    expected, _ = by_hand(module, exp, global_step, steps=made)
    trainer = SimpleNamespace(max_steps=max_steps, global_step=global_step, strategy=SimpleNamespace(model=None),
                              precision_plugin=None)
    with caplog.at_level("INFO"):
        _, steps, _ = run(module, exp, trainer)
    assert steps == made
    assert_same_weights(module.policy, expected)
    said = f"trainer.max_steps={max_steps}: the last rollout makes {made} of its optimizer steps"
    assert (said in caplog.text) == (made < 4), caplog.text


def test_more_mini_batches_than_completions_is_refused():
    module, exp = module_and_experience(mini_batches=13)
    with pytest.raises(ValueError, match=r"update.mini_batches=13 is more than the rollout's 12 completions "
                                         r"\(3 prompts x num_generations=4\)"):
        run(module, exp)


@pytest.mark.parametrize("reuse", [False, True])
def test_the_samplers_log_probs_are_the_old_ones_only_where_they_match_the_training_pass(reuse):
    """Off-policy, the old log-probs are the sampler's when the engine says they match the training pass and the
    update may reuse them; otherwise a pass of the policy gives them (here the sampler's are made to differ)."""
    module, exp = module_and_experience(mini_batches=2, num_iterations=2, reuse_sampling_logprobs=reuse)
    exp.sampling_logprobs = exp.sampling_logprobs + 0.3 * torch.randn_like(exp.sampling_logprobs)
    module.engine.logprobs_match = lambda policy: True
    expected, _ = by_hand(module, exp, old_logprobs=exp.sampling_logprobs if reuse else None)
    run(module, exp)
    assert_same_weights(module.policy, expected)


class _InfiniteGradient(torch.autograd.Function):
    """Zero forward, an infinite gradient backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, float("inf"))


class _Poisoned:
    """The module's objective with its loss changed by ``poison(loss, logprobs)``."""

    def __init__(self, inner, poison):
        self.inner, self.poison = inner, poison

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, **kw):
        out = self.inner(**kw)
        out.loss = self.poison(out.loss, kw["logprobs"])
        return out


@pytest.mark.parametrize("poison, loss, norm", [
    (lambda loss, logprobs: loss + float("inf"), "inf", r"[0-9.]+"),  # the loss alone
    (lambda loss, logprobs: loss + _InfiniteGradient.apply(logprobs), r"-?[0-9.]+", "(nan|inf)"),  # the gradient alone
])
def test_a_non_finite_loss_or_gradient_alone_skips_the_update(poison, loss, norm):
    module, exp = module_and_experience()
    module.updater.objective = _Poisoned(module.objective, poison)
    start = copy.deepcopy(module.policy)
    with pytest.warns(UserWarning, match=rf"non-finite loss \({loss}\) or gradient norm \({norm}\)"):
        metrics, steps, _ = run(module, exp)
    assert float(metrics["skipped_updates"]) == 1 and steps == 1
    assert_same_weights(module.policy, start)


def test_where_the_gradients_are_not_whole_lightning_clips_them():
    """A loss scaler (``16-mixed``) holds the gradients scaled, so the step cannot clip by the norm it measured: it
    asks the Trainer (``clip_gradients``, which unscales first) with the limit and the optimizer."""
    module, exp = module_and_experience(mini_batches=2)
    expected, _ = by_hand(module, exp)
    calls = []

    def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        calls.append((optimizer, gradient_clip_val, gradient_clip_algorithm))
        torch.nn.utils.clip_grad_norm_(module.policy.parameters(), gradient_clip_val)

    module.clip_gradients = clip_gradients
    trainer = SimpleNamespace(max_steps=-1, global_step=0, strategy=SimpleNamespace(model=None),
                              precision_plugin=SimpleNamespace(scaler=object()))
    _, steps, optimizer = run(module, exp, trainer)
    assert not module.updater.clips_in_place()
    assert calls == [(optimizer, 1.0, "norm")] * steps and steps == 2
    assert_same_weights(module.policy, expected)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_sampler_correction_weights_each_micro_batchs_advantages_by_its_own_rows(mode):
    """With the correction on, every token's (or sequence's) advantage is times the sampler's importance weight,
    from the rows' old log-probs and the sampler's: micro-batches each weigh their own rows."""
    module, exp = module_and_experience(mini_batches=2, num_iterations=2, is_correction=True, is_mode=mode,
                                        reuse_sampling_logprobs=False, micro_batch_tokens=30)
    exp.sampling_logprobs = exp.sampling_logprobs + 0.2 * torch.randn_like(exp.sampling_logprobs)
    expected, steps_by_hand = by_hand(module, exp)
    metrics, _, _ = run(module, exp)
    assert_same_weights(module.policy, expected)
    assert_same_metrics(metrics, steps_by_hand)
    assert any(key.startswith("is_") for key in metrics)


@pytest.mark.parametrize("objective, update", [
    ({"name": "grpo", "beta": 0.04}, {"mini_batches": 2, "num_iterations": 2, "micro_batch_tokens": 30}),
    ({"name": "dr_grpo", "max_completion_length": 6}, {"micro_batch_tokens": 30, "is_correction": True,
                                                        "top_entropy_quantile": 0.5, "entropy_coef": 0.01}),
    # a completion a mini-batch: one of them a single token
    ({"name": "grpo"}, {"mini_batches": 12, "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "entropy_target": 10.0}),
    ({"name": "grpo"}, {"mini_batches": 12, "entropy_coef": 0.5, "entropy_target": 3.0}),
    ({"name": "grpo"}, {"mini_batches": 12, "entropy_coef": 0.5}),
])
def test_with_uneven_lengths_the_updates_and_the_exact_metrics_equal_the_hand_written_ones(objective, update):
    """Completions of different lengths (one ends at its first token): the micro-batches' own widths change nothing."""
    module, exp = module_and_experience(objective, equal_lengths=False, **update)
    expected, steps_by_hand = by_hand(module, exp)
    metrics, _, _ = run(module, exp)
    assert_same_weights(module.policy, expected)
    assert_same_metrics(metrics, steps_by_hand)
    observed = [step["_observed"] for step in steps_by_hand if "_observed" in step]
    if observed:  # the adaptive coefficient read every step's bonus tokens, the single-token one too
        assert module.updater.entropy.last == pytest.approx(observed[-1], rel=1e-5)
        assert module.updater.entropy.coef == pytest.approx(float(steps_by_hand[-1]["_coef"]))
        assert min(observed) > 0 and len(observed) == 12


@pytest.mark.parametrize("objective, reference, is_mode, mini_batches", [
    ({"name": "grpo"}, None, "token_truncate", 2),
    ({"name": "grpo", "aggregation": "token-mean", "beta": 0.04}, None, "sequence_mask", 2),
    ({"name": "gspo", "beta": 0.04}, None, "sequence_truncate", 2),
    ({"name": "gspo", "variant": "token"}, {"track_kl": True}, "token_mask", 2),
    ({"name": "grpo"}, {"track_kl": True}, "sequence_truncate", 12),  # one completion a mini-batch: counts of 1
])
def test_token_means_are_logged_exactly_under_micro_batching_with_uneven_lengths(objective, reference, is_mode,
                                                                                 mini_batches):
    """Each piece's means are weighted by the tokens or sequences they average (``ObjectiveOutput.counts``), the
    loss and the KL aggregated as the loss is by the piece's share of the normaliser: every logged value is the whole
    mini-batch's, whatever the split and the lengths."""
    other, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    module, exp = module_and_experience(objective, reference, equal_lengths=False, mini_batches=mini_batches,
                                        ref_model=other,  # a reference far from the policy: a KL that shows
                                        micro_batch_tokens=50, is_correction=True, is_mode=is_mode,
                                        is_cap=1.1, reuse_sampling_logprobs=False)
    pieces = module.updater.micro_batches(exp, torch.arange(6))
    assert len(pieces) > 1 and max(len(p) for p in pieces) > 1  # pieces of several rows, padded to their widest
    exp.sampling_logprobs = exp.sampling_logprobs + 0.2 * torch.randn_like(exp.sampling_logprobs)
    _, steps_by_hand = by_hand(module, exp)
    metrics, _, _ = run(module, exp)
    assert_same_metrics(metrics, steps_by_hand)


@pytest.mark.parametrize("target", [0.0, 4.5, 10.0])
def test_the_adaptive_entropy_coefficient_follows_each_steps_bonus_tokens(target):
    """Skywork-OR1's rule through the update: the bonus waits for a measurement, then after each step its
    coefficient rises (entropy at or below the target) or falls, read from that step's bonus tokens."""
    module, exp = module_and_experience(mini_batches=3, num_iterations=2, entropy_coef=0.02, entropy_target=target,
                                        entropy_coef_delta=0.01, top_entropy_quantile=0.5, micro_batch_tokens=30)
    expected, steps_by_hand = by_hand(module, exp)
    metrics, _, _ = run(module, exp)
    assert_same_weights(module.policy, expected)
    assert_same_metrics(metrics, steps_by_hand)
    control = module.updater.entropy
    assert control.last == pytest.approx(steps_by_hand[-1]["_observed"], rel=1e-5)
    moves = sum(1 if step["_observed"] <= target else -1 for step in steps_by_hand)
    assert control.coef == pytest.approx(min(max(0.02 + 0.01 * moves, 0.0), 1.0))


class MeanLogProb(LossTerm):
    """A term of a user's own: ``- coef x`` the mean log-prob of the mini-batch's completion tokens (every process's),
    with its token count taken in ``begin`` and its value logged in ``end``."""

    def __init__(self, coef):
        self.coef = coef

    def begin(self, batch):
        self.tokens, self.total = batch.exp.completion_mask[batch.rows].sum(), 0.0
        return {}

    def loss(self, batch, piece, out):
        value = (piece.logprobs * piece.mask).sum() / self.tokens
        self.total += float(value.detach())
        return -self.coef * batch.world * value

    def end(self, batch):
        return {"mean_logprob": torch.tensor(self.total)}


def test_the_loss_terms_by_their_settings_in_the_order_they_act():
    module, _ = module_and_experience({"name": "grpo"}, reference={"track_kl": True},
                                      anchor={"coef": 0.5, "column": "answer"}, is_correction=True,
                                      top_entropy_quantile=0.5, entropy_coef=0.01)
    assert [term.name for term in module.updater.terms] == [
        "sampler_correction", "top_entropy_mask", "entropy_bonus", "kl_watch", "anchor"]
    assert list(TERMS)[:5] == [term.name for term in module.updater.terms]
    assert repr(module.updater.terms[0]) == "SamplerCorrection('sampler_correction', mode='token_truncate', cap=2.0)"
    plain, _ = module_and_experience()
    assert plain.updater.terms == []  # no reference: no KL to watch
    trained, _ = module_and_experience({"name": "grpo", "beta": 0.04})
    assert trained.updater.terms == []  # the objective trains on the KL and logs it
    with pytest.raises(ValueError, match="a loss term is already registered as 'anchor': AnchorTerm"):
        register_term("anchor")(MeanLogProb)
    again = type("AnchorTerm", (AnchorTerm,), {"__module__": AnchorTerm.__module__, "__qualname__": "AnchorTerm"})
    try:  # the same class defined again (a notebook cell run twice) takes its place
        assert register_term("anchor")(again) is again and TERMS["anchor"] is again
    finally:
        register_term("anchor")(AnchorTerm)
    assert TERMS["anchor"] is AnchorTerm


def test_a_loss_term_of_ones_own_adds_its_gradient_exactly_under_micro_batching():
    """``Updater(terms=[...])``: the built-in terms and one more; the gradient is the objective's plus the term's, as
    written by hand over the whole mini-batch, whatever the micro-batches; its metric comes out with the step's. A term
    registered (``register_term``) is built into every update its ``build`` accepts."""
    module, exp = module_and_experience(equal_lengths=False, micro_batch_tokens=30)
    rows = torch.arange(exp.num_rows)

    def gradients(terms):
        policy = copy.deepcopy(module.policy)
        updater = Updater(policy, module.objective, module.scorer, module.engine, module.update_config, TorchLoop(),
                          terms=terms)
        metrics = updater.accumulate(exp, rows)
        return metrics, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, policy

    _, plain, _ = gradients(None)
    metrics, with_term, _ = gradients([*module.updater.terms, MeanLogProb(0.3)])
    assert len(exp.completion_mask.sum(-1).unique()) > 1  # uneven lengths: the pieces' shares differ
    hand = copy.deepcopy(module.policy)
    logprobs = scores(hand, exp, rows)[0]
    (-(0.3 * (logprobs * exp.completion_mask).sum() / exp.completion_mask.sum())).backward()
    for name, p in hand.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(with_term[name] - plain[name], p.grad, atol=2e-6, rtol=1e-4, msg=name)
    mean = float((logprobs.detach() * exp.completion_mask).sum() / exp.completion_mask.sum())
    assert float(metrics["mean_logprob"]) == pytest.approx(mean, rel=1e-5)
    drop_in = copy.deepcopy(module)  # a module already built takes a term into its updater's list
    drop_in.updater.terms.append(MeanLogProb(0.3))
    assert float(drop_in.accumulate_gradients(exp, rows)["mean_logprob"]) == pytest.approx(mean, rel=1e-5)
    for name, p in drop_in.policy.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, with_term[name], msg=name)
    register_term("mean_logprob")(MeanLogProb)
    try:
        MeanLogProb.build = classmethod(lambda cls, updater: cls(0.3) if updater.config.micro_batch_tokens else None)
        registered, by_registry, _ = gradients(None)
        assert module.updater.terms == []  # built before the registration
        for name in with_term:
            torch.testing.assert_close(by_registry[name], with_term[name], msg=name)
        assert float(registered["mean_logprob"]) == pytest.approx(mean, rel=1e-5)
    finally:
        del TERMS["mean_logprob"]


def test_the_update_itself_names_no_piece_of_the_algorithm():
    """The update runs micro-batches -> objective and terms -> backward -> reduce: the sampler's weights, the entropy
    terms, the KL's tracking and the anchor live in step/terms.py alone."""
    import ast
    import inspect
    import textwrap

    names = set()
    for method in (Updater.accumulate, Updater.step):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(method)))):
            names.add(node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else "")
    assert {"objective", "terms", "backward", "all_reduce"} <= names  # the walk sees the update's own names
    pieces = [name for name in names if re.search("sampler|is_|entropy_coef|coef|top_mask|keep|kl|anchor|bonus", name)]
    assert not pieces
