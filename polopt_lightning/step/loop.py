"""What the update needs from the loop that runs it (:class:`TrainingLoop`): the backward pass, clipping, the optimizer
step, gradient synchronisation, the step counter. :class:`LightningLoop` is the module's, over its Trainer (precision
scaling, DDP/FSDP, DeepSpeed); :class:`TorchLoop` runs the step in plain PyTorch on one process, with no Trainer (as
the tests do, and as a script outside Lightning can)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class TrainingLoop(Protocol):
    """The backend of :class:`~polopt_lightning.step.update.Updater`. Reductions across processes go through
    ``torch.distributed`` (:mod:`polopt_lightning.distributed`), which every strategy initialises."""

    @property
    def device(self) -> torch.device:
        """Where the rollout's tensors and the metrics live."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (the mini-batch orders are drawn from it)."""

    @property
    def max_steps(self) -> int | None:
        """The last optimizer step, or ``None``: a rollout's updates stop there."""

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of ``loss`` (with the precision's and the strategy's scaling)."""

    def clip_gradients(self, optimizer: Any, max_norm: float) -> None:
        """Clip the gradients by global norm where :meth:`clips_in_place` is false (scaled or sharded gradients)."""

    def clips_in_place(self, policy: nn.Module) -> bool:
        """Whether the update may scale the gradients itself by the norm it measured (:func:`clips_in_place`)."""

    def no_sync(self, policy: nn.Module, last: bool) -> AbstractContextManager[None]:
        """No gradient reduction in this backward unless ``last`` (:func:`gradient_sync`)."""

    def optimizer_step(self, optimizer: Any) -> None:
        """One optimizer step; the step counter moves on."""


@contextmanager
def gradient_sync(wrapped: nn.Module | None, policy: nn.Module, last: bool) -> Iterator[None]:
    """No gradient reduction in the backward passes of a mini-batch's pieces but the last: they accumulate locally and
    the last one reduces the sum (DDP's ``no_sync`` on the strategy's ``wrapped`` model, FSDP2's
    ``set_requires_gradient_sync`` on the ``policy``)."""
    from torch.distributed.fsdp import FSDPModule

    if last:
        yield
    elif isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        with wrapped.no_sync():
            yield
    elif isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        yield


def clips_in_place(trainer: Any, policy: nn.Module, mesh: Any = None) -> bool:
    """Whether clipping can scale the gradients by the norm the update measured, instead of Lightning's
    ``clip_gradients`` measuring it again: gradients that no loss scaler holds scaled (``16-mixed`` has one), that no
    DeepSpeed engine clips itself and that are whole on each process (FSDP2's are sharded DTensors, under a device
    ``mesh``). Without a ``trainer``: yes. The same rule picks the optimizer's kernel, before any gradient exists
    (Lightning's mixed-precision plugins refuse to clip for a fused optimizer)."""
    if trainer is None:
        return True
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return False
    if "deepspeed" in type(getattr(trainer, "strategy", None)).__name__.lower():
        return False
    if mesh is not None:
        return False
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) or isinstance(p.grad, DTensor) for p in policy.parameters())


class LightningLoop:
    """The :class:`TrainingLoop` of a LightningModule in manual optimization, over its Trainer: ``manual_backward``
    (the precision's and the strategy's scaling), Lightning's ``clip_gradients``, the strategy's wrapper for
    ``no_sync``, the Trainer's ``max_steps``; the optimizer Lightning wraps counts the steps. Without a Trainer (the
    module built but not fitted) it has no scaling to apply: plain backward and clipping."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def _trainer(self) -> Any:
        return self.module._trainer  # None outside a Trainer (the module's own property raises then)

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def global_step(self) -> int:
        return self.module.global_step

    @property
    def max_steps(self) -> int | None:
        trainer = self._trainer()
        return trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None

    def backward(self, loss: Tensor) -> None:
        if self._trainer() is None:
            loss.backward()
        else:
            self.module.manual_backward(loss)

    def clip_gradients(self, optimizer: Any, max_norm: float) -> None:
        if self._trainer() is None:
            torch.nn.utils.clip_grad_norm_(self.module.policy.parameters(), max_norm)
        else:
            self.module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def clips_in_place(self, policy: nn.Module) -> bool:
        return clips_in_place(self._trainer(), policy, getattr(self.module, "_device_mesh", None))

    def no_sync(self, policy: nn.Module, last: bool) -> AbstractContextManager[None]:
        trainer = self._trainer()
        return gradient_sync(trainer.strategy.model if trainer is not None else None, policy, last)

    def optimizer_step(self, optimizer: Any) -> None:
        optimizer.step()


class TorchLoop:
    """A :class:`TrainingLoop` in plain PyTorch on one process: ``loss.backward()``, ``clip_grad_norm_``, a step
    counter of its own (from ``global_step``) and an optional ``max_steps``. ``device``: the policy's (where the
    update puts the rollout's row indices and its metrics)."""

    def __init__(self, device: torch.device | str = "cpu", global_step: int = 0, max_steps: int | None = None) -> None:
        self.device = torch.device(device)
        self.global_step = global_step
        self.max_steps = max_steps

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def clip_gradients(self, optimizer: Any, max_norm: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clips_in_place(self, policy: nn.Module) -> bool:
        return True

    def no_sync(self, policy: nn.Module, last: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def optimizer_step(self, optimizer: Any) -> None:
        optimizer.step()
        self.global_step += 1
