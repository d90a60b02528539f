"""bitsandbytes' 4-bit layers as the CPU fast path reads them: a leaf that the oneDNN products
(:mod:`.linear`) and the decoding kernel (:mod:`.rowdot`) both import."""

from __future__ import annotations

import torch
from torch import nn


def four_bit_state(layer: nn.Module):
    """The quantization state of a bitsandbytes 4-bit layer (``Linear4bit``) on the CPU with float32 compute, in
    bitsandbytes' own layout (not repacked for its CPU inference kernel), else ``None``."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if (state is None or not hasattr(layer, "compute_dtype") or weight.device.type != "cpu"
            or layer.compute_dtype not in (None, torch.float32) or getattr(state, "packing_format_for_cpu", False)):
        return None
    return state
