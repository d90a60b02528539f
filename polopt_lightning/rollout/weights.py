"""The policy's weights as the backends that hold their own copy receive them (vLLM, generation servers): merged,
or a LoRA policy's base and adapters apart (adapter-only sync), by the names of the plain ``transformers`` form."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._hf import peft_base


def policy_weights(model: nn.Module, key: str = "rollout=vllm") -> dict[str, Tensor]:
    """The weights vLLM (or a generation server) loads for ``model``, by the names of its plain ``transformers`` form:
    a peft policy's adapters merged into its base (the base's own tensors left as they are). A quantized
    (bitsandbytes) base has no plain form to push: refused with a ValueError naming ``key``."""
    from ..models import has_adapter, is_quantized

    if is_quantized(model):
        raise ValueError(f"{key} with a quantized policy (quantization=int8/nf4): its weights have no plain form to "
                         "push; use rollout=hf, or quantization=none with adapter=lora")
    if not has_adapter(model):
        return {k: whole(v) for k, v in model.state_dict().items()}
    base = model.get_base_model()
    with torch.no_grad():
        model.merge_adapter()
        try:
            weights = {k.replace(".base_layer", ""): whole(v).clone() for k, v in base.state_dict().items()
                       if "lora_" not in k}
        finally:
            model.unmerge_adapter()
    return weights


def whole(tensor: Tensor) -> Tensor:
    """A weight as one plain tensor: an FSDP2 shard (a DTensor) gathered (collective), anything else as it is."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def lora_layers(model: nn.Module) -> dict[str, tuple[Tensor, Tensor, float]] | None:
    """``{weight name: (A, B, scaling)}`` of a LoRA policy (by the names of its plain ``transformers`` form, e.g.
    ``model.layers.0.self_attn.q_proj.weight``), whose weights are then ``base + scaling x B @ A``: peft LoRA layers
    over ``nn.Linear`` or bitsandbytes' quantized layers (QLoRA), one adapter each, no variant (DoRA), nothing but
    the adapters trainable. ``None`` for any other policy (its weights are pushed merged)."""
    from ..models import has_adapter, is_quantized_layer

    if not has_adapter(model):
        return None
    if any(p.requires_grad and "lora_" not in name for name, p in model.named_parameters()):
        return None  # modules_to_save and the like: trained weights outside the adapters
    out = {}
    for name, module in model.get_base_model().named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if not active:
            continue
        a = active[0]
        A, B = module.lora_A[a], module.lora_B[a]
        plain = type(module.base_layer) is nn.Linear or is_quantized_layer(module.base_layer)
        if (len(active) != 1 or not plain or type(A) is not nn.Linear
                or type(B) is not nn.Linear or B.bias is not None or getattr(module, "fan_in_fan_out", False)
                or getattr(module, "use_dora", {}).get(a) or getattr(module, "merged", False)):
            return None
        out[f"{name}.weight"] = (A.weight, B.weight, float(module.scaling[a]))
    if "lm_head.weight" in out and getattr(peft_base(model).config, "tie_word_embeddings", False):
        return None  # an adapter on a head tied to the embeddings: pushed merged
    return out or None


def adapter_layers(model: nn.Module, adapter_only: bool | None) -> dict[str, tuple[Tensor, Tensor, float]] | None:
    """:func:`lora_layers` where ``rollout.adapter_only`` allows them (``None``: where the policy has them,
    ``False``: never); ``True`` for a policy without them is an error naming the key."""
    layers = lora_layers(model) if adapter_only is not False else None
    if adapter_only and layers is None:
        raise ValueError("rollout.adapter_only=true: the policy is not a plain LoRA policy (peft LoRA adapters, no DoRA "
                         "or other variant, nothing else trainable, no adapter on a tied head); use "
                         "rollout.adapter_only=null")
    return layers


def base_weights(model: nn.Module, keep_quantized: bool = False) -> dict[str, Tensor]:
    """A LoRA policy's base weights, unmerged, by their plain ``transformers`` names; a quantized base's weights as
    the floating-point values its layers compute with (in the dtype of its other weights), or with
    ``keep_quantized`` as bitsandbytes holds them (4-bit: packed bytes and quantization-state entries, the form a
    saved 4-bit model has)."""
    from ..export import dequantized_state
    from ..models import float_dtype, is_quantized
    state = {k: whole(v) for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    if is_quantized(model) and not keep_quantized:
        state = dequantized_state(state, float_dtype(model))
    return {k.replace(".base_layer", ""): v for k, v in state.items()}



def four_bit(state: dict[str, Tensor]) -> bool:
    """Whether ``state`` holds bitsandbytes 4-bit weights (and no 8-bit ones: those travel dequantized)."""
    from ..export import QUANT_STATE

    return any(QUANT_STATE in k for k in state) and not any(k.endswith("SCB") for k in state)
