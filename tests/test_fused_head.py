"""The fused output head (``update.fused_head``, :func:`~polopt_lightning.step.logprobs.head_log_softmax`): the head's
product inside the log-softmax, block by block over the vocabulary. It gives the head's own log-probs, entropies and
gradients (1e-5 in float32) in every pass (plain, shared prompt, packed groups), under LoRA and with a multi-turn
rollout's context, holds no more than a block of logits, and stands in only for heads that run plainly. Under DDP:
tests/test_distributed.py (``fused-head-entropy-bonus-kl``)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from polopt_lightning.models import build_tiny_model
from polopt_lightning.step import logprobs
from polopt_lightning.step.logprobs import (
    completion_logprobs,
    fusable_head,
    head_log_softmax,
    padding_free_logprobs,
    shared_prompt_completion_logprobs,
)

from .helpers.scores import assert_same_scores, rollout_rows, scores_and_gradients


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_gives_the_log_softmax_entropy_and_gradients_of_the_materialised_logits(temperature, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 7, 16)
    index = torch.randint(0, 50, (3, 7))
    index[0, 0], index[0, 1] = 0, 49  # the first and the last column, at a block's edges
    weights, entropy_weights = torch.randn(3, 7), torch.randn(3, 7)
    results = []
    for fused in (True, False):
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        if fused:  # blocks of 8 vocabulary entries: 7 blocks, the last one short
            logp, entropy = head_log_softmax(h, head, index, temperature, with_entropy=True, columns=8)
        else:
            log_p = torch.log_softmax(head(h) / temperature, -1)
            logp = log_p.gather(-1, index[..., None]).squeeze(-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
        ((logp * weights).sum() + (entropy * entropy_weights).sum()).backward()
        results.append((logp, entropy, h.grad, head.weight.grad, head.bias.grad if bias else None))
    for got, expected in zip(*results):
        if expected is not None:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fused_head_skips_what_needs_no_gradient_and_follows_autocast():
    """A frozen head (LoRA's) gets no weight gradient, and the products run in the autocast dtype as the head's own
    would, the softmax in float32."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).requires_grad_(False)
    h = torch.randn(10, 16, requires_grad=True)
    index = torch.randint(0, 40, (10,))
    logp, _ = head_log_softmax(h, head, index, columns=16)
    logp.sum().backward()
    assert head.weight.grad is None and h.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = head_log_softmax(h, head, index, columns=16)
        logits = head(h)
    assert logits.dtype == torch.bfloat16 and fused.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_fused_head_never_holds_more_than_a_block_of_logits(monkeypatch):
    """At Qwen2.5's head (896 x 151,936) and 2,048 completion tokens, neither pass makes a product wider than the
    block (``CHUNK_ELEMENTS`` floats): the whole logits would be 1.2 GiB, and as much again their gradient."""
    V, H, R = 151936, 896, 2048
    head = torch.nn.Linear(H, V, bias=False)
    h = torch.randn(R, H, requires_grad=True)
    index = torch.randint(0, V, (R,))
    shapes, real = [], F.linear

    def spy(x, w, b=None):
        out = real(x, w, b)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(logprobs.F, "linear", spy)
    logp, _ = head_log_softmax(h, head, index)
    logp.sum().backward()
    assert max(a * b for a, b in shapes) <= logprobs.CHUNK_ELEMENTS
    # the logits' blocks: once in the forward pass and again in the backward; the rest are the gradients' products,
    # [R, H] for the hidden states' and [columns, H] for the weight's
    assert sum(a * b for a, b in shapes if (a, b) != (R, H) and b != H) == 2 * R * V
    assert head.weight.grad.shape == (V, H) and torch.isfinite(h.grad).all()


PASSES = {"plain": completion_logprobs,
          "shared-prompt": shared_prompt_completion_logprobs,
          "packed": partial(shared_prompt_completion_logprobs, packed=True)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("adapter", [None, "lora"])
@pytest.mark.parametrize("name", list(PASSES))
def test_every_pass_gives_the_heads_own_log_probs_entropies_and_gradients(name, adapter, tied):
    """Tied: the head's weight is the embedding's too, whose gradient the trunk's lookup adds into the head's."""
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2,
                                  tie_word_embeddings=tied)
    args, group, m = rollout_rows(model, tok)
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    fn = PASSES[name] if name == "plain" else partial(PASSES[name], group_index=group)
    calls = []
    real = logprobs._HeadLogProbs.apply
    logprobs._HeadLogProbs.apply = lambda *a: calls.append(a[5]) or real(*a)
    try:
        plain, fused = (scores_and_gradients(model, partial(fn, fuse=fuse), args, m) for fuse in (False, True))
    finally:
        logprobs._HeadLogProbs.apply = real
    assert calls, "the fused head never ran"
    assert_same_scores(fused, plain)
    head_trains = any(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in plain[2])
    assert head_trains is (adapter is None)  # LoRA: the head frozen, no gradient made


def test_the_fused_head_runs_where_the_logits_exceed_a_chunk_unless_told(monkeypatch):
    """``fuse=None`` (the default): the head's own product where its logits fit one chunk (the tiny models, so the
    default job runs as before), fused where they would not; ``False`` never; ``True`` always."""
    model, tok = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    args, _, _ = rollout_rows(model, tok)
    calls = []
    real = logprobs._HeadLogProbs.apply
    monkeypatch.setattr(logprobs._HeadLogProbs, "apply", lambda *a: calls.append(1) or real(*a))
    rows = args[2].numel()
    V = model.lm_head.weight.shape[0]
    assert rows * V <= logprobs.CHUNK_ELEMENTS
    for elements, fuse, expected in [(logprobs.CHUNK_ELEMENTS, None, 0), (rows * V - 1, None, 1),
                                     (rows * V - 1, False, 0), (logprobs.CHUNK_ELEMENTS, True, 1)]:
        monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", elements)
        calls.clear()
        with torch.no_grad():
            completion_logprobs(model, *args, fuse=fuse)
        assert len(calls) == expected, (elements, fuse)


def test_heads_that_do_not_run_plainly_are_not_fused():
    """A head with LoRA on it, a model type that scales or soft-caps its logits: the model's own forward runs (the
    default), and ``update.fused_head=true`` names the reason."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model, tok = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    assert fusable_head(model)[0] is model.lm_head
    untied, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                 tie_word_embeddings=False)
    lora_head = get_peft_model(untied, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    head, why = fusable_head(lora_head)
    assert head is None and "not a plain nn.Linear" in why
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    head, why = fusable_head(gemma)
    assert head is None and "gemma2" in why
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    with torch.no_grad():
        completion_logprobs(gemma, ids, mask, ids[:, :3], mask[:, :3])  # the default: the model's own head
        with pytest.raises(ValueError, match=r"update.fused_head=true: model type 'gemma2'"):
            completion_logprobs(gemma, ids, mask, ids[:, :3], mask[:, :3], fuse=True)
    # the module's scorer refuses it when it is built, before any rollout
    from polopt_lightning.step.logprobs import Scorer
    from polopt_lightning.step.update import UpdateConfig

    with pytest.raises(ValueError, match=r"update.fused_head=true: model type 'gemma2'"):
        Scorer(model, gemma, False, UpdateConfig(fused_head=True), 1.0)
    Scorer(model, None, False, UpdateConfig(fused_head=True), 1.0)


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_tied_embedding_and_head_make_one_vocabulary_sized_gradient(padding_free, monkeypatch):
    """Where the head's weight is the embedding's (Qwen2.5-0.5B, the small Llamas) the backward pass makes one
    ``[V, H]`` tensor for its gradient, the head's, into which the lookup's rows go: not a second one for the lookup's
    contribution, held with every other gradient at the end of the pass (545 MiB at Qwen2.5-0.5B's shape). The
    gradients are those of the head's own product (the test above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    args, group, m = rollout_rows(model, tok)
    weight = model.get_input_embeddings().weight
    assert model.lm_head.weight is weight

    class NewVocabularySized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if (isinstance(out, torch.Tensor) and out.shape == weight.shape  # new memory, not a view or in place
                    and out.untyped_storage().data_ptr() not in inputs):
                self.made.append(func.__name__)
            return out

    fn = partial(padding_free_logprobs, group_index=group) if padding_free else completion_logprobs
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 256)  # blocks of the vocabulary, as at a real one's size
    made = {}
    for fuse in (True, False):
        model.zero_grad(set_to_none=True)
        logp, _ = fn(model, *args, fuse=fuse)
        with NewVocabularySized() as mode:
            (logp[m] * torch.linspace(-1, 1, int(m.sum()))).sum().backward()
        made[fuse] = mode.made
        assert weight.grad.shape == weight.shape
    assert made[True] == ["empty_like.default"], made
    # the head's own product: its gradient, the lookup's (and their sum where autograd cannot add in place)
    assert "embedding_dense_backward.default" in made[False], made


def test_the_tied_lookup_gives_the_plain_gradients_under_activation_checkpointing(monkeypatch):
    """``update.gradient_checkpointing`` (how long completions run): the layers recomputed in the backward pass,
    after the head's and before the lookup's gradient."""
    from polopt_lightning.models import enable_gradient_checkpointing

    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    args, group, m = rollout_rows(model, tok)
    plain = scores_and_gradients(model, partial(completion_logprobs, fuse=False), args, m)
    enable_gradient_checkpointing(model)
    model.train()
    lookups, real = [], logprobs._TiedLookup.apply
    monkeypatch.setattr(logprobs._TiedLookup, "apply", lambda *a: lookups.append(1) or real(*a))
    for fn in (completion_logprobs, partial(padding_free_logprobs, group_index=group)):
        assert_same_scores(scores_and_gradients(model, partial(fn, fuse=True), args, m), plain)
    assert len(lookups) == 2


def test_the_tied_lookup_skips_the_padding_row_inside_completions_and_steps_aside_for_hooks(monkeypatch):
    """The embedding's ``padding_idx`` set to a token the scored completions contain: its row gets no gradient from
    the lookup (as ``F.embedding``'s), only the head's. A hook on the embedding (NEFTune's noise, a user's) runs
    where the trunk calls it: the tied lookup steps aside for the module's own call."""
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2)
    args, group, m = rollout_rows(model, tok)
    emb = model.get_input_embeddings()
    scored = args[2][m]
    emb.padding_idx = int(scored.mode().values)  # the commonest scored completion token
    assert emb.padding_idx != tok.pad_token_id and (scored == emb.padding_idx).sum() >= 2
    lookups, real = [], logprobs._TiedLookup.apply
    monkeypatch.setattr(logprobs._TiedLookup, "apply", lambda *a: lookups.append(1) or real(*a))
    for fn in (completion_logprobs, partial(padding_free_logprobs, group_index=group)):
        assert_same_scores(scores_and_gradients(model, partial(fn, fuse=True), args, m),
                           scores_and_gradients(model, partial(fn, fuse=False), args, m))
    assert len(lookups) == 2
    lookups.clear()
    emb.padding_idx = None
    handle = emb.register_forward_hook(lambda module, inputs, output: output * 1.5)
    try:
        assert_same_scores(scores_and_gradients(model, partial(completion_logprobs, fuse=True), args, m),
                           scores_and_gradients(model, partial(completion_logprobs, fuse=False), args, m))
    finally:
        handle.remove()
    assert not lookups
