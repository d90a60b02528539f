"""PPO with a critic (GAE, the clipped value loss, whitening), the ReMax and pass@k estimators and the reward
aggregation that normalises each function within its group: each against a reference written here from the papers'
and verl's definitions on the same tensors (values and gradients), then in the module (the critic trained beside the
policy, its warm-up, its checkpoint and exact resume, a LoRA policy's critic)."""

import math

import lightning as L
import pytest
import torch

from polopt_lightning.rewards import RewardComposer
from polopt_lightning.step.advantages import (
    ADVANTAGE_ESTIMATORS,
    estimate_advantages,
    gae,
    masked_whiten,
    outcome_token_rewards,
)
from polopt_lightning.step.critic import CriticConfig, ValueModel, value_loss

from .helpers import make, trainer

NAN = float("nan")


# --- GAE, whitening, the value loss --------------------------------------------------------------------------------
def gae_by_hand(rewards, values, mask, gamma, lam):
    """GAE row by row over the tokens the mask keeps (the others skipped: a tool result's tokens are not the
    policy's), V = 0 past the last kept token; returns A + V. Plain Python lists."""
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rewards, values, mask):
        kept = [t for t, keep in enumerate(m) if keep]
        adv, ret = [0.0] * len(r), [0.0] * len(r)
        running = 0.0
        for k in reversed(range(len(kept))):
            t = kept[k]
            next_v = v[kept[k + 1]] if k + 1 < len(kept) else 0.0
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t], ret[t] = running, running + v[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    return adv_rows, ret_rows


def test_gae_and_returns_are_the_papers_over_the_policys_tokens():
    torch.manual_seed(0)
    values = torch.randn(3, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0],        # a completion of four tokens, then padding
                         [1, 1, 0, 0, 1, 1],        # a tool result (two tokens) between two turns
                         [1, 0, 0, 0, 0, 0]])
    outcome = torch.tensor([1.0, -0.5, 2.0])
    rewards = outcome_token_rewards(outcome, mask).double()
    assert rewards.tolist()[0] == [0, 0, 0, 1.0, 0, 0] and rewards[1, 5] == -0.5 and rewards[2, 0] == 2.0
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.0)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        want_adv, want_ret = gae_by_hand(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        keep = mask.bool()
        torch.testing.assert_close(adv[keep].double(), torch.tensor(want_adv, dtype=torch.float64)[keep],
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ret[keep].double(), torch.tensor(want_ret, dtype=torch.float64)[keep],
                                   rtol=1e-6, atol=1e-6)
    # lam = gamma = 1: each kept token's advantage is the outcome less its value (Monte-Carlo)
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv[0, :4].double(), 1.0 - values[0, :4], rtol=1e-6, atol=1e-6)
    # a missing reward (None) gives the completion no token reward
    assert outcome_token_rewards(torch.tensor([NAN]), torch.ones(1, 3)).abs().sum() == 0


def test_whitening_is_verls_masked_whiten():
    torch.manual_seed(1)
    x = torch.randn(4, 5, dtype=torch.float64)
    mask = torch.rand(4, 5) > 0.3
    kept = x[mask]
    want = (kept - kept.mean()) / torch.sqrt(kept.var(unbiased=True) + 1e-8)  # verl: unbiased var, rsqrt(var + 1e-8)
    out = masked_whiten(x, mask)
    torch.testing.assert_close(out[mask], want)
    assert (out[~mask] == 0).all()


def test_value_loss_and_its_gradient_are_verls_clipped_loss():
    torch.manual_seed(2)
    v = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old = torch.randn(3, 4, dtype=torch.float64)
    ret = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]])
    per_token, clipped = value_loss(v, old, ret, mask, 0.2)
    loss = per_token.sum() / mask.sum()
    loss.backward()
    # by hand, token by token: 0.5 max((v - R)^2, (clip(v, old - c, old + c) - R)^2), token-mean
    grads = torch.zeros(3, 4, dtype=torch.float64)
    total, clip_count = 0.0, 0
    for i in range(3):
        for t in range(4):
            if not mask[i, t]:
                continue
            x = torch.tensor(float(v[i, t]), dtype=torch.float64, requires_grad=True)
            low, high = float(old[i, t]) - 0.2, float(old[i, t]) + 0.2
            a, b = (x - ret[i, t]) ** 2, (torch.clamp(x, low, high) - ret[i, t]) ** 2
            value = 0.5 * torch.maximum(a, b) / int(mask.sum())
            value.backward()
            total += float(value)
            grads[i, t] = float(x.grad)
            clip_count += int(b > a)
    assert math.isclose(float(loss), total, rel_tol=1e-12)
    torch.testing.assert_close(v.grad, grads)
    assert int(clipped.sum()) == clip_count > 0
    unclipped, none = value_loss(v.detach(), old, ret, mask, None)
    torch.testing.assert_close(unclipped, 0.5 * (v.detach() - ret) ** 2 * mask)
    assert not none.any()


# --- ReMax, pass@k, per-function normalisation ---------------------------------------------------------------------
def test_remax_measures_each_reward_against_its_prompts_greedy_completion():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, NAN])
    greedy = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])  # each row: its prompt's greedy reward
    adv = estimate_advantages(rewards, 3, "remax", baselines=greedy)  # its own scale: none (verl's)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))
    # a group whose samples agree still learns where the greedy answer differs (no group baseline)
    adv = estimate_advantages(torch.tensor([1.0, 1.0]), 2, "remax", baselines=torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="greedy completion"):
        estimate_advantages(rewards, 3, "remax")


def test_pass_at_k_gives_only_each_groups_best_its_margin_over_the_second():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.2, 0.9, NAN, 0.5])
    adv = estimate_advantages(rewards, 4, "pass_at_k", "none")
    # by hand: group 0 best 1.0 (row 1) over 0.0; group 1 a tie (1.0, 1.0): margin 0; group 2 best 0.9 over 0.5
    torch.testing.assert_close(adv, torch.tensor([0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0.4, 0, 0]))
    # the group scale (the objective's, verl's norm_adv_by_std_in_grpo) divides by the group's std
    adv = estimate_advantages(rewards, 4, "pass_at_k")
    std0 = torch.tensor([0.0, 1.0, 0.0, 0.0]).std()
    std2 = torch.tensor([0.2, 0.9, 0.5]).std()
    torch.testing.assert_close(adv[[1, 9]], torch.tensor([1.0 / std0, 0.4 / std2]))
    assert adv[[0, 2, 3, 4, 5, 6, 7, 8, 10, 11]].abs().sum() == 0
    assert {"remax", "pass_at_k", "gae"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="per token"):
        estimate_advantages(rewards, 4, "gae")


def test_normalize_each_normalises_every_function_within_its_group_before_the_sum():
    answers = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]                       # group 2 all right: no signal from it
    lengths = [10.0, 20.0, 40.0, 5.0, 6.0, None]                   # a function on another scale; one None
    composer = RewardComposer({"answer": lambda prompts, completions, **kw: answers,
                               "length": lambda prompts, completions, **kw: lengths},
                              weights={"answer": 1.0, "length": 0.5}, aggregation="normalize_each")
    out = composer(["p"] * 6, ["c"] * 6, group_size=3)

    def z(values):  # by hand: (x - mean) / std over the group's valid values (unbiased), 0 for a flat group
        kept = [x for x in values if x is not None]
        mean = sum(kept) / len(kept)
        std = (sum((x - mean) ** 2 for x in kept) / (len(kept) - 1)) ** 0.5 if len(kept) > 1 else 0.0
        return [None if x is None else (0.0 if std < 1e-6 else (x - mean) / std) for x in values]

    want = []
    for g in range(2):
        za, zl = z(answers[3 * g:3 * g + 3]), z(lengths[3 * g:3 * g + 3])
        want += [a + 0.5 * (0.0 if b is None else b) for a, b in zip(za, zl)]
    torch.testing.assert_close(out.total, torch.tensor(want))
    # the logged reward is the raw weighted sum; without groups (validation) the sum is raw too
    assert math.isclose(float(out.metrics["reward"]), sum(a + 0.5 * (b or 0) for a, b in zip(answers, lengths)) / 6,
                        rel_tol=1e-6)
    raw = composer(["p"] * 6, ["c"] * 6)
    torch.testing.assert_close(raw.total, torch.tensor([a + 0.5 * (b or 0) for a, b in zip(answers, lengths)]))
    with pytest.raises(ValueError, match="reward.aggregation must be one of"):
        RewardComposer([lambda prompts, completions, **kw: answers], aggregation="mean")


# --- the critic in the module --------------------------------------------------------------------------------------
def test_ppo_trains_a_critic_beside_the_policy_and_warms_it_up_alone(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, objective="ppo", critic={"warmup_steps": 2, "lr": 1e-3})
    assert isinstance(module.critic, ValueModel) and module.experience.estimator == "gae"
    assert not any(p1 is p2 for p1, p2 in zip(module.critic.parameters(), module.policy.parameters()))
    policy0 = [p.detach().clone() for p in module.policy.parameters()]
    critic0 = [p.detach().clone() for p in module.critic.parameters()]
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    groups = t.optimizers[0].param_groups
    assert len(groups) == 2 and groups[1]["lr"] == 1e-3
    # warm-up: the critic moved, the policy (and its optimizer state) did not
    assert all(torch.equal(a, b) for a, b in zip(policy0, module.policy.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(critic0, module.critic.parameters()))
    assert not any(t.optimizers[0].state.get(p) for p in module.policy.parameters())
    logged = t.logged_metrics
    assert float(logged["train/critic/warmup"]) == 1 and float(logged["train/grad_norm"]) == 0
    assert float(logged["train/critic/value_loss"]) > 0 and float(logged["train/critic/grad_norm"]) > 0
    # after the warm-up both move
    t = trainer(tmp_path, steps=3, limit_val_batches=0)
    module.critic_config.warmup_steps = 0
    t.fit(module, datamodule=dm)
    assert any(not torch.equal(a, b) for a, b in zip(policy0, module.policy.parameters()))


def test_the_experience_carries_per_token_advantages_from_the_critics_values(tiny, arithmetic_rows):
    module, dm = make(tiny, arithmetic_rows, objective="ppo", critic={"lam": 0.9})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    module.critic.value_head.bias.data.fill_(0.25)  # a value of 0.25 everywhere
    exp, _ = module.make_experience(batch)
    mask = exp.completion_mask.bool()
    assert exp.advantages.shape == exp.values.shape == exp.returns.shape == mask.shape
    torch.testing.assert_close(exp.values[mask], torch.full((int(mask.sum()),), 0.25))
    total = module.rewards.combine(module.experience.last_scored["rewards"])
    adv, ret = gae(outcome_token_rewards(total, mask), exp.values, mask, 1.0, 0.9)
    torch.testing.assert_close(exp.returns[mask], ret[mask])
    torch.testing.assert_close(exp.advantages, masked_whiten(adv, mask))


def test_the_critic_checkpoints_its_activations_with_the_policy(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, objective="ppo", update={"gradient_checkpointing": True})
    assert module.critic.backbone.is_gradient_checkpointing and module.policy.is_gradient_checkpointing
    trainer(tmp_path, steps=1, limit_val_batches=0).fit(module, datamodule=dm)


def test_a_ppo_checkpoint_resumes_to_the_uninterrupted_runs_weights(arithmetic_rows, tmp_path):
    from polopt_lightning.models import build_tiny_model

    def fit(steps, ckpt=None, save=None):  # each run from a fresh copy of the same model
        tiny = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        module, dm = make(tiny, arithmetic_rows, objective="ppo", update={"mini_batches": 2}, seed=3)
        callbacks = [] if save is None else [L.pytorch.callbacks.ModelCheckpoint(dirpath=save, save_last=True,
                                                                                 every_n_train_steps=2)]
        t = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                      enable_checkpointing=save is not None, num_sanity_val_steps=0, limit_val_batches=0,
                      enable_model_summary=False)
        t.fit(module, datamodule=dm, ckpt_path=ckpt)
        return module

    whole = fit(4)
    fit(2, save=tmp_path / "ckpt")
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert any(k.startswith("critic.") for k in ckpt["state_dict"])
    resumed = fit(4, ckpt=tmp_path / "ckpt" / "last.ckpt")
    for name, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_a_lora_policys_critic_trains_its_own_adapters(quantization, tiny, arithmetic_rows, tmp_path):
    from polopt_lightning.models import as_adapter, as_quantization, prepare_policy

    model, tok = tiny
    policy = prepare_policy(model, as_quantization(quantization), as_adapter({"kind": "lora", "r": 4}))
    module, dm = make((policy, tok), arithmetic_rows, objective="ppo")
    trainable = {n for n, p in module.critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head") for n in trainable)
    frozen = {n: p.detach().clone() for n, p in module.critic.named_parameters() if not p.requires_grad}
    critic0 = {n: p.detach().clone() for n, p in module.critic.named_parameters() if p.requires_grad}
    trainer(tmp_path, steps=2, limit_val_batches=0).fit(module, datamodule=dm)
    params = dict(module.critic.named_parameters())
    assert all(torch.equal(v, params[n]) for n, v in frozen.items())
    assert any(not torch.equal(v, params[n]) for n, v in critic0.items() if "lora_B" in n)


def test_remax_draws_a_greedy_completion_of_each_prompt_for_its_baseline(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, experience={"advantage_estimator": "remax"})
    calls = []
    generate = module.engine.generate

    def counting(model, prompt_ids, *args, **kwargs):
        calls.append((prompt_ids.shape[0], args[1], args[2].temperature))
        return generate(model, prompt_ids, *args, **kwargs)

    module.engine.generate = counting
    t = trainer(tmp_path, steps=1, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert (4, 1, 0.0) in calls and (4, 4, 1.0) in calls  # 4 prompts: one greedy each, and the group of 4
    assert "train/greedy_reward" in t.logged_metrics


@pytest.mark.parametrize("kwargs,match", [
    ({"objective": "gspo", "experience": {"advantage_estimator": "gae"}},
     "advantage_estimator=gae gives an advantage per token, and the GSPO objective"),
    ({"critic_model": torch.nn.Linear(2, 1)}, "critic_model is given, but experience.advantage_estimator=grpo"),
    ({"objective": "ppo", "critic": {"gamma": 1.5}}, r"critic.gamma must be in \[0, 1\]"),
    ({"objective": "ppo", "critic": {"lr": 0}}, "critic.lr must be > 0 or None"),
])
def test_bad_critic_input_names_its_setting(tiny, arithmetic_rows, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(tiny, arithmetic_rows, **kwargs)


def test_the_critic_settings_default_as_verl():
    config = CriticConfig()
    assert (config.gamma, config.lam, config.value_clip, config.warmup_steps, config.whiten) == (1.0, 1.0, 0.5, 0, True)
    assert config.lr is None  # 10 x the policy's


def test_the_critics_learning_rate_follows_the_policys_unless_set(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, objective="ppo", optimizer={"lr": 2e-4})
    t = trainer(tmp_path, steps=1, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    groups = t.optimizers[0].param_groups
    assert groups[0]["lr"] == 2e-4 and math.isclose(groups[1]["lr"], 2e-3)


# --- per-turn credit -----------------------------------------------------------------------------------------------
def test_turn_returns_discount_each_turns_reward_back_to_the_turns_before():
    from polopt_lightning.step.advantages import spread_turns, turn_index, turn_returns, turn_token_rewards

    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1],      # three turns (tool results between them)
                         [1, 1, 1, 0, 0, 0, 0, 0]])     # one turn
    index = turn_index(mask)
    assert index.tolist() == [[0, 0, -1, -1, 1, -1, 2, 2], [0, 0, 0, -1, -1, -1, -1, -1]]
    turn_rewards = torch.tensor([[0.5, NAN, 0.25], [0.1, NAN, NAN]])
    outcome = torch.tensor([1.0, 2.0])
    R = turn_returns(outcome, turn_rewards, torch.tensor([3, 1]), gamma=0.5)
    # by hand: r = (0.5, 0, 0.25 + 1); R_2 = 1.25, R_1 = 0 + 0.5 * 1.25, R_0 = 0.5 + 0.5 * R_1; row 2: 0.1 + 2
    torch.testing.assert_close(R[0], torch.tensor([0.5 + 0.5 * 0.625, 0.625, 1.25]))
    assert math.isclose(float(R[1, 0]), 2.1, rel_tol=1e-6) and R[1, 1:].isnan().all()
    spread = spread_turns(R, index)
    assert spread[0].tolist() == [float(R[0, 0])] * 2 + [0, 0, float(R[0, 1]), 0] + [float(R[0, 2])] * 2
    # with the critic: each turn's reward on its last token, the outcome on the last policy token
    tokens = turn_token_rewards(outcome, turn_rewards, mask)
    torch.testing.assert_close(tokens, torch.tensor([[0, 0.5, 0, 0, 0, 0, 0, 1.25], [0, 0, 2.1, 0, 0, 0, 0, 0]]))


def test_per_turn_advantages_compare_each_turn_with_the_same_turn_of_its_group(tiny):
    from polopt_lightning.rollout import RolloutBatch
    from polopt_lightning.step.experience import ExperienceMaker

    model, tok = tiny
    G = 3
    # three completions of one prompt: turns (2, 2, 1), turn rewards for the first turns, outcomes 1, 0, 0.5
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 0]])
    rollout = RolloutBatch(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                           completion_ids=torch.full((3, 4), 5), completion_mask=mask,
                           sampling_logprobs=torch.zeros(3, 4), finished=torch.ones(3, dtype=torch.bool), group_size=G,
                           context_mask=torch.ones(3, 4, dtype=torch.long), conversations=[[], [], []],
                           extras={"turn_rewards": [[0.2, None], [0.0, None], [None]], "env_reward": [0.2, 0.0, 0.0],
                                   "tool_calls": [1, 1, 0]})
    outcomes = [1.0, 0.0, 0.5]
    composer = RewardComposer([lambda prompts, completions, **kw: outcomes])
    maker = ExperienceMaker(tok, composer, {"num_generations": G, "turn_credit": "turn", "turn_discount": 0.9})
    batch = {"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompts": ["p"], "columns": {}}
    exp, _ = maker.make(batch, lambda b: rollout, lambda: None, torch.device("cpu"))
    # by hand: turn 0's returns 0.2 + 0.9 * 1, 0 + 0.9 * 0, 0.5 over all three; turn 1's 1.0, 0.0 over the first two
    first = torch.tensor([0.2 + 0.9, 0.0, 0.5])
    first = (first - first.mean()) / first.std()
    second = torch.tensor([1.0, 0.0])
    second = (second - second.mean()) / second.std()
    want = torch.tensor([[first[0], first[0], 0, second[0]], [first[1], 0, 0, second[1]], [first[2]] * 3 + [0]])
    torch.testing.assert_close(exp.advantages, want)
    # per episode: one advantage a completion, the outcome's (the environment's rewards are the reward functions' to give)
    episode = ExperienceMaker(tok, composer, {"num_generations": G})
    exp, _ = episode.make(batch, lambda b: rollout, lambda: None, torch.device("cpu"))
    assert exp.advantages.shape == (3,)


def test_per_turn_credit_needs_an_objective_that_takes_token_advantages(tiny, arithmetic_rows):
    with pytest.raises(ValueError, match="experience.turn_credit=turn gives each turn's tokens"):
        make(tiny, arithmetic_rows, objective="gspo", experience={"turn_credit": "turn"})
    with pytest.raises(ValueError, match="experience.turn_credit=turn: the remax estimator"):
        make(tiny, arithmetic_rows, experience={"turn_credit": "turn", "advantage_estimator": "remax"})


def test_a_value_head_on_the_policys_own_trunk_trains_the_trunk_by_value_coef(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, objective="ppo", critic={"share_trunk": True, "value_coef": 0.5})
    assert module.critic.backbone is module.policy.model  # no copy
    # the trunk is the policy's: saved (and sharded, quantized, loaded) there once, the critic's own weights the head's
    assert {k for k in module.state_dict() if k.startswith("critic.")} == {"critic.value_head.weight",
                                                                           "critic.value_head.bias"}
    assert [id(p) for p in module.updater.critic_params] == [id(p) for p in module.critic.value_head.parameters()]
    dm.setup("fit")
    exp, _ = module.make_experience(next(iter(dm.train_dataloader())))
    rows = torch.arange(exp.completion_ids.shape[0])
    module.critic.value_head.weight.data.normal_(0, 0.1)  # a head that passes a gradient back to the trunk

    def trunk_grads(coef):
        module.policy.zero_grad(set_to_none=True)
        module.critic.zero_grad(set_to_none=True)
        module.updater.terms[-1].coef = coef
        module.accumulate_gradients(exp, rows)
        return torch.cat([p.grad.flatten() for p in module.policy.model.layers[0].parameters()])

    none, half, whole = trunk_grads(0.0), trunk_grads(0.5), trunk_grads(1.0)
    value = whole - none  # the value loss's own gradient on the trunk, linear in its weight
    assert value.abs().max() > 1e-6
    torch.testing.assert_close(half - none, value / 2, rtol=1e-4, atol=1e-7)
    # and a fit: the head alone in the optimizer's second group (the trunk is the policy's, in the first)
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert len(t.optimizers[0].param_groups[1]["params"]) == 2


def test_a_critic_from_a_saved_model_takes_its_trunk(tiny, arithmetic_rows, tmp_path):
    model, tok = tiny
    from polopt_lightning.models import build_tiny_model

    other, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=7)
    other.save_pretrained(tmp_path / "value")
    module, _ = make(tiny, arithmetic_rows, objective="ppo", critic={"name_or_path": str(tmp_path / "value")})
    torch.testing.assert_close(module.critic.backbone.embed_tokens.weight, other.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="critic.share_trunk=true puts the value head on the policy's trunk"):
        make(tiny, arithmetic_rows, objective="ppo", critic={"name_or_path": "x", "share_trunk": True})


@pytest.mark.parametrize("overrides,message", [
    (["objective=gspo", "experience.advantage_estimator=gae"], "advantage_estimator=gae gives an advantage per token"),
    (["objective=gspo", "experience.turn_credit=turn"], "experience.turn_credit=turn gives each turn's tokens"),
    (["objective=ppo", "critic.share_trunk=true", "strategy=fsdp"], "critic.share_trunk=true under strategy=fsdp"),
    (["objective=ppo", "critic.share_trunk=true", "critic.name_or_path=/some/model"],
     "critic.share_trunk=true puts the value head on the policy's trunk"),
    (["objective=ppo", "critic.name_or_path=/nonexistent/critic"],
     r"critic.name_or_path='/nonexistent/critic': no such folder .* not a hub id"),
])
def test_the_command_line_refuses_a_critic_that_cannot_work_before_anything_loads(overrides, message, tmp_path,
                                                                                   monkeypatch):
    from polopt_lightning import cli

    from .helpers import FAST, compose_with, set_hydra

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(cli, "_warm_start", loaded)
    monkeypatch.setattr("polopt_lightning.models.build_tiny_model", loaded)  # conf/model/tiny.yaml's target
    cfg = compose_with(FAST + overrides, tmp_path)
    set_hydra(cfg)
    with pytest.raises(cli.ConfigError, match=message):  # the one line naming the key
        cli.train(cfg)


def test_a_critic_warm_up_as_long_as_the_run_is_said(tmp_path, monkeypatch, caplog):
    """``critic.warmup_steps`` at or beyond ``trainer.max_steps`` trains the critic alone all run: said as it starts."""
    import logging

    from polopt_lightning import cli

    from .helpers import FAST, compose_with, set_hydra

    def loaded(*args, **kwargs):
        raise AssertionError("stop here: the settings are checked")

    monkeypatch.setattr(cli, "_warm_start", loaded)
    for steps, said in ((4, True), (6, False)):
        cfg = compose_with(FAST + ["objective=ppo", "critic.warmup_steps=4", f"trainer.max_steps={steps}"],
                           tmp_path / str(steps))
        set_hydra(cfg)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polopt_lightning"), pytest.raises(AssertionError, match="stop"):
            cli.train(cfg)
        assert ("critic.warmup_steps=4 >= trainer.max_steps=4: every step trains the critic alone" in caplog.text) == said


def test_a_reward_functions_per_turn_rewards_go_to_their_turns(tiny):
    from polopt_lightning.rollout import RolloutBatch
    from polopt_lightning.step.experience import ExperienceMaker

    model, tok = tiny
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 0]])
    rollout = RolloutBatch(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                           completion_ids=torch.full((3, 4), 5), completion_mask=mask,
                           sampling_logprobs=torch.zeros(3, 4), finished=torch.ones(3, dtype=torch.bool), group_size=3,
                           context_mask=torch.ones(3, 4, dtype=torch.long), conversations=[[], [], []],
                           extras={"turn_rewards": [[0.2, None], [None, None], [None]], "env_reward": [0.2, 0, 0],
                                   "tool_calls": [1, 1, 0]})
    # an outcome, and a function that rewards each turn (a list per completion: its sum is the completion's reward)
    composer = RewardComposer({"answer": lambda prompts, completions, **kw: [1.0, 0.0, 0.5],
                               "format": lambda prompts, completions, **kw: [[0.1, 0.3], [0.0, None], [0.4]]},
                              weights={"answer": 1.0, "format": 0.5})
    out = composer(["p"] * 3, ["c"] * 3)
    torch.testing.assert_close(out.per_function[:, 1], torch.tensor([0.4, 0.0, 0.4]))
    assert out.turns == [[0.05, 0.15], [0.0, 0.0], [0.2]]
    maker = ExperienceMaker(tok, composer, {"num_generations": 3, "turn_credit": "turn", "turn_discount": 1.0})
    batch = {"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompts": ["p"], "columns": {}}
    exp, _ = maker.make(batch, lambda b: rollout, lambda: None, torch.device("cpu"))
    # by hand: turn rewards = the environment's + 0.5 x the function's; the outcome on the last turn
    first = torch.tensor([0.2 + 0.05 + 0.15 + 1.0, 0.0 + 0.0 + 0.0, 0.2 + 0.5])
    first = (first - first.mean()) / first.std()
    second = torch.tensor([0.15 + 1.0, 0.0])
    second = (second - second.mean()) / second.std()
    want = torch.tensor([[first[0], first[0], 0, second[0]], [first[1], 0, 0, second[1]], [first[2]] * 3 + [0]])
    torch.testing.assert_close(exp.advantages, want)
    with pytest.raises(Exception, match="per-turn rewards .* expected finite floats or None"):
        RewardComposer([lambda prompts, completions, **kw: [["x"]]])(["p"], ["c"])


def test_per_turn_credit_keeps_the_reward_of_a_turn_the_environment_never_answered(tiny):
    from polopt_lightning.rollout import RolloutBatch
    from polopt_lightning.step.advantages import turn_returns, turn_token_rewards
    from polopt_lightning.step.experience import ExperienceMaker

    # two policy turns, one environment answer: the last turn was cut by the token budget
    R = turn_returns(torch.tensor([1.0, 0.0]), torch.tensor([[0.5], [0.0]]), torch.tensor([2, 2]))
    torch.testing.assert_close(R, torch.tensor([[1.5, 1.0], [0.0, 0.0]]))
    # a reward for a turn past the completion's last goes to its last turn (here: to the outcome's token)
    mask = torch.tensor([[1, 1, 0, 0]])
    torch.testing.assert_close(turn_token_rewards(torch.tensor([1.0]), torch.tensor([[0.25, 0.5]]), mask),
                               torch.tensor([[0.0, 1.75, 0.0, 0.0]]))
    # a rollout of one turn (no environment) under per-turn credit: the episode's advantages, on every token
    model, tok = tiny
    rollout = RolloutBatch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                           completion_ids=torch.full((2, 3), 5), completion_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                           sampling_logprobs=torch.zeros(2, 3), finished=torch.ones(2, dtype=torch.bool), group_size=2)
    composer = RewardComposer([lambda prompts, completions, **kw: [1.0, 0.0]])
    maker = ExperienceMaker(tok, composer, {"num_generations": 2, "turn_credit": "turn"})
    batch = {"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompts": ["p"], "columns": {}}
    exp, _ = maker.make(batch, lambda b: rollout, lambda: None, torch.device("cpu"))
    a = 1 / torch.tensor([1.0, 0.0]).std()
    torch.testing.assert_close(exp.advantages, torch.tensor([[a / 2, a / 2, a / 2], [-a / 2, -a / 2, 0]]))
