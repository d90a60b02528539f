"""GSPO (Qwen, Zheng et al. 2025): one length-normalised importance ratio per sequence, clipped per sequence."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    LOG_RATIO_LIMIT,
    Objective,
    ObjectiveOutput,
    check_advantage_scale,
    check_beta,
    check_clip,
    check_kl_estimator,
    clipped_surrogate,
    kl_estimate,
    masked_max,
    masked_mean,
    mean_over_sequences,
    register_objective,
    sequence_mean,
)

VARIANTS = ("sequence", "token")


@register_objective("gspo")
class GSPO(Objective):
    """Group Sequence Policy Optimization.

    ``s_i = exp(sum_t mask*(lp-old) / |y_i|)``; per sequence ``-min(s*A, clip(s, 1-clip_low, 1+clip_high)*A)``,
    averaged over sequences, plus ``beta * mean_i(mean_t KL)`` when ``beta > 0``.
    ``variant="token"`` (GSPO-token) uses ``s_it = sg[s_i] * exp(lp_t - sg[lp_t])``: the same value and, for
    sequence-level advantages, the same gradient, but it accepts per-token advantages ``[B, T]``.

    Args:
        clip_low: lower clip range of the sequence ratio (paper: 3e-4).
        clip_high: upper clip range (paper: 4e-4); ``None`` means ``clip_low``.
        beta: weight of the KL penalty; the paper uses none.
        kl_estimator: its per-token estimator (``"k3"`` by default; see :func:`~.base.kl_estimate`).
        variant: ``"sequence"`` or ``"token"``.
        advantage_scale: how the trainer scales group advantages (``"group"``, ``"batch"`` or ``"none"``).
    """

    def __init__(
        self,
        clip_low: float = 3e-4,
        clip_high: float | None = 4e-4,
        beta: float = 0.0,
        variant: str = "sequence",
        advantage_scale: str = "group",
        kl_estimator: str = "k3",
    ) -> None:
        self.clip_low, self.clip_high = check_clip(clip_low, clip_high)
        self.kl_estimator = check_kl_estimator(kl_estimator)
        self.beta = check_beta(beta)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        self.accepts_token_advantages = variant == "token"
        self.advantage_scale = check_advantage_scale(advantage_scale)

    def compute(self, logprobs, old_logprobs, advantages, mask, ref_logprobs) -> ObjectiveOutput:
        nonempty = mask.any(-1)  # [B]
        # Length-normalised sequence log-ratio; the clamp only guards against overflow.
        seq_log_ratio = sequence_mean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B]
        seq_ratio = torch.exp(seq_log_ratio)
        metrics: dict[str, Tensor] = {}
        if self.variant == "sequence":
            per_seq, clipped_low, clipped_high = clipped_surrogate(seq_ratio, advantages, self.clip_low, self.clip_high)
            loss = mean_over_sequences(per_seq, nonempty)
            with torch.no_grad():
                # the clipped share of tokens (a clipped sequence clips all its tokens), comparable with GRPO's and
                # with the GSPO paper's figures; the share of sequences under its own name
                tokens = mask.float()
                low = masked_mean(clipped_low.float().unsqueeze(-1).expand_as(tokens), mask)
                high = masked_mean(clipped_high.float().unsqueeze(-1).expand_as(tokens), mask)
                metrics["clip_frac_seq"] = masked_mean((clipped_low | clipped_high).float(), nonempty)
        else:
            token_adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(logprobs)
            token_ratio = seq_ratio.detach().unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())  # [B, T]
            per_token, clipped_low, clipped_high = clipped_surrogate(token_ratio, token_adv, self.clip_low, self.clip_high)
            loss = mean_over_sequences(sequence_mean(per_token, mask), nonempty)
            with torch.no_grad():
                low = masked_mean(clipped_low.float(), mask)
                high = masked_mean(clipped_high.float(), mask)
        if self.beta > 0:
            kl = mean_over_sequences(sequence_mean(kl_estimate(logprobs, ref_logprobs, self.kl_estimator), mask), nonempty)
            loss = loss + self.beta * kl
            metrics["kl"] = kl.detach()
        with torch.no_grad():
            metrics.update(
                clip_frac_low=low,
                clip_frac_high=high,
                clip_frac=low + high,
                ratio_mean=masked_mean(seq_ratio, nonempty),
                ratio_max=masked_max(seq_ratio, nonempty),
            )
        # the clip fractions are token means; the rest are means over the non-empty sequences, which is what the
        # normaliser counts: they need no count of their own
        counts = dict.fromkeys(("clip_frac_low", "clip_frac_high", "clip_frac"), mask.sum())
        return ObjectiveOutput(loss=loss, metrics=metrics, counts=counts)
