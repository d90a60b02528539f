"""Padding-free passes (``update.padding_free``): the rows' prompts and completions run as one packed sequence with no
padding, each group's prompt once, and attention runs segment by segment, so it never crosses sequences and never
covers padding.

The padded passes run every completion to the longest one's length (and every prompt to the longest prompt's): with
completions of very different lengths (reasoning, 100 to 2,000 tokens), most of a pass can be padding. Here the
linear layers, norms and head see only real tokens. Attention is the part that cannot run over the packed sequence
whole (it would cost the square of the packed length on a CPU, where SDPA has no variable-length kernel): SDPA
calls that carry the pass's plan (transformers' ``AttentionInterface`` entry for ``sdpa``, wrapped once) run it per
segment instead, a group's
prompt causally, then each completion over its group's prompt and itself causally (the layout of
:func:`~polopt_lightning.step.logprobs._packed_groups`, without its square mask). On CUDA transformers' own packed
path (flash-attention's variable-length kernel) would do the same in one call; this one runs on any device.

A position's log-prob is the same as the padded pass's within float tolerance (the same tokens, positions and
attended keys; tested with multi-turn context, LoRA and under DDP): padding never changed a real position's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._hf import peft_base

PLAN_KEY = "polopt_segments"  # the keyword argument that carries the plan to the attention function


@dataclass
class SegmentPlan:
    """Where each segment of a packed sequence lies: ``(start, end, prefix_start, prefix_end)`` per segment in order
    (a prompt has no prefix, ``prefix_start == prefix_end``; a completion's prefix is its group's prompt)."""

    segments: list[tuple[int, int, int, int]]
    _masks: dict[tuple[int, int], Tensor] = field(default_factory=dict)

    def mask(self, length: int, prefix: int, device: torch.device) -> Tensor:
        """``[length, prefix + length]``: a position sees the whole prefix and its own segment causally."""
        key = (length, prefix)
        if key not in self._masks:
            q = torch.arange(length, device=device)[:, None]
            self._masks[key] = torch.arange(prefix + length, device=device)[None, :] <= q + prefix
        return self._masks[key]


def segment_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature over one packed row ``[1, heads, S, d]``: SDPA per segment of the
    plan (``kwargs[PLAN_KEY]``), the results joined in order, ``[1, S, heads, d]``."""
    plan: SegmentPlan = kwargs[PLAN_KEY]
    gqa = query.shape[1] != key.shape[1]
    pieces = []
    for start, end, p_start, p_end in plan.segments:
        q = query[:, :, start:end]
        if p_end > p_start:
            k = torch.cat([key[:, :, p_start:p_end], key[:, :, start:end]], dim=2)
            v = torch.cat([value[:, :, p_start:p_end], value[:, :, start:end]], dim=2)
            mask = plan.mask(end - start, p_end - p_start, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, key[:, :, start:end], value[:, :, start:end], is_causal=True,
                                                 dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        pieces.append(out)
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Route SDPA attention calls that carry a plan (``PLAN_KEY``) to :func:`segment_attention`, once per process.

    The route is taken by the call's arguments, not by a setting switched around the pass: activation checkpointing
    runs a layer's forward again in the backward pass, long after the pass returned, with the same arguments. Calls
    without a plan run transformers' own SDPA function as before."""
    from transformers import AttentionInterface

    current = AttentionInterface._global_mapping["sdpa"]
    if getattr(current, "_polopt_segments", False):
        return

    def sdpa_or_segments(module, query, key, value, attention_mask, *args, **kwargs):
        if PLAN_KEY in kwargs:
            return segment_attention(module, query, key, value, attention_mask, *args, **kwargs)
        return current(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_or_segments._polopt_segments = True
    AttentionInterface.register("sdpa", sdpa_or_segments)


def attention_problem(model: nn.Module) -> str:
    """Why ``model``'s attention cannot take a mask it is given (a block mask, or segments), or ``""``: it must be
    PyTorch's SDPA, with no sliding-window layers (their windows would be the mask's to apply)."""
    config = getattr(peft_base(model), "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention {getattr(config, '_attn_implementation', None)!r} (sdpa only)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = not all(kind == "full_attention" for kind in layer_types)
    else:
        sliding = getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None) is not None
    return "sliding-window attention layers" if sliding else ""


def supported(model: nn.Module) -> str:
    """Why ``model``'s trunk cannot run segment by segment, or ``""``: its attention as :func:`attention_problem`
    asks, and its weights whole on this process."""
    problem = attention_problem(model)
    if problem:
        return problem
    embedding = peft_base(model).get_input_embeddings().weight
    if type(embedding.data) is not torch.Tensor or hasattr(embedding, "ds_id"):
        # the trunk runs without the whole model's forward, which is what gathers the root's shards
        return "the model is sharded (FSDP2 or DeepSpeed ZeRO-3)"
    return ""
