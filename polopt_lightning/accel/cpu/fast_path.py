"""The CPU fast path as the module reaches it: one object, :class:`CPUFastPath`, holding the training-side settings
and answering the module's three questions (the context the step computes in, the callbacks training needs, the
weights to prepare before training). The rollout side is the transformers backend's (:mod:`polopt_lightning.rollout.hf`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...settings import settings_of
from . import host_memory, linear
from .weights import align_weights


@dataclass
class CPUFastPath:
    """What the CPU gets that other devices do not, for training (the module's ``accel`` argument, ``accel.*`` in
    the CLI). Each setting is ``None`` by default: on where it applies, with its stated fallback elsewhere; on other
    devices nothing here acts.

    Args:
        onednn_linear: run every float32 linear layer with a weight of at least 2**18 elements (the policy's and the
            reference's, in sampling, the reference pass and the training pass, forward and backward) through
            oneDNN's products instead of the BLAS behind ``F.linear`` (:mod:`.linear`: the same float32 arithmetic,
            rounded in another order), also the products of frozen bitsandbytes 4-bit layers with float32 compute
            (QLoRA), their input gradients included. ``None``: on where the policy has such a weight on the CPU; a
            model whose weights are all smaller (the default tiny model) computes as before. ``True`` needs oneDNN.
        keep_host_memory: while training, glibc keeps freed memory for the next step's tensors instead of giving it
            back to the system and faulting it in again (:mod:`.host_memory`; the process holds its peak until
            training ends). ``None``: where the policy trains on the CPU; ``True`` needs glibc.
    """

    onednn_linear: bool | None = None
    keep_host_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.onednn_linear and not linear.available():
            raise ValueError("accel.onednn_linear=True: this PyTorch build has no oneDNN (torch.backends.mkldnn)")
        if self.keep_host_memory and not host_memory.available():
            raise ValueError("accel.keep_host_memory=True: this process's C library is not glibc (no mallopt)")

    @classmethod
    def of(cls, value: CPUFastPath | Mapping[str, Any] | None) -> CPUFastPath:
        """``value`` itself, the defaults for ``None``, or the settings a dict names (unknown keys raise)."""
        return settings_of(cls, value, "accel")

    def compute(self, model: nn.Module, device: torch.device) -> AbstractContextManager:
        """The context a step on ``model`` computes in: :class:`.linear.OneDNNLinear` where ``onednn_linear`` says
        so, else none."""
        use = self.onednn_linear
        if use is None:
            use = device.type == "cpu" and linear.pays_for(model)
        return linear.OneDNNLinear(model) if use else nullcontext()

    def keeps_host_memory(self, device: torch.device) -> bool:
        """Whether training on ``device`` keeps freed host memory for reuse."""
        if self.keep_host_memory is None:
            return device.type == "cpu" and host_memory.available()
        return self.keep_host_memory

    def callbacks(self, present: Iterable[Any]) -> list[Any]:
        """The callbacks training needs that ``present`` (the Trainer's) lacks: the one that keeps host memory
        (:class:`.host_memory.KeepHostMemory`; it asks :meth:`keeps_host_memory` when training starts)."""
        if self.keep_host_memory is False or any(isinstance(c, host_memory.KeepHostMemory) for c in present):
            return []
        return [host_memory.KeepHostMemory()]

    def prepare(self, models: Iterable[nn.Module | None], device: torch.device) -> None:
        """Before training on the CPU: weights that do not start on a cache line copied into aligned memory
        (:func:`.weights.align_weights`; a model from ``from_pretrained`` keeps its file's offsets), the same values
        and parameter objects."""
        if device.type != "cpu":
            return
        for model in models:
            if model is not None:
                align_weights(model)
