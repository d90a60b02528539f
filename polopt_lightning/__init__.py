"""polopt-lightning: RL post-training of language models (GRPO, GSPO, DAPO, Dr. GRPO) on PyTorch Lightning."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Heavy pieces (Lightning, transformers) load on first use so the pure-tensor parts import fast.
_LAZY = {
    "PolicyOptimizationModule": "polopt_lightning.module",
    "PromptDataModule": "polopt_lightning.data",
    "RewardComposer": "polopt_lightning.rewards",
    "GRPO": "polopt_lightning.objectives",
    "GSPO": "polopt_lightning.objectives",
    "group_relative_advantages": "polopt_lightning.advantages",
    "CollapseMonitor": "polopt_lightning.callbacks",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polopt_lightning' has no attribute {name!r}")
