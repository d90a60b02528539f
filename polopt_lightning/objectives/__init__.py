"""Policy-gradient objectives: pure functions of tensors, selectable by config key.

>>> from polopt_lightning.objectives import build_objective
>>> build_objective("gspo").clip_low
0.0003
"""

from .anchor import ANCHOR_SCHEDULES, SupervisedAnchor
from .base import (
    KL_ESTIMATORS,
    Objective,
    ObjectiveOutput,
    as_objective,
    available_objectives,
    build_objective,
    k3_kl,
    kl_estimate,
    register_objective,
)
from .cispo import CISPO
from .grpo import AGGREGATIONS, GRPO, bnpo, dapo, dr_grpo
from .gspo import GSPO
from .ppo import PPO
from .sapo import SAPO

__all__ = [
    "AGGREGATIONS",
    "ANCHOR_SCHEDULES",
    "CISPO",
    "GRPO",
    "GSPO",
    "KL_ESTIMATORS",
    "Objective",
    "PPO",
    "SupervisedAnchor",
    "ObjectiveOutput",
    "SAPO",
    "as_objective",
    "available_objectives",
    "bnpo",
    "build_objective",
    "dapo",
    "dr_grpo",
    "k3_kl",
    "kl_estimate",
    "register_objective",
]
