"""Optimizers by name, as ``_partial_`` factories the module calls on its own trainable parameters.

``conf/optimizer/*.yaml`` instantiate :func:`build_optimizer` with ``_partial_: true``, so the module creates the
optimizer against the parameters it trains (the adapter's alone under LoRA), after Lightning has placed them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")


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
        params: the parameters to optimise.
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

    devices = {p.device.type for p in params}
    if name.startswith("paged") and devices != {"cuda"}:
        # bitsandbytes would fall back to an ordinary optimizer with a warning: paging means nothing off CUDA
        raise ValueError(f"{key}={name} pages optimizer state through CUDA unified memory, but the parameters are on "
                         f"{', '.join(sorted(devices))}; use {key}=adamw_8bit (CPU and GPU) or adamw")
    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
           "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[name]
    return cls(params, **kwargs)
