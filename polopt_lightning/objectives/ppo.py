"""PPO (Schulman et al. 2017) as verl and OpenRLHF run it on language models: a critic's values, GAE over the completion
tokens, the clipped surrogate per token."""

from __future__ import annotations

from .base import register_objective
from .grpo import GRPO


@register_objective("ppo")
class PPO(GRPO):
    """PPO: :class:`~polopt_lightning.objectives.grpo.GRPO`'s per-token clipped surrogate (and its KL term, dual clip
    and aggregations), token-mean by default as verl's ``loss_agg_mode``, taking per-token advantages. Its advantage
    estimator is ``gae`` (:attr:`advantage_estimator`): the module trains a critic beside the policy (the ``critic``
    settings, :mod:`~polopt_lightning.step.critic`) and the advantages come from its values by GAE, whitened over the
    step's tokens. Another estimator may be named (``experience.advantage_estimator``): then there is no critic."""

    advantage_estimator = "gae"

    def __init__(self, clip_low: float = 0.2, clip_high: float | None = None, beta: float = 0.0,
                 aggregation: str = "token-mean", max_completion_length: int | None = None,
                 advantage_scale: str = "group", dual_clip: float | None = None, kl_estimator: str = "k3") -> None:
        super().__init__(clip_low, clip_high, beta, aggregation, max_completion_length, advantage_scale, dual_clip,
                         kl_estimator)
