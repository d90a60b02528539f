"""Lightning strategies as config groups (``conf/strategy/``): DDP, DDP on CPU processes, FSDP2, DeepSpeed ZeRO.

Each factory returns Lightning's own strategy object, configured for this module: a policy trained with manual
optimisation whose training step samples (needs whole parameters) and then makes several optimizer steps. What
cannot work is refused before anything starts, naming the keys (:func:`check_strategy`). Processes are launched by
Lightning (``devices`` x ``num_nodes``), by ``torchrun`` or by SLURM; nothing here starts one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from ._hf import peft_base

SHARDED = ("fsdp", "deepspeed")


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of a ``transformers`` model's repeated blocks (``_no_split_modules``, e.g. ``Qwen2DecoderLayer``):
    the units FSDP shards and gathers one at a time."""
    base = peft_base(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in base.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"strategy=fsdp: {type(base).__name__} names no repeated block (_no_split_modules) to "
                         "shard layer by layer; use strategy=ddp")
    return classes


def ddp(model: nn.Module | None = None, **kwargs: Any):
    """``DDPStrategy``; ``process_group_backend="gloo"`` runs the processes on CPUs."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**kwargs)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure data parallelism: one shard per process, no tensor parallelism.

    Args:
        reshard_after_forward: free each layer's gathered weights after its forward (less memory, one more gather in
            the backward pass); read by the module when it shards the model.
        save_distributed_checkpoint: a folder of shards per checkpoint instead of one file gathered on the first
            process.
    """

    def __init__(self, reshard_after_forward: bool = True, save_distributed_checkpoint: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        no_inference_mode(trainer)
        super().setup(trainer)


def no_inference_mode(trainer: Any) -> None:
    """Evaluate under ``no_grad`` instead of ``inference_mode`` in ``validate``/``test``/``predict`` (validation
    inside ``fit`` has ``no_grad`` already), as Lightning does for its own ``FSDPStrategy`` (pytorch/pytorch#95957):
    under FSDP2 on nccl, the best checkpoint saved at the end of a ``trainer.validate`` detaches the sharded parameters
    inside inference mode, which they refuse ("Cannot set version_counter for inference tensor"). On gloo Lightning
    evaluates under ``no_grad`` already."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


def fsdp(model: nn.Module | None = None, **kwargs: Any) -> FSDP2Strategy:
    """Fully sharded data parallelism with torch's FSDP2 (``fully_shard``) through Lightning's
    ``ModelParallelStrategy``: every decoder layer, then the rest of the model, sharded over all processes. Runs on
    CUDA (nccl) and on CPU processes (gloo). The module shards its policy (and reference copy) in ``configure_model``
    and gathers the whole policy once per rollout (see :meth:`PolicyOptimizationModule.configure_model`)."""
    if model is not None:
        decoder_layer_classes(model)  # a model without repeated blocks is refused now, not after the launch
    return FSDP2Strategy(**kwargs)


def shard_fully(model: nn.Module, mesh: Any, reshard_after_forward: bool = True) -> nn.Module:
    """Apply ``fully_shard`` to each repeated block of ``model`` (its ``_no_split_modules``), then to ``model``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):  # Lightning calls configure_model at every fit and validate
        return model
    classes = tuple(decoder_layer_classes(model))
    for module in list(model.modules()):
        if isinstance(module, classes):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def deepspeed(model: nn.Module | None = None, **kwargs: Any):
    """``DeepSpeedStrategy`` (ZeRO stage 2 or 3); needs the ``deepspeed`` package (``pip install deepspeed``)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"strategy=deepspeed_zero{kwargs.get('stage', 2)} needs the deepspeed package: "
                          "pip install 'polopt-lightning[deepspeed]' (CUDA machines)")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(**kwargs)


class WholeParameters:
    """:func:`gathered_for_sampling` that a block nested in another enters for free: ``with whole(strategy):`` gathers
    the policy unless an outer block holds it gathered already (a step's draws all run inside one gathering)."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy, self.gathered = policy, False

    @contextmanager
    def __call__(self, strategy: Any | None) -> Iterator[None]:
        if self.gathered:
            yield
            return
        with gathered_for_sampling(self.policy, strategy):
            self.gathered = True
            try:
                yield
            finally:
                self.gathered = False


@contextmanager
def gathered_for_sampling(policy: nn.Module, strategy: Any | None) -> Iterator[None]:
    """The whole policy gathered on every process while the block runs (a rollout), then sharded again.

    Sampling calls the model once per token; gathering each layer at each call (what a sharded forward does) would
    cost a collective per layer per token, so the whole policy is gathered once, as TRL's
    ``ds3_gather_for_generation`` does. FSDP2: every sharded module unsharded and kept so through the block's
    forwards (the lean decoding step calls into a layer's submodules, which would otherwise meet the shards).
    DeepSpeed ZeRO-3: its ``GatheredParameters``. Anything else: nothing to do. Collective: every process must
    enter it as often.
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    if sharded:
        # outside inference mode even under `trainer.validate` (inference mode on nccl): gathered buffers made there
        # are inference tensors, and FSDP2's wait for the gather reads their version counters, which they lack
        with torch.inference_mode(False):
            for module in sharded:
                module.unshard()
                module.set_reshard_after_forward(False)
        try:
            yield
        finally:
            reshard = getattr(strategy, "reshard_after_forward", True)
            with torch.inference_mode(False):
                for module in sharded:
                    module.set_reshard_after_forward(reshard)
                    module.reshard()
    elif type(strategy).__name__ == "DeepSpeedStrategy" and getattr(strategy, "zero_stage_3", False):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters())):
            yield
    else:
        yield


def strategy_kind(cfg: Mapping[str, Any] | None) -> str:
    """``"auto"``, ``"ddp"``, ``"fsdp"`` or ``"deepspeed"`` for a ``strategy`` config node."""
    target = str((cfg or {}).get("_target_", ""))
    for kind in ("ddp", *SHARDED):
        if target.endswith(f".{kind}"):
            return kind
    return "auto" if not target else "custom"


def check_strategy(kind: str, *, accelerator: str, quantized: str, micro_batch_tokens: int | None,
                   optimizer: str | None, backend: str | None = None) -> None:
    """Refuse combinations that cannot run, naming the config keys, before any model is loaded."""
    if kind == "fsdp" and accelerator == "cpu" and backend not in (None, "gloo"):
        raise ValueError(f"strategy=fsdp on the CPU needs strategy.process_group_backend=gloo, got {backend}")
    if kind == "deepspeed" and accelerator == "cpu":
        raise ValueError("strategy=deepspeed_zero2/3 needs CUDA devices: use strategy=ddp_cpu on the CPU, or "
                         "trainer=gpu")
    if kind in SHARDED and quantized != "none":
        raise ValueError(f"quantization={quantized} with strategy={kind}: a sharded strategy splits every weight "
                         "across processes, and bitsandbytes' packed weights cannot be split; use strategy=ddp (each "
                         "process holds the small quantized base) or quantization=none")
    if kind == "deepspeed" and micro_batch_tokens:
        raise ValueError("update.micro_batch_tokens with strategy=deepspeed_zero2/3: DeepSpeed's engine expects one "
                         "backward per optimizer step; set update.micro_batch_tokens=null")
    if kind == "deepspeed" and optimizer and optimizer != "adamw":
        raise ValueError(f"optimizer={optimizer} with strategy=deepspeed_zero2/3: DeepSpeed partitions the optimizer "
                         "state itself; use optimizer=adamw")
