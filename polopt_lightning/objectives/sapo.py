"""SAPO (Soft Adaptive Policy Optimization, Qwen 2025): a smooth gate on the importance ratio instead of a hard clip."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import masked_mean, register_objective
from .grpo import GRPO


@register_objective("sapo")
class SAPO(GRPO):
    """Per token ``-f(r) * A`` (+ ``beta*KL``) with the soft gate ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``:
    ``tau = tau_pos`` where ``A > 0``, ``tau_neg`` where ``A < 0``. The gate's slope is 1 at ``r = 1`` (GRPO's gradient
    on-policy) and fades smoothly as the ratio leaves 1, instead of dropping to 0 at a clip bound; a larger
    ``tau_neg`` fades negative advantages faster (they raise many unsampled tokens). Reduced by ``aggregation``:
    by default each sequence's token mean, then the mean over sequences (``seq-mean-token-mean``), the paper's
    ``1/G sum_i 1/|y_i| sum_t``, as TRL's ``loss_type="sapo"`` (reduced with ``"grpo"``) and verl's
    ``loss_mode="sapo"`` (which forces ``seq-mean-token-mean``) do; ``aggregation="token-mean"`` is DAPO's one mean
    over the batch's tokens (this class's default before issue 55).

    Args:
        tau_pos: the gate's temperature for positive advantages (1.0 in the paper).
        tau_neg: for negative advantages (1.05; at least ``tau_pos``).
        beta, aggregation, max_completion_length, advantage_scale, kl_estimator: as :class:`GRPO`.
    """

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, beta: float = 0.0,
                 aggregation: str = "seq-mean-token-mean", max_completion_length: int | None = None,
                 advantage_scale: str = "group", kl_estimator: str = "k3") -> None:
        if not 0 < tau_pos <= tau_neg:
            raise ValueError(f"SAPO needs 0 < tau_pos <= tau_neg, got tau_pos={tau_pos}, tau_neg={tau_neg}")
        super().__init__(0.2, None, beta, aggregation, max_completion_length, advantage_scale,
                         kl_estimator=kl_estimator)
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)

    def surrogate(self, ratio: Tensor, advantages: Tensor, logprobs: Tensor, mask: Tensor
                  ) -> tuple[Tensor, dict[str, Tensor]]:
        tau = torch.where(advantages > 0, torch.full_like(advantages, self.tau_pos),
                          torch.full_like(advantages, self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        per_token = -gate * advantages
        with torch.no_grad():  # how much the gate has faded the gradient: its slope below half of the on-policy one
            slope = 4.0 * torch.sigmoid(tau * (ratio - 1.0)) * (1.0 - torch.sigmoid(tau * (ratio - 1.0)))
            faded = masked_mean((slope < 0.5).float().expand_as(ratio), mask)
        return per_token, {"clip_frac": faded, "gate_slope_mean": masked_mean(slope.expand_as(ratio), mask)}
