"""Levers for real-scale models (0.5B, 152k-token vocabularies): the inverse-CDF sampler, clipping with the norm
already measured and a contiguous input to the language-model head. None changes a loss or gradient (the clip: not a
bit; the head's input: within float tolerance, its product may round in another order; the sampler draws from the
same distribution)."""

import copy

import pytest
import torch

from polopt_lightning.rollout.base import INVERSE_CDF_VOCAB, sample_tokens
from polopt_lightning.step.update import grad_norm, scale_gradients


def test_inverse_cdf_sampler_draws_the_distribution_and_never_a_zero_probability_token():
    V = INVERSE_CDF_VOCAB + 5
    probs = torch.zeros(V)
    probs[[3, 1000, V - 1]] = torch.tensor([0.5, 0.3, 0.2])
    rows = probs.expand(1_000, V)
    # 40k draws in chunks of 1,000 rows: sample_tokens makes a float64 copy and its cumulative sum of each chunk
    # (0.5 GB here; 40,000 rows at once would need 21 GB)
    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([sample_tokens(rows, g) for _ in range(40)])
    assert set(tokens.tolist()) <= {3, 1000, V - 1}
    shares = torch.bincount(tokens, minlength=V)[[3, 1000, V - 1]].float() / len(tokens)
    assert torch.allclose(shares, torch.tensor([0.5, 0.3, 0.2]), atol=0.01)  # 40k draws: sd ~0.0025
    # every row its own distribution; the same generator state gives the same tokens
    peaked = torch.full((4, V), 0.1 / V)  # four rows of torch.eye(V) (4 GiB whole) * 0.9, plus 0.1 spread
    peaked[torch.arange(4), torch.arange(4)] += 0.9
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
    norm = grad_norm(model)
    scale_gradients(model, max_norm, norm)
    expected = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))


def _autograd_log_softmax(logits, index, temperature, rows, with_entropy):
    """The chunked computation through autograd (what selective_log_softmax did before its own backward)."""
    flat, idx = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
    out, ent = [], []
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start:start + rows].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        lse = torch.logsumexp(chunk, dim=-1)
        out.append(chunk.gather(-1, idx[start:start + rows, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                ent.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    return torch.cat(out).view(index.shape), (torch.cat(ent).view(index.shape) if with_entropy else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_have_autograds_bits_values_and_gradients(dtype, temperature):
    from polopt_lightning.step.logprobs import selective_log_softmax

    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype)
    index = torch.randint(0, 50, (3, 7))
    weights = torch.randn(3, 7)
    results = []
    for fn in (selective_log_softmax, _autograd_log_softmax):
        x = logits.clone().requires_grad_(True)
        lp, ent = fn(x, index, temperature, 4, True)  # 21 rows in chunks of 4
        (lp * weights).sum().backward()
        results.append((lp.detach(), ent, x.grad))
    for got, expected in zip(*results):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_chunked_log_probs_at_a_152k_vocabulary_stay_within_their_chunk():
    """At Qwen2.5's vocabulary each chunk is 55 rows (32 MiB in float32), and the values and gradients are those of a
    full log_softmax."""
    from polopt_lightning import logprobs

    V = 151936
    torch.manual_seed(0)
    logits = torch.randn(2, 64, V, requires_grad=True)
    index = torch.randint(0, V, (2, 64))
    sizes, real = [], torch.logsumexp

    def spy(x, *a, **k):
        sizes.append(x.numel() * x.element_size())
        return real(x, *a, **k)

    torch.logsumexp = spy
    try:
        lp, ent = logprobs.selective_log_softmax(logits, index, with_entropy=True)
    finally:
        torch.logsumexp = real
    assert logprobs.CHUNK_ELEMENTS // V == 55 and max(sizes) == 55 * V * 4 and len(sizes) == 3  # 128 rows: 55+55+18
    lp.sum().backward()
    log_p = torch.log_softmax(logits.detach(), -1)
    torch.testing.assert_close(lp.detach(), log_p.gather(-1, index[..., None]).squeeze(-1))
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1), atol=1e-4, rtol=1e-5)
    expected = -log_p.exp()
    expected.scatter_add_(-1, index[..., None], torch.ones(2, 64, 1))
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_gets_a_contiguous_input_and_the_values_of_an_int_logits_to_keep(dtype):
    """The training and reference passes and the rollout's prefill keep the last positions by index: the head sees a
    contiguous input (a sliced view sends frozen bf16 weights through a batched product on an expanded copy of the
    weight, 10-80x slower on the CPU; see ``_hf.last_positions``) and computes what ``logits_to_keep=n`` computes."""
    from polopt_lightning._hf import positions_from_mask
    from polopt_lightning.accel.cpu.decode import PackedProjections
    from polopt_lightning.accel.lean_step import llama_like
    from polopt_lightning.models import build_tiny_model
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
    from polopt_lightning.step.logprobs import completion_logprobs, shared_prompt_completion_logprobs

    model, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, vocab_size=128)
    model = model.to(dtype).eval().requires_grad_(False)  # a frozen reference copy or sampler
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    g = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = torch.randint(0, 128, (4, 6), generator=g), torch.randint(0, 128, (4, 5), generator=g)
    prompt_mask, completion_mask = torch.ones(4, 6, dtype=torch.long), torch.ones(4, 5, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    with torch.no_grad():
        plain = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
        shared = shared_prompt_completion_logprobs(model, prompt_ids[[0, 0, 2, 2]], prompt_mask[[0, 0, 2, 2]],
                                                   completion_ids, completion_mask, torch.tensor([0, 0, 1, 1]))[0]
        HFRolloutEngine().generate(model, prompt_ids, prompt_mask, 2, SamplingConfig(max_new_tokens=3), 0, 0,
                                   torch.Generator().manual_seed(0))
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                       logits_to_keep=6).logits[:, :-1].float()
    # the plain pass, both of the shared prompt and the prefill, then the sliced view of the int. The lean decoding
    # step's prepacked products call no hooks; where this CPU cannot prepack the dtype (bf16 without AVX512-BF16)
    # its two steps run the model's own head, on contiguous rows too
    decoding = [] if PackedProjections.supported(llama_like(model)) else [True] * 2
    assert seen == [True] * 4 + decoding + [False], seen
    expected = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(plain.float(), expected)
    torch.testing.assert_close(shared[[0, 2]].float(), plain[[0, 2]].float(), atol=5e-2 if dtype == torch.bfloat16
                               else 1e-5, rtol=0)
