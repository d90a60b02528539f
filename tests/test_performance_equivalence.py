"""The speed levers change no result: loss and gradients with every optimisation on equal the plain computation."""

import copy
from functools import partial

import pytest
import torch

from polopt_lightning import PolicyOptimizationModule
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.step.logprobs import (
    PACKED_MAX_TOKENS,
    completion_logprobs,
    selective_log_softmax,
    shared_prompt_completion_logprobs,
)
from polopt_lightning.step.update import mini_batch_order

from .helpers.step import tiny_rollout, varied


def experience(objective, mini_batches=1, num_iterations=1):
    module, exp, _ = tiny_rollout(objective, update={"mini_batches": mini_batches, "num_iterations": num_iterations})
    with torch.no_grad():
        if module.off_policy:
            exp.old_logprobs = exp.sampling_logprobs + 0.05 * torch.randn_like(exp.sampling_logprobs)
        if module.objective.beta > 0:
            exp.ref_logprobs = module.scorer.logprobs(module.ref_model, exp, slice(None))[0]
    return module, exp


def gradients(module, exp, rows, **settings):
    module = copy.deepcopy(module)
    for key, value in settings.items():  # the update's settings
        setattr(module.update_config, key, value)
    metrics = module.accumulate_gradients(exp, rows)
    return metrics, {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", [
    {"name": "grpo", "beta": 0.04},
    {"name": "dapo"},
    {"name": "dr_grpo", "max_completion_length": 6},
    {"name": "gspo", "beta": 0.02, "clip_low": 0.05, "clip_high": 0.05},
])
@pytest.mark.parametrize("pack_groups", [False, True])
def test_all_levers_on_equal_plain_computation(objective, pack_groups):
    module, exp = experience(objective, mini_batches=2)
    rows = torch.tensor([0, 5, 1, 7, 11, 2, 8])  # a shuffled mini-batch that splits groups
    plain_metrics, plain = gradients(module, exp, rows, share_prompt=False, micro_batch_tokens=None)
    fast_metrics, fast = gradients(module, exp, rows, share_prompt=True, micro_batch_tokens=40,
                                   pack_groups=pack_groups)
    assert plain.keys() == fast.keys() and plain
    torch.testing.assert_close(fast_metrics["loss"], plain_metrics["loss"], atol=1e-6, rtol=1e-5)
    for name in plain:
        torch.testing.assert_close(fast[name], plain[name], atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in plain.values())


def test_micro_batching_splits_and_still_matches():
    module, exp = experience({"name": "grpo"})
    rows = torch.arange(12)
    module.update_config.micro_batch_tokens = 30
    assert len(module.updater.micro_batches(exp, rows)) > 2
    _, whole = gradients(module, exp, rows, micro_batch_tokens=None, share_prompt=False)
    _, split = gradients(module, exp, rows, micro_batch_tokens=30, share_prompt=False)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_micro_batches_go_by_length_and_trim_their_own_padding(share_prompt):
    """Longest first, each piece at its own width and filled to the token budget; the gradient does not change."""
    module, exp = experience({"name": "grpo", "beta": 0.04}, mini_batches=2)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4, 2, 1, 3, 1])
    exp.completion_mask = (torch.arange(exp.completion_mask.shape[1])[None] < lengths[:, None]).long()
    rows = torch.tensor([3, 0, 11, 7, 1, 9, 4, 2, 10, 5, 8, 6])
    budget = 3 * (exp.prompt_ids.shape[1] + 6)
    module.update_config.share_prompt, module.update_config.micro_batch_tokens = share_prompt, budget
    pieces = module.updater.micro_batches(exp, rows)
    assert sorted(torch.cat(pieces).tolist()) == list(range(12))
    widths = [int(lengths[p].max()) for p in pieces]
    assert len(set(widths)) > 1 and len(pieces) < 12
    for p, w in zip(pieces, widths):
        assert len(p) * (exp.prompt_ids.shape[1] + w) <= budget
    if share_prompt:  # groups (4 rows each) stay together and go by their longest completion
        order = exp.group_index[torch.cat(pieces)].tolist()
        assert order == sorted(order, key=lambda g: (-int(lengths[exp.group_index == g].max()), -g))
    else:
        assert widths == sorted(widths, reverse=True)
    _, whole = gradients(module, exp, rows, micro_batch_tokens=None)
    metrics, split = gradients(module, exp, rows, micro_batch_tokens=budget)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_each_micro_batch_is_as_full_as_the_budget_allows(share_prompt):
    """Greedy filling: a piece closes only when the next row would break the budget at the widened width; a completion
    of one token (or none) counts as one, so pieces of them hold exactly ``budget // (prompt + 1)`` rows. With
    ``share_prompt`` the rows go group by group, each group whole, the group of the longest completion first (the last
    case tells apart a sort key that mixes the group index into the length)."""
    module, exp = experience({"name": "grpo"})
    prompt = exp.prompt_ids.shape[1]
    module.update_config.share_prompt = share_prompt
    rows = torch.arange(12)
    for lengths, budget in [([1, 6, 2, 5, 3, 6, 1, 4, 2, 1, 3, 1], 3 * (prompt + 6) + 2),
                            ([3, 0, 5, 2, 6, 6, 1, 4, 2, 5, 3, 1], 2 * (prompt + 5)),
                            ([1] * 12, 4 * (prompt + 1)),
                            ([6, 1, 1, 1, 2, 2, 2, 2, 5, 1, 1, 1], 2 * (prompt + 6))]:
        lengths = torch.tensor(lengths)
        exp.completion_mask = (torch.arange(exp.completion_mask.shape[1])[None] < lengths[:, None]).long()
        module.update_config.micro_batch_tokens = budget
        pieces = module.updater.micro_batches(exp, rows)
        counted = lengths.clamp(min=1)
        for piece, following in zip(pieces, pieces[1:]):
            width = int(counted[piece].max())
            assert len(piece) * (prompt + width) <= budget
            assert (len(piece) + 1) * (prompt + max(width, int(counted[following[0]]))) > budget, (lengths, pieces)
        if lengths.max() == 1:
            assert [len(p) for p in pieces] == [4, 4, 4]
        if share_prompt:
            groups = exp.group_index[torch.cat(pieces)]
            changes = int((groups[1:] != groups[:-1]).sum())
            assert changes == 2, (lengths, pieces)  # three groups, each contiguous
            longest = [int(counted[exp.group_index == g].max()) for g in groups.unique_consecutive()]
            assert longest == sorted(longest, reverse=True), (lengths, pieces)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_the_mini_batch_order_is_a_permutation_drawn_from_its_seed_alone(share_prompt):
    """The same seed gives the same order whatever the global random state (a resumed run shuffles as the first did),
    different seeds give different orders; with ``share_prompt`` each group's rows are contiguous, the groups and the
    rows inside each group shuffled."""
    group = torch.arange(6).repeat_interleave(4)
    torch.manual_seed(1)
    first = mini_batch_order(group, 7, share_prompt)
    torch.manual_seed(2)
    torch.rand(3)
    assert mini_batch_order(group, 7, share_prompt).tolist() == first.tolist()
    orders = [mini_batch_order(group, seed, share_prompt) for seed in range(8)]
    assert all(sorted(o.tolist()) == list(range(24)) for o in orders)
    assert len({tuple(o.tolist()) for o in orders}) == 8
    if share_prompt:
        runs = [[int(g) for g in group[o]][::4] for o in orders]
        assert all(group[o].view(6, 4).eq(group[o][::4, None]).all() for o in orders)  # whole groups, one after another
        assert len({tuple(r) for r in runs}) > 1
        assert len({tuple(o[(group[o] == 0)].tolist()) for o in orders}) > 1  # rows inside group 0 reordered


def test_sampling_logprobs_match_the_training_numerics():
    """Why reusing them as old log-probs is sound: they equal a training-mode forward (dropout off)."""
    module, exp = experience({"name": "gspo"}, mini_batches=2)
    module.policy.train()
    with torch.no_grad():
        fresh = module.scorer.logprobs(module.policy, exp, slice(None))[0]
    m = exp.completion_mask.bool()
    torch.testing.assert_close(fresh[m], exp.sampling_logprobs[m], atol=1e-5, rtol=1e-5)


def test_shared_prompt_logprobs_equal_plain():
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    enc = tok(["1+1=", "22+33=", "7="], padding=True, return_tensors="pt")
    b = HFRolloutEngine().generate(model, enc.input_ids, enc.attention_mask, 3, SamplingConfig(max_new_tokens=5),
                                   tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    group = torch.arange(3).repeat_interleave(3)
    plain, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)
    shared, _ = shared_prompt_completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids,
                                                  b.completion_mask, group)
    m = b.completion_mask.bool()
    torch.testing.assert_close(shared[m], plain[m], atol=1e-5, rtol=1e-5)


def test_packed_groups_give_the_plain_logprobs_entropies_and_gradients():
    """Left-padded prompts of different lengths, completions cut by EOS (padding after it), rows out of order and an
    uneven group (one of its rows in another mini-batch): the packed pass against one row per completion."""
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    enc = tok(["1+1=", "22+33=", "7="], padding=True, return_tensors="pt")
    b = HFRolloutEngine().generate(model, enc.input_ids, enc.attention_mask, 4, SamplingConfig(max_new_tokens=6),
                                   tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 2, 5, 1, 6, 3, 6, 4, 2, 6, 1, 5])  # completions ended early: padding after them
    c_mask = (torch.arange(6)[None] < lengths[:, None]).long()
    c_ids = b.completion_ids.masked_fill(c_mask == 0, tok.pad_token_id)
    assert not enc.attention_mask.all()  # left-padded prompts too
    rows = torch.tensor([5, 0, 9, 3, 1, 11, 4, 2, 10, 8, 6])  # group 1 lacks row 7
    args = (b.prompt_ids[rows], b.prompt_mask[rows], c_ids[rows], c_mask[rows])
    group = torch.arange(3).repeat_interleave(4)[rows]
    m = args[3].bool()
    results = []
    packed = partial(shared_prompt_completion_logprobs, group_index=group, packed=True)
    for fn in (completion_logprobs, packed):
        model.zero_grad(set_to_none=True)
        logp, entropy = fn(model, *args, temperature=0.7, with_entropy=True)
        (logp[m] * torch.linspace(-1, 1, int(m.sum()))).sum().backward()
        results.append((logp.detach()[m], entropy[m], {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_entropy, plain_grads), (packed, packed_entropy, packed_grads) = results
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, plain_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_groups_are_packed_where_it_pays_and_the_model_takes_the_mask(monkeypatch):
    import polopt_lightning.step.logprobs as scorer_code

    module, exp = experience({"name": "grpo"})
    calls = []
    monkeypatch.setattr(scorer_code, "shared_prompt_completion_logprobs",
                        lambda *a, **k: calls.append(k["packed"]) or shared_prompt_completion_logprobs(*a, **k))
    with torch.no_grad():
        module.scorer.logprobs(module.policy, exp, slice(None))
    assert calls == [True]  # the default: 3 groups of 4 short completions
    groups, width, prompt_len = exp.group_index, exp.completion_ids.shape[1], exp.prompt_ids.shape[1]
    assert module.scorer.packs(module.policy, prompt_len, width, groups)
    long_width = (PACKED_MAX_TOKENS - prompt_len) // 4 + 2  # one packed group over the bound
    assert not module.scorer.packs(module.policy, prompt_len, long_width, groups)
    module.update_config.pack_groups = True
    assert module.scorer.packs(module.policy, prompt_len, long_width, groups)
    assert module.scorer.packs(module.policy, prompt_len, width, groups[:-2])  # uneven groups, forced
    module.update_config.pack_groups = None
    assert not module.scorer.packs(module.policy, prompt_len, width, groups[torch.tensor([0, 4, 8, 9])])  # 6 slots, 4 rows
    module.update_config.pack_groups = False
    assert not module.scorer.packs(module.policy, prompt_len, width, groups)
    module.update_config.pack_groups = None
    config = module.policy.config
    monkeypatch.setattr(config, "_attn_implementation", "eager")
    assert not module.scorer.packs(module.policy, prompt_len, width, groups)
    monkeypatch.setattr(config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(config, "layer_types", ["full_attention", "sliding_attention"])
    assert not module.scorer.packs(module.policy, prompt_len, width, groups)


def test_logprob_memory_stays_flat_with_a_150k_vocabulary():
    """Chunked log-probs: the float32 working set is chunk x V, not B x T x V, however long the batch."""
    V, chunk = 150_000, 64
    index = torch.randint(0, V, (4, 128))
    logits = torch.randn(4, 128, V, dtype=torch.bfloat16)  # what a bf16 model returns

    # record the largest float32 intermediate the computation makes
    sizes = []
    real_lse = torch.logsumexp

    def spy(x, *a, **k):
        sizes.append(x.numel() * x.element_size())
        return real_lse(x, *a, **k)

    torch.logsumexp = spy
    try:
        lp, _ = selective_log_softmax(logits, index, chunk_rows=chunk)
    finally:
        torch.logsumexp = real_lse
    assert max(sizes) == chunk * V * 4  # one fp32 chunk, independent of B*T = 512 rows
    full = torch.log_softmax(logits[:1, :8].float(), -1).gather(-1, index[:1, :8, None]).squeeze(-1)
    torch.testing.assert_close(lp[:1, :8], full, atol=1e-4, rtol=1e-4)


def test_gradient_checkpointing_recomputes_the_layers_and_keeps_the_gradient():
    module, exp = experience({"name": "grpo", "beta": 0.04}, mini_batches=2)
    rows = torch.tensor([0, 5, 1, 7, 11, 2, 8])
    module.policy.train()
    plain_metrics, plain = gradients(module, exp, rows)  # shared prompt, layers not checkpointed
    ckpt = PolicyOptimizationModule(copy.deepcopy(module.policy), module.tokenizer, objective=module.objective,
                                    reward_fns=[varied], experience={"num_generations": 4}, update={"gradient_checkpointing": True})
    assert all(layer.gradient_checkpointing for layer in ckpt.policy.model.layers)
    calls = []
    # a pre-hook: the recomputation stops as soon as the saved tensors are back, before the MLP returns
    ckpt.policy.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    metrics = ckpt.accumulate_gradients(exp, rows)
    assert calls == [True, True]  # the forward, then its recomputation in the backward pass
    torch.testing.assert_close(metrics["loss"], plain_metrics["loss"], atol=1e-6, rtol=1e-5)
    for name, p in ckpt.policy.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], atol=1e-6, rtol=1e-4, msg=name)
    calls.clear()
    with torch.no_grad():  # a pass without gradient keeps the shared prompt: its groups packed, one call
        ckpt.scorer.logprobs(ckpt.policy, exp, slice(None))
    assert calls == [False]
    calls.clear()
    ckpt.update_config.pack_groups = False
    with torch.no_grad():  # unpacked: the prompt's forward once per group, then the completions'
        ckpt.scorer.logprobs(ckpt.policy, exp, slice(None))
    assert calls == [False, False]
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        PolicyOptimizationModule(torch.nn.Linear(2, 2), module.tokenizer, reward_fns=[varied],
                                 update={"gradient_checkpointing": True})


def test_a_later_mini_batch_under_autocast_sees_the_updated_weights():
    """Lightning's bf16-mixed runs the whole training_step under one autocast context, whose cache keeps a bf16 copy
    of each trainable weight from its first use. After the first mini-batch's update the second one's forward must
    run on the new weights, not on that cached copy from before the update."""
    module, exp = experience({"name": "grpo", "beta": 0.04}, mini_batches=2)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    first, second = torch.arange(0, 6), torch.arange(6, 12)
    module.policy.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module.updater.step(exp, first, optimizer, scheduler)
        inside = module.scorer.logprobs(module.policy, exp, second)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a fresh context casts the current weights
        fresh = module.scorer.logprobs(module.policy, exp, second)[0]
    assert torch.equal(inside, fresh)
