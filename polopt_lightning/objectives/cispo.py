"""CISPO (MiniMax-M1, 2025): REINFORCE on every token, weighted by its importance ratio clipped and detached."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import masked_mean, register_objective
from .grpo import GRPO


@register_objective("cispo")
class CISPO(GRPO):
    """Clipped IS-weight Policy Optimization: per token ``-sg(clip(r, 1-clip_low, 1+clip_high)) * A * lp``
    (+ ``beta*KL``), reduced by ``aggregation`` (token-mean, as in the paper).

    Where PPO's clip removes a token's gradient once its ratio leaves the range, CISPO keeps every token's gradient
    and bounds only its weight: the rare tokens that reasoning turns on ("however", "wait") keep contributing. At
    ``r = 1`` the gradient is GRPO's. TRL's ``loss_type="cispo"`` caps the weight at ``epsilon_high`` itself (an
    absolute bound); here the cap is ``1 + clip_high``, as verl and the paper write it.

    Args:
        clip_low: the weight's floor is ``1 - clip_low``; ``None``: no floor (the paper's setting).
        clip_high: the weight's cap is ``1 + clip_high``.
        beta, aggregation, max_completion_length, advantage_scale, kl_estimator: as :class:`GRPO`.
    """

    def __init__(self, clip_low: float | None = None, clip_high: float = 4.0, beta: float = 0.0,
                 aggregation: str = "token-mean", max_completion_length: int | None = None,
                 advantage_scale: str = "group", kl_estimator: str = "k3") -> None:
        if clip_high <= 0:
            raise ValueError(f"clip_high must be > 0, got {clip_high}")
        super().__init__(0.0 if clip_low is None else clip_low, clip_high, beta, aggregation, max_completion_length,
                         advantage_scale, kl_estimator=kl_estimator)
        self.floor = clip_low is not None

    def surrogate(self, ratio: Tensor, advantages: Tensor, logprobs: Tensor, mask: Tensor
                  ) -> tuple[Tensor, dict[str, Tensor]]:
        low = 1.0 - self.clip_low if self.floor else None
        weight = ratio.clamp(min=low, max=1.0 + self.clip_high).detach()
        per_token = -weight * advantages * logprobs
        with torch.no_grad():
            capped = masked_mean((ratio > 1.0 + self.clip_high).float(), mask)
            floored = masked_mean((ratio < low).float(), mask) if low is not None else capped.new_zeros(())
        return per_token, {"clip_frac_low": floored, "clip_frac_high": capped, "clip_frac": floored + capped}
