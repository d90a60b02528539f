"""polopt-lightning: RL post-training of language models (GRPO, GSPO, DAPO, Dr. GRPO) on PyTorch Lightning."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

__version__ = "0.1.0"

# Heavy pieces (Lightning, transformers) load on first use so the pure-tensor parts import fast.
_LAZY = {
    "PolicyOptimizationModule": "polopt_lightning.module",
    "PromptDataModule": "polopt_lightning.data",
    "RewardComposer": "polopt_lightning.rewards",
    "GRPO": "polopt_lightning.objectives",
    "GSPO": "polopt_lightning.objectives",
    "group_relative_advantages": "polopt_lightning.step.advantages",
    "CollapseMonitor": "polopt_lightning.callbacks",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polopt_lightning' has no attribute {name!r}")


# Modules that moved, old path -> new: saved runs name them in their configs (``_target_: polopt_lightning.update.
# UpdateConfig``, ``rollout.tools``), so the old path still imports, as the same module, with a FutureWarning.
MOVED_MODULES = {
    **{f"polopt_lightning.{name}": f"polopt_lightning.step.{name}"
       for name in ("experience", "update", "logprobs", "entropy", "reference", "advantages")},
    "polopt_lightning.lean_step": "polopt_lightning.accel.lean_step",
    "polopt_lightning.environments": "polopt_lightning.rollout.environments",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a :data:`MOVED_MODULES` old path as its new module (the one object under both names)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec: Any) -> Any:
        warnings.warn(f"{spec.name} has moved to {MOVED_MODULES[spec.name]}: import it from there (the old path "
                      "goes in a later release)", FutureWarning, stacklevel=2)
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: Any) -> None:  # the new module is already executed
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
