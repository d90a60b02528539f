"""The KL reference: which model it is (a frozen copy of the starting policy, cast or quantized, a given model, or the
policy's own base with its adapters disabled) and building it once, at the module's construction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .models import (
    Quantization,
    as_quantization,
    cast_weights,
    frozen_copy,
    quantized_copy,
    reference_context,
    resolve_dtype,
)


def build_reference(model: nn.Module, uses_reference: bool, ref_model: nn.Module | None = None,
                    ref_dtype: str | torch.dtype | None = None,
                    ref_quantization: Quantization | str | Mapping[str, Any] | None = None,
                    ) -> tuple[nn.Module | None, bool, Quantization]:
    """The reference for the KL term of the policy ``model``: ``(copy, shared, quantization)``.

    ``copy`` is the model the reference pass runs (``None`` when none is needed or when it is shared); ``shared`` says
    the policy's own base, adapters disabled, is the reference (a policy with an adapter and no ``ref_model``: no copy
    of the weights); ``quantization`` is ``ref_quantization`` resolved. Without ``uses_reference`` nothing is built.
    A given ``ref_model`` is cast to ``ref_dtype`` in place; otherwise a frozen copy of ``model`` is taken, in
    ``ref_dtype`` or quantized. Settings with nothing to act on, or that contradict each other, raise a ValueError
    naming the key.
    """
    ref_torch_dtype = resolve_dtype(ref_dtype, "ref_dtype", auto=False)
    ref_quant = as_quantization(ref_quantization, "ref_quantization")
    if ref_quant.enabled and ref_torch_dtype is not None:
        raise ValueError("ref_quantization and ref_dtype both set: a quantized reference computes in "
                         "ref_quantization.compute_dtype; leave ref_dtype unset")
    # with an adapter, the adapter-disabled policy is the reference: the base the adapters started from
    shared = uses_reference and ref_model is None and reference_context(model) is not None
    if shared and (ref_torch_dtype is not None or ref_quant.enabled):
        key, value = ("ref_dtype", ref_dtype) if ref_torch_dtype is not None else ("ref_quantization", ref_quant.mode)
        raise ValueError(f"{key}={value!r} has nothing to act on: the policy has an adapter, so its reference is "
                         f"its own base with the adapter disabled (no copy to cast or quantize); leave {key} unset")
    reference = None
    if uses_reference and ref_model is not None:
        reference = ref_model
        if ref_torch_dtype is not None:
            cast_weights(ref_model, ref_torch_dtype, "ref_dtype")
    elif uses_reference and not shared:
        reference = (quantized_copy(model, ref_quant).requires_grad_(False) if ref_quant.enabled
                     else frozen_copy(model, ref_torch_dtype, "ref_dtype"))
    return reference, shared, ref_quant
