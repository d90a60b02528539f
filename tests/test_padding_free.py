"""Padding-free passes (``update.padding_free``, :mod:`polopt_lightning.step.varlen`): the rows' real tokens packed in
one sequence, each group's prompt once, attention segment by segment. They give the padded pass's log-probs,
entropies and gradients (1e-5 in float32) with left-padded prompts, completions of different lengths, multi-turn
context, LoRA and the fused head, and compute no padding. Under DDP: tests/test_distributed.py
(``fused-head-padding-free-entropy-bonus-kl``); the whole update: tests/test_step_without_trainer.py."""

from functools import partial

import pytest
import torch

from polopt_lightning.models import build_tiny_model
from polopt_lightning.step import varlen
from polopt_lightning.step.logprobs import completion_logprobs, padding_free_logprobs, padding_free_supported

from .helpers.scores import assert_same_scores, rollout_rows, scores_and_gradients


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("adapter", [None, "lora"])
@pytest.mark.parametrize("tied", [False, True])
def test_padding_free_gives_the_padded_log_probs_entropies_and_gradients(adapter, fuse, tied, monkeypatch):
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                  seed=2, tie_word_embeddings=tied)
    args, group, m = rollout_rows(model, tok)  # left padding, early ends, an uneven group, a tool's result
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    packed_tokens = []
    real = varlen.segment_attention
    monkeypatch.setattr(varlen, "segment_attention",
                        lambda module, q, *a, **k: packed_tokens.append(q.shape[2]) or real(module, q, *a, **k))
    plain, *packed = (scores_and_gradients(model, partial(fn, fuse=fuse), args, m)
                      for fn in (completion_logprobs, partial(padding_free_logprobs, group_index=group),
                                 partial(padding_free_logprobs, group_index=None)))
    for result in packed:
        assert_same_scores(result, plain)
    # no padding computed: each group's prompt once (then each row's own), each completion but its last token
    prompts, _, completions, c_mask = args
    p_real, c_real = prompts.ne(tok.pad_token_id).sum(-1), c_mask.sum(-1)
    first = [int(torch.nonzero(group == g)[0]) for g in group.unique()]
    shared = int(p_real[first].sum() + (c_real - 1).clamp(min=0).sum())
    own = int(p_real.sum() + (c_real - 1).clamp(min=0).sum())
    layers = 2
    assert packed_tokens == [shared] * layers + [own] * layers, packed_tokens
    assert shared < prompts.shape[0] * (prompts.shape[1] + completions.shape[1] - 1)


def test_models_it_cannot_run_are_refused_naming_the_key():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from polopt_lightning.step.logprobs import Scorer
    from polopt_lightning.step.update import UpdateConfig

    model, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    assert padding_free_supported(model) == ""
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    holed = mask.clone()
    holed[0, 1] = 0  # a real token after padding
    with pytest.raises(ValueError, match=r"update.padding_free=true: a completion's mask has a hole"):
        padding_free_logprobs(model, ids, mask, ids, holed, None)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert "gemma2" in padding_free_supported(gemma)
    with pytest.raises(ValueError, match=r"update.padding_free=true: model type 'gemma2'"):
        padding_free_logprobs(gemma, ids, mask, ids, mask, None)
    with pytest.raises(ValueError, match=r"update.padding_free=true: model type 'gemma2'"):
        Scorer(model, gemma, False, UpdateConfig(padding_free=True), 1.0)
    sliding, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    sliding.config.use_sliding_window, sliding.config.sliding_window = True, 4
    sliding.config.layer_types = ["sliding_attention"]
    assert varlen.supported(sliding) == "sliding-window attention layers"
    partitioned, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    partitioned.model.embed_tokens.weight.ds_id = 0  # as DeepSpeed ZeRO-3 marks a partitioned weight
    assert varlen.supported(partitioned) == "the model is sharded (FSDP2 or DeepSpeed ZeRO-3)"
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in varlen.supported(model)


def test_by_default_a_pass_packs_on_the_cpu_where_its_rows_pad_enough(monkeypatch):
    """`update.padding_free=None` (the default): a pass's rows run padding-free where their completions are at least
    128 tokens wide, at most 80% real and without holes, and the model allows it; otherwise (the default job's
    6-token completions, a model it cannot run, `false`) the padded pass, with no error. The log-probs are the padded
    ones either way."""
    from types import SimpleNamespace

    from polopt_lightning.step import logprobs
    from polopt_lightning.step.logprobs import PADDING_FREE_MIN_WIDTH, Scorer, pads_enough
    from polopt_lightning.step.update import UpdateConfig

    T = PADDING_FREE_MIN_WIDTH

    def mask_of(lengths, width=T):
        return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()

    assert pads_enough(mask_of([T, T // 2, 10, 40]))
    assert not pads_enough(mask_of([T - 1, 60, 10, 40], width=T - 1))  # too narrow
    assert not pads_enough(mask_of([T, T, T, 2 * T // 5]))  # 85% real: little padding to save
    assert pads_enough(mask_of([T, T, T, T // 5]))  # 80% real
    holed = mask_of([T, T // 2, 10, 40])
    holed[1, T - 1] = 1
    assert not pads_enough(holed)
    prompts = torch.ones(4, 3, dtype=torch.long)
    assert pads_enough(mask_of([T, T // 2, 10, 40]), prompts)
    prompts[2] = 0  # an empty prompt (a tokenizer without BOS on ""): padded, where padding-free refuses it
    assert not pads_enough(mask_of([T, T // 2, 10, 40]), prompts)

    model, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0,
                                max_position_embeddings=512)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (2, 5), generator=g).repeat_interleave(2, dim=0)  # a prompt a group of 2

    def experience(lengths, width):
        mask = mask_of(lengths, width)
        ids = torch.randint(3, 60, (4, width), generator=g) * mask
        return SimpleNamespace(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=ids,
                               attention_mask=mask, group_index=torch.tensor([0, 0, 1, 1]))

    packed = []
    real = logprobs.padding_free_logprobs
    monkeypatch.setattr(logprobs, "padding_free_logprobs", lambda *a, **k: packed.append(1) or real(*a, **k))
    long_rows, short_rows = experience([T, T // 2, 10, 40], T), experience([6, 3, 1, 5], 6)
    for setting, exp, packs, groups in ((None, long_rows, True, None), (None, short_rows, False, None),
                                        (False, long_rows, False, None), (True, short_rows, True, None),
                                        (None, long_rows, False, True)):  # pack_groups asked for: its own packing
        packed.clear()
        scorer = Scorer(model, None, False, UpdateConfig(padding_free=setting, pack_groups=groups), 1.0)
        got = scorer.logprobs(model, exp, slice(None))[0]
        assert bool(packed) is packs, (setting, exp.completion_ids.shape)
        plain = completion_logprobs(model, exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.attention_mask)[0]
        torch.testing.assert_close(got * exp.attention_mask, plain * exp.attention_mask, atol=1e-5, rtol=1e-5)
    eager, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0,
                                max_position_embeddings=512)
    eager.config._attn_implementation = "eager"  # a model it cannot run: padded, no error
    packed.clear()
    Scorer(eager, None, False, UpdateConfig(), 1.0).logprobs(eager, long_rows, slice(None))
    assert not packed
