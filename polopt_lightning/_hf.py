"""Small compatibility helpers for ``transformers`` model calls (shared by rollout and log-prob code)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token (padding gets 0 too)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_positions(length: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``logits_to_keep`` for the last ``n`` of ``length`` positions, as the index tensor transformers also takes.

    Given the int ``n``, transformers slices the hidden states (``[:, -n:]``, a view that is not contiguous when
    ``n < length``) before the head; given the indices it gathers them into a contiguous copy. On the CPU a bfloat16
    ``F.linear`` of such a sliced 3-D view runs as a batched product on a transposed copy of the weight, expanded
    to every row: tens of times slower than on a contiguous input at a large head. The values are the same within
    float tolerance (the product on a contiguous input may round in another order).
    """
    return torch.arange(length - n, length, device=device)


def peft_base(model: nn.Module) -> nn.Module:
    """The transformers model itself: a peft model's base (its adapters injected in place), any other model as it
    is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stop_token_ids(tokenizer: Any, model: nn.Module | None) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, then those of the model's generation config (as TRL and
    vLLM stop: Qwen2.5-Instruct's config adds ``<|endoftext|>`` to the tokenizer's ``<|im_end|>``), each once."""
    config = getattr(peft_base(model), "generation_config", None) if model is not None else None
    extra = getattr(config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    first = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return list(dict.fromkeys([*first, *extra]))


def cache_argument(model: nn.Module) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; the name this model's forward takes (a peft model's
    forward passes its keywords on to its base's)."""
    base = peft_base(model)
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = out.get("cache")
    return out.get("past_key_values") if cache is None else cache


def preallocated_cache(model: nn.Module, capacity: int) -> Any | None:
    """A KV cache that writes into buffers of ``capacity`` positions instead of growing by concatenation.

    transformers' ``DynamicCache`` concatenates every layer's keys and values at each decoding step, copying the
    whole cache each time (quadratic in the completion length). This one writes in place and hands attention a view
    of the filled part, so attention still covers only the tokens seen so far. Its buffers (``layer._k``,
    ``layer._v``) start zeroed, so a static-shape decoding step may attend over all of them under a mask. ``None``
    when this transformers version has no layered ``Cache`` (the caller then lets the model make its own).
    """
    try:
        from transformers.cache_utils import Cache, DynamicLayer
    except ImportError:  # pragma: no cover - older transformers
        return None
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if num_layers is None:
        return None

    class PreallocatedLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self._k = key_states.new_zeros(*key_states.shape[:2], capacity, key_states.shape[-1])
            self._v = value_states.new_zeros(*value_states.shape[:2], capacity, value_states.shape[-1])
            self._len = 0
            self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self._len + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"KV cache capacity {capacity} exceeded ({end} positions)")
            self._k[:, :, self._len:end] = key_states
            self._v[:, :, self._len:end] = value_states
            return self.advance(end)

        def advance(self, end: int):
            """The first ``end`` positions are filled (written into ``_k``/``_v`` by the caller or by
            :meth:`update`): attention sees them from here on."""
            self._len = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        def _reindex(self, index: torch.Tensor) -> None:
            self._k, self._v = self._k[index], self._v[index]
            self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self._reindex(torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self._reindex(indices)

    return Cache(layers=[PreallocatedLayer() for _ in range(num_layers)])
