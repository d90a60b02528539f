"""Lightning strategies as config groups (``conf/strategy/``): DDP, DDP on CPU processes, FSDP, DeepSpeed ZeRO.

Each factory returns Lightning's own strategy object, configured for this module: a policy trained with manual
optimisation whose training step samples (needs whole parameters) and then makes several optimizer steps. What
cannot work is refused before anything starts, naming the keys (:func:`check_strategy`). Processes are launched by
Lightning (``devices`` x ``num_nodes``), by ``torchrun`` or by SLURM; nothing here starts one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from torch import nn

SHARDED = ("fsdp", "deepspeed")


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of a ``transformers`` model's repeated blocks (``_no_split_modules``, e.g. ``Qwen2DecoderLayer``):
    the units FSDP shards and gathers one at a time."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in base.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"strategy.auto_wrap=decoder_layers: {type(base).__name__} names no repeated block "
                         "(_no_split_modules); set strategy.auto_wrap=null to shard the model as one unit")
    return classes


def ddp(model: nn.Module | None = None, **kwargs: Any):
    """``DDPStrategy``; ``process_group_backend="gloo"`` runs the processes on CPUs."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**kwargs)


def fsdp(model: nn.Module | None = None, auto_wrap: str | None = "decoder_layers", **kwargs: Any):
    """``FSDPStrategy`` with each decoder layer its own unit (``auto_wrap="decoder_layers"``) and the original
    parameters kept (``use_orig_params``: frozen and trainable weights side by side, as LoRA and a reference copy
    need)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if auto_wrap not in (None, "decoder_layers"):
        raise ValueError(f"strategy.auto_wrap must be decoder_layers or null, got {auto_wrap!r}")
    if auto_wrap and model is not None:
        kwargs["auto_wrap_policy"] = decoder_layer_classes(model)
    return FSDPStrategy(**kwargs)


def deepspeed(model: nn.Module | None = None, **kwargs: Any):
    """``DeepSpeedStrategy`` (ZeRO stage 2 or 3); needs the ``deepspeed`` package (``pip install deepspeed``)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"strategy=deepspeed_zero{kwargs.get('stage', 2)} needs the deepspeed package: "
                          "pip install 'polopt-lightning[deepspeed]' (CUDA machines)")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(**kwargs)


def strategy_kind(cfg: Mapping[str, Any] | None) -> str:
    """``"auto"``, ``"ddp"``, ``"fsdp"`` or ``"deepspeed"`` for a ``strategy`` config node."""
    target = str((cfg or {}).get("_target_", ""))
    for kind in ("ddp", *SHARDED):
        if target.endswith(f".{kind}"):
            return kind
    return "auto" if not target else "custom"


def check_strategy(kind: str, *, accelerator: str, quantized: str, micro_batch_tokens: int | None,
                   optimizer: str | None) -> None:
    """Refuse combinations that cannot run, naming the config keys, before any model is loaded."""
    if kind == "fsdp" and accelerator == "cpu":
        raise ValueError("strategy=fsdp needs CUDA devices (Lightning and torch's FSDP refuse the CPU): use "
                         "strategy=ddp_cpu for processes on the CPU, or trainer=gpu")
    if kind == "deepspeed" and accelerator == "cpu":
        raise ValueError("strategy=deepspeed_zero2/3 needs CUDA devices: use strategy=ddp_cpu on the CPU, or "
                         "trainer=gpu")
    if kind in SHARDED and quantized != "none":
        raise ValueError(f"quantization={quantized} with strategy={kind}: a sharded strategy splits every weight "
                         "across processes, and bitsandbytes' packed weights cannot be split; use strategy=ddp (each "
                         "process holds the small quantized base) or quantization=none")
    if kind == "deepspeed" and micro_batch_tokens:
        raise ValueError("module.micro_batch_tokens with strategy=deepspeed_zero2/3: DeepSpeed's engine expects one "
                         "backward per optimizer step; set module.micro_batch_tokens=null")
    if kind == "deepspeed" and optimizer and optimizer != "adamw":
        raise ValueError(f"optimizer={optimizer} with strategy=deepspeed_zero2/3: DeepSpeed partitions the optimizer "
                         "state itself; use optimizer=adamw")
