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
def test_padding_free_gives_the_padded_log_probs_entropies_and_gradients(adapter, fuse, monkeypatch):
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                  seed=2, tie_word_embeddings=False)
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
