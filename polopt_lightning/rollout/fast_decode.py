"""A lean one-token decoding step for Llama-family models (Llama, Qwen2, Mistral without sliding window).

``transformers``' forward spends milliseconds per call on work a sampling loop does not need (mask building,
output bookkeeping, hooks): on small models that is most of the generation time. This step calls the model's own
modules (so LoRA-wrapped or quantized projections still work) on the keys/values that the prefill left in the
preallocated cache, and nothing else. It is used only when :func:`llama_like` recognises the model; a test checks
its logits against the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def llama_like(model: nn.Module) -> nn.Module | None:
    """The ``*ForCausalLM`` module when its decoding step can run here, else ``None``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    if type(base).__name__ not in SUPPORTED:
        return None
    config = base.config
    sliding = getattr(config, "use_sliding_window", type(base).__name__ == "MistralForCausalLM")
    if sliding and getattr(config, "sliding_window", None) is not None:
        return None
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return None
    return base


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """Llama/Qwen2 RMSNorm inline (float32 statistics, as the modules compute them)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return norm.weight * h.to(x.dtype)


@torch.no_grad()
def decode_step(base: nn.Module, cache: Any, token: Tensor, position: Tensor, key_mask: Tensor) -> Tensor:
    """Logits ``[N, V]`` for one new token per row, appending its keys/values to ``cache``.

    Args:
        base: a model accepted by :func:`llama_like`.
        cache: the preallocated cache filled by the prefill (see ``_hf.preallocated_cache``).
        token: ``[N]`` token ids.
        position: ``[N, 1]`` position ids.
        key_mask: ``[N, 1, 1, L]`` additive mask over the cache positions including the new one.
    """
    return _step(base, [kv.update for kv in cache.layers], token, position, key_mask)


def static_decode_step(base: nn.Module, keys: list[Tensor], values: list[Tensor], slot: Tensor, token: Tensor,
                       position: Tensor, key_mask: Tensor) -> Tensor:
    """:func:`decode_step` with static shapes, for ``torch.compile``: every call has the same tensor shapes.

    The new keys/values are written at ``slot`` (a one-element index tensor) of the whole cache buffers
    ``keys[i]``/``values[i]`` ``[N, kv_heads, capacity, D]``, and attention runs over the whole buffers:
    ``key_mask`` ``[N, 1, 1, capacity]`` must close the prompt padding and every slot not yet written (which must
    hold finite values, e.g. zeros).
    """

    def writer(k_buf: Tensor, v_buf: Tensor):
        def update(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            k_buf.index_copy_(2, slot, k)
            v_buf.index_copy_(2, slot, v)
            return k_buf, v_buf
        return update

    return _step(base, [writer(k, v) for k, v in zip(keys, values)], token, position, key_mask)


def _step(base: nn.Module, updates: list, token: Tensor, position: Tensor, key_mask: Tensor) -> Tensor:
    """The decoding step; ``updates[i](k, v)`` stores layer i's new keys/values and returns all of them."""
    inner, config = base.model, base.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    x = inner.embed_tokens(token[:, None])  # [N, 1, H]
    cos, sin = inner.rotary_emb(x, position)  # [N, 1, D]
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, 1, D]
    n = x.shape[0]
    for layer, update in zip(inner.layers, updates):
        attn = layer.self_attn
        h = _rms_norm(layer.input_layernorm, x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(n, 1, -1, head_dim).transpose(1, 2)  # [N, heads, 1, D]
        k = k.view(n, 1, -1, head_dim).transpose(1, 2)  # [N, kv_heads, 1, D]
        v = v.view(n, 1, -1, head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = update(k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask, scale=attn.scaling,
                                             enable_gqa=keys.shape[1] != heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(n, 1, -1))
        h = _rms_norm(layer.post_attention_layernorm, x)
        x = x + layer.mlp(h)
    return base.lm_head(_rms_norm(inner.norm, x))[:, -1]
