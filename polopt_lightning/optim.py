"""Optimizers by name, as ``_partial_`` factories the module calls on its own trainable parameters.

``conf/optimizer/*.yaml`` instantiate :func:`build_optimizer` with ``_partial_: true``, so the module creates the
optimizer against the parameters it trains (the adapter's alone under LoRA), after Lightning has placed them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from .settings import check_ranges

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")
RULES = {
    "name": (lambda v: v in OPTIMIZERS, f"one of {OPTIMIZERS}"),
    "lr": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "eps": (lambda v: v > 0, "> 0"),
}


def optimizer_factory(value: Callable[..., torch.optim.Optimizer] | Mapping[str, Any] | None,
                      ) -> Callable[..., torch.optim.Optimizer]:
    """The module's ``optimizer`` argument as a factory ``params -> Optimizer``: a callable as it is (a partial's
    keywords checked), or :func:`build_optimizer` with the settings a dict gives (``None``: AdamW at its defaults).
    A setting out of range raises a ValueError naming ``optimizer.<key>``."""
    if value is None or isinstance(value, Mapping):
        settings = dict(value or {})
        check_ranges(settings, RULES, "optimizer")
        return partial(build_optimizer, **settings)
    if not callable(value):
        raise TypeError(f"optimizer must be a factory params -> Optimizer, a dict of build_optimizer's settings or "
                        f"None, got {type(value).__name__}")
    check_ranges(getattr(value, "keywords", None) or {}, RULES, "optimizer")
    return value


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str = "adamw",
    lr: float = 1e-5,
    weight_decay: float = 0.0,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool | None = None,
    key: str = "optimizer.name",
) -> torch.optim.Optimizer:
    """An AdamW of the kind ``name`` names.

    Args:
        params: the parameters to optimise, or parameter groups (dicts with ``params`` and settings of their own, as
            torch's optimizers take them: the critic's group).
        name: ``adamw`` (torch's), ``adamw_8bit`` (bitsandbytes: moments in 8 bits, 75% less optimizer memory;
            CPU and GPU), ``paged_adamw`` / ``paged_adamw_8bit`` (bitsandbytes: moments in CUDA unified memory that
            pages to the host under memory pressure; CUDA only, refused elsewhere).
        lr, weight_decay, betas, eps: AdamW's settings.
        fused: torch's fused kernel (``adamw`` only); ``None``: where the parameters allow it.
        key: the config key errors name.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"{key} must be one of {OPTIMIZERS}, got {name!r}")
    params = list(params)
    if not params:
        raise ValueError(f"{key}={name}: there is no trainable parameter to optimise")
    kwargs = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    if name == "adamw":
        if fused is not False:
            try:  # ~5x faster per step on CPU and GPU; not every parameter type supports it
                return torch.optim.AdamW(params, fused=True, **kwargs)
            except (RuntimeError, TypeError, ValueError):
                if fused:
                    raise
        return torch.optim.AdamW(params, **kwargs)
    import bitsandbytes as bnb

    devices = {p.device.type for entry in params for p in (entry["params"] if isinstance(entry, dict) else [entry])}
    if name.startswith("paged") and devices != {"cuda"}:
        # bitsandbytes would fall back to an ordinary optimizer with a warning: paging means nothing off CUDA
        raise ValueError(f"{key}={name} pages optimizer state through CUDA unified memory, but the parameters are on "
                         f"{', '.join(sorted(devices))}; use {key}=adamw_8bit (CPU and GPU) or adamw")
    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
           "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[name]
    return cls(params, **kwargs)


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over ``total`` steps (``trainer.max_steps``, kept in its state) whose restored state, when the
    total changed (a resume with another ``trainer.max_steps``), also sets the rates of the step it restores: the
    run follows the new schedule from its first step on, where the optimizer's restored groups would hold the old
    schedule's rate for one step. With the total unchanged the restored rates stand as the checkpoint holds them
    (a collapse rollback's scaled rate included)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Callable[[int], float], total: int) -> None:
        self.total = total
        super().__init__(optimizer, lr_lambda)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        total = self.total
        super().load_state_dict(state_dict)
        saved, self.total = state_dict.get("total"), total
        if saved is None or saved == total:  # the same schedule (or a checkpoint from before the total was kept)
            return
        for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            rate = base * factor(self.last_epoch)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(rate)
            else:
                group["lr"] = rate
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


def optimizer_and_schedule(params: list[Any], factory: Callable[..., torch.optim.Optimizer],
                           config: Any, trainer: Any, clips_in_place: Callable[[], bool],
                           adjust: Callable[[torch.optim.Optimizer], None] | None = None) -> dict[str, Any]:
    """What the module's ``configure_optimizers`` returns: ``factory(params)`` and the learning-rate schedule of the
    ``update`` settings ``config`` (:func:`~polopt_lightning.step.update.lr_factor`, warm-up then decay over the
    ``trainer``'s ``max_steps``, stepped every optimizer step).

    Lightning's mixed-precision plugins refuse to clip the gradients of an optimizer that unscales them itself (as
    torch's fused AdamW declares it does). Where the step clips through Lightning (a loss scaler, sharded gradients:
    ``clips_in_place()`` is false) this project's factory then builds the unfused kernel; under bf16-mixed the step
    clips in place and keeps the fused one (several times faster at 0.5B: docs/performance.md). ``adjust`` changes the
    optimizer before the schedule takes its groups' learning rates as their peaks.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    from .step.update import lr_factor

    mixed = trainer is not None and isinstance(trainer.precision_plugin, MixedPrecision)
    ours = getattr(factory, "func", None) is build_optimizer
    if mixed and config.max_grad_norm and ours and not clips_in_place():
        factory = partial(factory, fused=False)
    optimizer = factory(params)
    if adjust is not None:  # e.g. a parameter group's learning rate from the others' (the critic's)
        adjust(optimizer)
    total = trainer.max_steps if trainer is not None and trainer.max_steps > 0 else 0
    scheduler = Schedule(
        optimizer, partial(lr_factor, schedule=config.lr_schedule, warmup=config.warmup_steps, total=total,
                           floor=config.min_lr_ratio), total)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
