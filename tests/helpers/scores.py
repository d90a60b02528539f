"""Shared by the fused-head and padding-free tests: rows as a rollout makes them, and the log-probs, entropies and
gradients a pass gives on them."""

import torch


def rollout_rows(model, tok):
    """Left-padded prompts, completions ended early (padding after them), rows out of order and an uneven group, and a
    multi-turn row's tool result inside the completion (attended to; the objective's mask leaves it out)."""
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

    enc = tok(["1+1=", "22+33=", "7="], padding=True, return_tensors="pt")
    b = HFRolloutEngine().generate(model, enc.input_ids, enc.attention_mask, 4, SamplingConfig(max_new_tokens=6),
                                   tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 2, 5, 1, 6, 3, 6, 4, 2, 6, 1, 5])
    c_mask = (torch.arange(6)[None] < lengths[:, None]).long()
    c_ids = b.completion_ids.masked_fill(c_mask == 0, tok.pad_token_id)
    loss_mask = c_mask.clone()
    loss_mask[0, 2:4] = 0  # a tool's result in row 0: attended to, not trained on
    rows = torch.tensor([5, 0, 9, 3, 1, 11, 4, 2, 10, 8, 6])  # group 1 lacks row 7
    group = torch.arange(3).repeat_interleave(4)[rows]
    return (b.prompt_ids[rows], b.prompt_mask[rows], c_ids[rows], c_mask[rows]), group, loss_mask[rows].bool()


def scores_and_gradients(model, fn, args, m):
    """``fn``'s log-probs and entropies at 0.7 on the rows ``args`` where ``m``, and the gradients of a loss of both."""
    model.zero_grad(set_to_none=True)
    logp, entropy = fn(model, *args, temperature=0.7, with_entropy=True)
    loss = (logp[m] * torch.linspace(-1, 1, int(m.sum()))).sum() + 0.1 * entropy[m].sum()
    loss.backward()
    return (logp.detach()[m], entropy.detach()[m],
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def assert_same_scores(got, expected):
    """Log-probs, entropies and every gradient within 1e-5."""
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    assert got[2].keys() == expected[2].keys() and expected[2]
    for n, grad in expected[2].items():
        torch.testing.assert_close(got[2][n], grad, atol=1e-5, rtol=1e-5, msg=n)
