"""The KL reference: its settings (:class:`ReferenceConfig`), which model it is (a frozen copy of the starting policy,
cast or quantized, a given model, or the policy's own base with its adapters disabled) and building it once, at the
module's construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models import (
    Quantization,
    as_quantization,
    cast_weights,
    frozen_copy,
    quantized_copy,
    reference_context,
    resolve_dtype,
)
from ..settings import Settings


@dataclass
class ReferenceConfig(Settings):
    """The KL reference (the module's ``reference`` argument, ``reference.*`` in the CLI). It is made when the
    objective's ``beta > 0``, ``track_kl`` or ``kl_in_reward`` is set. Default: for a policy with an adapter (peft), the policy itself
    with its adapters disabled (its frozen base: no second copy of the weights); otherwise a frozen copy of the
    policy taken at construction (or the module's ``ref_model``).

    Args:
        dtype: the reference copy's weights in this dtype (e.g. ``"bfloat16"``: half the memory and a faster pass on
            GPUs and AMX CPUs, at bf16 rounding of the KL term); a given ``ref_model`` is cast in place. Unset: the
            policy's, except under ``bf16-mixed``, where the copy the module makes holds bf16 weights (its products
            are bf16 there anyway); ``"float32"`` keeps it float32.
        quantization: the reference copy quantized (``"int8"``, ``"nf4"``, or :class:`~polopt_lightning.models.
            Quantization` fields): a quarter to an eighth of its memory, for full fine-tuning (it never needs
            gradients). A ``transformers`` policy only; not with an adapter, whose reference is its own base.
        track_kl: log ``train/kl`` (the objective's ``kl_estimator``, per token, against the reference) even when the
            objective's ``beta`` is 0, for the collapse monitor: the reference is then made as for ``beta > 0`` (one
            more forward pass per rollout).
        kl_in_reward: the KL as a reward penalty (verl's ``use_kl_in_reward``, with a fixed coefficient): each
            completion's reward less ``kl_in_reward x sum_t KL_t`` over its tokens, before the advantages, with
            ``reward_kl_estimator`` on the sampler's log-probs against the reference's; 0: off. Logged as
            ``train/kl_reward_penalty`` (the mean penalty); the per-token KL stays ``train/kl``.
        reward_kl_estimator: ``"k1"`` (verl's default, the unbiased one for a reward), ``"k2"`` or ``"k3"``.
    """

    dtype: str | torch.dtype | None = None
    quantization: Quantization | str | Mapping[str, Any] | None = None
    track_kl: bool = False
    kl_in_reward: float = 0.0
    reward_kl_estimator: str = "k1"

    KEY = "reference"
    RULES = {
        "kl_in_reward": (lambda v: v >= 0, ">= 0"),
        "reward_kl_estimator": (lambda v: v in ("k1", "k2", "k3"), "one of ('k1', 'k2', 'k3') (a penalty has no "
                                "gradient: k3+ is k3 there)"),
    }

    def needed(self, beta: float) -> bool:
        """Whether a reference is needed: for the objective's KL term (``beta``), ``track_kl`` or ``kl_in_reward``."""
        return beta > 0 or self.track_kl or self.kl_in_reward > 0


def build_reference(model: nn.Module, uses_reference: bool, ref_model: nn.Module | None = None,
                    config: ReferenceConfig | Mapping[str, Any] | None = None,
                    ) -> tuple[nn.Module | None, bool, Quantization]:
    """The reference for the KL term of the policy ``model``: ``(copy, shared, quantization)``.

    ``copy`` is the model the reference pass runs (``None`` when none is needed or when it is shared); ``shared`` says
    the policy's own base, adapters disabled, is the reference (a policy with an adapter and no ``ref_model``: no copy
    of the weights); ``quantization`` is ``config.quantization`` resolved. Without ``uses_reference`` nothing is built.
    A given ``ref_model`` is frozen (``requires_grad`` off) and cast to ``config.dtype`` in place (one that shares
    parameters with ``model`` raises); otherwise a frozen copy of ``model`` is taken, in
    that dtype or quantized. Settings with nothing to act on, or that contradict each other, raise a ValueError
    naming the key.
    """
    config = ReferenceConfig.of(config)
    ref_dtype = config.dtype
    ref_torch_dtype = resolve_dtype(ref_dtype, "reference.dtype", auto=False)
    ref_quant = as_quantization(config.quantization, "reference.quantization")
    if ref_quant.enabled and ref_torch_dtype is not None:
        raise ValueError("reference.quantization and reference.dtype both set: a quantized reference computes in "
                         "reference.quantization.compute_dtype; leave reference.dtype unset")
    # with an adapter, the adapter-disabled policy is the reference: the base the adapters started from
    shared = uses_reference and ref_model is None and reference_context(model) is not None
    if shared and (ref_torch_dtype is not None or ref_quant.enabled):
        key, value = (("reference.dtype", ref_dtype) if ref_torch_dtype is not None
                      else ("reference.quantization", ref_quant.mode))
        raise ValueError(f"{key}={value!r} has nothing to act on: the policy has an adapter, so its reference is "
                         f"its own base with the adapter disabled (no copy to cast or quantize); leave {key} unset")
    reference = None
    if uses_reference and ref_model is not None:
        policy_params = {id(p) for p in model.parameters()}
        if any(id(p) in policy_params for p in ref_model.parameters()):
            raise ValueError("ref_model shares parameters with the policy: the reference must stay where the policy "
                             "started (it is frozen); pass a separate model, or leave ref_model unset for a frozen "
                             "copy of the policy")
        # frozen as the default copy is: no gradient is ever wanted of it, and none then keeps its activations
        reference = ref_model.requires_grad_(False)
        if ref_torch_dtype is not None:
            cast_weights(ref_model, ref_torch_dtype, "reference.dtype")
    elif uses_reference and not shared:
        reference = (quantized_copy(model, ref_quant).requires_grad_(False) if ref_quant.enabled
                     else frozen_copy(model, ref_torch_dtype, "reference.dtype"))
    return reference, shared, ref_quant
