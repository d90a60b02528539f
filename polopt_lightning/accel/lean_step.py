"""A lean one-token decoding step for Llama-family models (Llama, Qwen2, Mistral without sliding window), on any
device.

``transformers``' forward spends milliseconds per call on work a sampling loop does not need (mask building,
output bookkeeping, hooks): on small models that is most of the generation time. This step calls the model's own
modules (so LoRA-wrapped or quantized projections still work) on the keys/values that the prefill left in the
preallocated cache, and nothing else. It is used only when :func:`llama_like` recognises the model; a test checks
its logits against the model's own forward. How its products run is a :class:`Projections`' business: the model's
own modules by default, prepacked weights or a C kernel on the CPU (:mod:`polopt_lightning.accel.cpu.decode`), which
may also take the whole step (a ``fused`` attribute).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._hf import peft_base
from . import trace

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def llama_like(model: nn.Module) -> nn.Module | None:
    """The ``*ForCausalLM`` module when its decoding step can run here, else ``None``."""
    base = peft_base(model)  # peft
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


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, D/2) * signed_sin`` (the sign of
    the first half of ``sin`` flipped once per step): two operations fewer per call, the same values bit for bit."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (Llama/Qwen2 call it ``variance_epsilon``)."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """Llama/Qwen2 RMSNorm inline: statistics in float32, as the modules compute them, in one ``F.rms_norm`` call
    (on the CPU that call still runs pow/mean/rsqrt/mul inside ATen, without Python between them)."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=_norm_eps(norm)).to(x.dtype)


class Projections:
    """The decoding step's matrix products through the model's own modules (LoRA-wrapped or quantized ones too)."""

    prepacked = False  # whether the step may skip torch-function dispatch (no module of the model is called)

    def __init__(self, base: nn.Module) -> None:
        self.layers, self.head = base.model.layers, base.lm_head

    def qkv(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = self.layers[i].self_attn
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    def o(self, i: int, x: Tensor) -> Tensor:
        return self.layers[i].self_attn.o_proj(x)

    def mlp(self, i: int, h: Tensor) -> Tensor:
        return self.layers[i].mlp(h)

    def lm_head(self, x: Tensor) -> Tensor:
        return self.head(x)


@torch.no_grad()
def decode_step(base: nn.Module, cache: Any, token: Tensor, position: Tensor, key_mask: Tensor,
                projections: Projections | None = None) -> Tensor:
    """Logits ``[N, V]`` for one new token per row, appending its keys/values to ``cache``.

    Args:
        base: a model accepted by :func:`llama_like`.
        cache: the preallocated cache filled by the prefill (see ``_hf.preallocated_cache``).
        token: ``[N]`` token ids.
        position: ``[N, 1]`` position ids.
        key_mask: ``[N, 1, 1, L]`` additive mask over the cache positions including the new one.
        projections: how the products run (default: the model's own modules).
    """
    fused = getattr(projections, "fused", None)
    if fused is not None and all(hasattr(kv, "advance") for kv in cache.layers):  # the preallocated cache
        slot = cache.layers[0]._len
        logits = fused(token, position, [(kv._k, kv._v) for kv in cache.layers], slot + 1, key_mask[:, 0, 0], 1,
                       slot=slot)  # the new keys/values written at `slot` of each layer's buffers
        for kv in cache.layers:
            kv.advance(slot + 1)
        return logits
    return _step(base, [_sdpa(kv.update, key_mask) for kv in cache.layers], token, position, projections)


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

    return _step(base, [_sdpa(writer(k, v), key_mask) for k, v in zip(keys, values)], token, position)


@torch.no_grad()
def shared_prompt_decode_step(base: nn.Module, prompt_kv: list[tuple[Tensor, Tensor]], prompt_bias: Tensor,
                              completion_kv: list[tuple[Tensor, Tensor]], length: int, token: Tensor,
                              position: Tensor, projections: Projections | None = None) -> Tensor:
    """:func:`decode_step` with each prompt's keys/values held once per group instead of once per sample.

    Rows are ``P`` groups of ``G`` samples, group by group. ``prompt_kv[i]`` holds layer i's prompt keys/values
    ``[P, kv_heads, Lp, D]`` (``prompt_bias`` ``[P, 1, 1, Lp]`` closes their left padding); ``completion_kv[i]``
    ``[N, kv_heads, T, D]`` receives the new token's at position ``length`` and holds the ``length`` before it. The G
    queries of a group attend to their shared prompt in one product, so the prompt's keys/values are read once per
    group instead of G times per token; one softmax over prompt and completion scores gives the same attention.
    """

    def attend(kp: Tensor, vp: Tensor, kc: Tensor, vc: Tensor):
        def run(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
            kc[:, :, length:length + 1] = k
            vc[:, :, length:length + 1] = v
            return _shared_prompt_attention(q, kp, vp, kc[:, :, :length + 1], vc[:, :, :length + 1], prompt_bias,
                                            scale)
        return run

    fused = getattr(projections, "fused", None)
    if fused is not None:
        return fused(token, position, prompt_kv, prompt_kv[0][0].shape[2], prompt_bias[:, 0, 0],
                     token.shape[0] // prompt_kv[0][0].shape[0], completion_kv, length + 1, slot=length)
    return _step(base, [attend(*p, *c) for p, c in zip(prompt_kv, completion_kv)], token, position, projections)


def _shared_prompt_attention(q: Tensor, kp: Tensor, vp: Tensor, kc: Tensor, vc: Tensor, prompt_bias: Tensor,
                             scale: float) -> Tensor:
    """Attention of ``q`` ``[N, H, 1, D]`` over a group-shared prompt ``kp/vp`` ``[P, KVH, Lp, D]`` and per-row
    completion keys ``kc/vc`` ``[N, KVH, t, D]``; query head ``h`` uses key head ``h // (H // KVH)``."""
    N, H, _, D = q.shape
    P, KVH, Lp, _ = kp.shape
    G, rep, t = N // P, H // KVH, kc.shape[2]
    # prompt scores: a group's G x rep queries against its Lp keys in one product per key head
    qg = q.reshape(P, G, KVH, rep, D).permute(0, 2, 1, 3, 4).reshape(P, KVH, G * rep, D)
    sp = torch.matmul(qg, kp.transpose(-1, -2)).float().mul_(scale).add_(prompt_bias)  # [P, KVH, G*rep, Lp]
    sp = sp.view(P, KVH, G, rep, Lp).permute(0, 2, 1, 3, 4).reshape(N, KVH, rep, Lp)
    qc = q.reshape(N, KVH, rep, D)
    sc = torch.matmul(qc, kc.transpose(-1, -2)).float().mul_(scale)  # [N, KVH, rep, t]
    weights = torch.softmax(torch.cat([sp, sc], dim=-1), dim=-1).to(q.dtype)
    wp, wc = weights.split([Lp, t], dim=-1)
    wp = wp.reshape(P, G, KVH, rep, Lp).permute(0, 2, 1, 3, 4).reshape(P, KVH, G * rep, Lp)
    out = torch.matmul(wp, vp).view(P, KVH, G, rep, D).permute(0, 2, 1, 3, 4).reshape(N, KVH, rep, D)
    return (out + torch.matmul(wc, vc)).view(N, H, 1, D)


def _sdpa(update, key_mask: Tensor):
    """Attention through ``update(k, v) -> (all keys, all values)`` under the additive ``key_mask``."""
    def run(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        keys, values = update(k, v)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask, scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])
    return run


def _step(base: nn.Module, attends: list, token: Tensor, position: Tensor,
          projections: Projections | None = None) -> Tensor:
    """The decoding step; ``attends[i](q, k, v, scale)`` stores layer i's new keys/values and returns the
    attention output ``[N, heads, 1, D]``."""
    proj = projections or Projections(base)
    # prepacked products need no torch-function handling: skip the mode's Python dispatch (oneDNN's, for one) on each
    # of the step's ~1,300 operations (the same tokens)
    with _without_torch_function() if proj.prepacked else nullcontext(), trace.span("lean_step"):
        return _layers(base, proj, attends, token, position)


def _without_torch_function():
    """A context where ``__torch_function__`` modes and subclasses are not consulted (PyTorch's own switch)."""
    switch = getattr(torch._C, "DisableTorchFunction", None)
    return switch() if switch is not None else nullcontext()


def _layers(base: nn.Module, proj: Projections, attends: list, token: Tensor, position: Tensor) -> Tensor:
    inner, config = base.model, base.config
    head_dim = _head_dim(config)
    x = inner.embed_tokens(token[:, None])  # [N, 1, H]
    cos, sin = inner.rotary_emb(x, position)  # [N, 1, D]
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, 1, D]
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    n = x.shape[0]
    for i, (layer, attend) in enumerate(zip(inner.layers, attends)):
        attn = layer.self_attn
        h = _rms_norm(layer.input_layernorm, x)
        q, k, v = proj.qkv(i, h)
        q = q.reshape(n, 1, -1, head_dim).transpose(1, 2)  # [N, heads, 1, D]
        k = k.reshape(n, 1, -1, head_dim).transpose(1, 2)  # [N, kv_heads, 1, D]
        v = v.reshape(n, 1, -1, head_dim).transpose(1, 2)
        q, k = _rope(q, cos, signed_sin), _rope(k, cos, signed_sin)
        out = attend(q, k, v, attn.scaling)
        x = x + proj.o(i, out.transpose(1, 2).reshape(n, 1, -1))
        h = _rms_norm(layer.post_attention_layernorm, x)
        x = x + proj.mlp(i, h)
    return proj.lm_head(_rms_norm(inner.norm, x))[:, -1]
