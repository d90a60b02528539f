"""GRPO (DeepSeekMath, Shao et al. 2024) with the aggregation variants of DAPO and Dr. GRPO."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

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

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str, max_completion_length: int | None) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    - ``seq-mean-token-mean`` (DeepSeekMath): each sequence's token mean (1/|o_i|), then the mean over sequences.
    - ``token-mean`` (DAPO): one mean over every token of the batch, so long sequences weigh more.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): each sequence's token sum over a constant (max completion length),
      then the mean over sequences; removes the length bias of 1/|o_i|.
    Sequences whose mask is empty contribute nothing and do not count in the sequence mean.
    """
    maskf = mask.to(per_token.dtype)
    nonempty = mask.any(-1)
    if aggregation == "token-mean":
        return (per_token * maskf).sum() / maskf.sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        return mean_over_sequences(sequence_mean(per_token, mask), nonempty)
    if aggregation == "seq-mean-token-sum-norm":
        return mean_over_sequences((per_token * maskf).sum(-1) / float(max_completion_length), nonempty)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


@register_objective("grpo")
class GRPO(Objective):
    """Group Relative Policy Optimization with a per-token importance ratio.

    Per token ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) + beta*KL`` with ``r = exp(lp - old)``,
    reduced by ``aggregation``. With ``dual_clip = c``, a token with ``A < 0`` loses at most ``-c*A`` (dual clip,
    Ye et al. 2020, verl's ``clip_ratio_c``; TRL's two-sided ``delta`` is the same bound: ``min(r, delta)`` in the
    unclipped term changes nothing where ``A > 0``).

    Args:
        clip_low: lower clip range (ratio floor ``1 - clip_low``).
        clip_high: upper clip range (ratio ceiling ``1 + clip_high``); ``None`` means ``clip_low`` (symmetric).
        dual_clip: the bound ``c > 1 + clip_high`` on the ratio's weight for negative advantages; ``None``: none.
        beta: weight of the KL penalty to the reference policy; needs ``ref_logprobs`` when ``> 0``.
        kl_estimator: its per-token estimator: ``"k1"``, ``"k2"``, ``"k3"`` (GRPO's) or ``"k3+"`` (:func:`kl_estimate`).
        aggregation: ``"seq-mean-token-mean"`` | ``"token-mean"`` (DAPO) | ``"seq-mean-token-sum-norm"`` (Dr. GRPO).
        max_completion_length: the constant normaliser of ``seq-mean-token-sum-norm`` (required there).
        advantage_scale: how the trainer scales group advantages: ``"group"`` std, ``"batch"`` std or ``"none"``.
    """

    accepts_token_advantages = True

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        beta: float = 0.0,
        aggregation: str = "seq-mean-token-mean",
        max_completion_length: int | None = None,
        advantage_scale: str = "group",
        dual_clip: float | None = None,
        kl_estimator: str = "k3",
    ) -> None:
        self.clip_low, self.clip_high = check_clip(clip_low, clip_high)
        self.kl_estimator = check_kl_estimator(kl_estimator)
        if dual_clip is not None and not dual_clip > 1.0 + self.clip_high:
            raise ValueError(f"dual_clip must be > 1 + clip_high = {1.0 + self.clip_high}, got {dual_clip}")
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.beta = check_beta(beta)
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if aggregation == "seq-mean-token-sum-norm":
            if max_completion_length is None or int(max_completion_length) <= 0:
                raise ValueError(
                    "aggregation='seq-mean-token-sum-norm' needs max_completion_length > 0 "
                    f"(the constant normaliser), got {max_completion_length!r}"
                )
            max_completion_length = int(max_completion_length)
        self.aggregation = aggregation
        self.max_completion_length = max_completion_length
        self.advantage_scale = check_advantage_scale(advantage_scale)

    def normaliser(self, mask: Tensor) -> Tensor:
        if self.aggregation == "token-mean":
            return mask.float().sum()
        return super().normaliser(mask)

    def aggregate_tokens(self, values: Tensor, mask: Tensor) -> Tensor:
        return aggregate(values, mask.bool(), self.aggregation, self.max_completion_length)

    def surrogate(self, ratio: Tensor, advantages: Tensor, logprobs: Tensor, mask: Tensor
                  ) -> tuple[Tensor, dict[str, Tensor]]:
        """The per-token policy-gradient loss ``[B, T]`` for ratios ``r`` and advantages ``A`` (``[B, 1]`` or
        ``[B, T]``), and its clip metrics (token means). GRPO's: the clipped surrogate (and the dual clip). Subclasses (CISPO, SAPO)
        replace this and keep the KL term, the aggregation and the ratio metrics."""
        per_token, clipped_low, clipped_high = clipped_surrogate(ratio, advantages, self.clip_low, self.clip_high)
        metrics: dict[str, Tensor] = {}
        if self.dual_clip is not None:
            bounded = (advantages < 0) & (per_token > -self.dual_clip * advantages)
            per_token = torch.where(bounded, -self.dual_clip * advantages, per_token)
            metrics["clip_frac_dual"] = masked_mean(bounded.float(), mask).detach()
        with torch.no_grad():
            low = masked_mean(clipped_low.float(), mask)
            high = masked_mean(clipped_high.float(), mask)
        metrics.update(clip_frac_low=low, clip_frac_high=high, clip_frac=low + high)
        return per_token, metrics

    def compute(self, logprobs, old_logprobs, advantages, mask, ref_logprobs) -> ObjectiveOutput:
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B, T]
        ratio = torch.exp(log_ratio)
        token_adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        per_token, metrics = self.surrogate(ratio, token_adv, logprobs, mask)
        if self.beta > 0:
            kl = kl_estimate(logprobs, ref_logprobs, self.kl_estimator)
            per_token = per_token + self.beta * kl
            metrics["kl"] = aggregate(kl, mask, self.aggregation, self.max_completion_length).detach()
        loss = aggregate(per_token, mask, self.aggregation, self.max_completion_length)
        with torch.no_grad():
            metrics.update(ratio_mean=masked_mean(ratio, mask), ratio_max=masked_max(ratio, mask))
        # the surrogate's metrics and the ratio's mean are token means; the KL is aggregated as the loss is
        tokens = mask.sum()
        counts = {key: tokens for key in metrics if key != "kl" and not key.endswith("_max")}
        return ObjectiveOutput(loss=loss, metrics=metrics, counts=counts)


@register_objective("dr_grpo")
def dr_grpo(
    max_completion_length: int | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    beta: float = 0.0,
    aggregation: str = "seq-mean-token-sum-norm",
    advantage_scale: str = "none",
    dual_clip: float | None = None,
    kl_estimator: str = "k3",
) -> GRPO:
    """Dr. GRPO (Liu et al. 2025): token sums over a constant and advantages not divided by the group std."""
    return GRPO(clip_low, clip_high, beta, aggregation, max_completion_length, advantage_scale, dual_clip, kl_estimator)


def _grpo_variant(name: str, doc: str, **defaults: Any) -> Callable[..., GRPO]:
    """A registered factory of :class:`GRPO` with other defaults: GRPO's parameters, so the configuration's schema,
    its type checks and ``help()`` see them (no second copy of the signature to keep in step)."""
    signature = inspect.signature(GRPO.__init__)
    params = [p.replace(default=defaults.get(p.name, p.default)) for p in list(signature.parameters.values())[1:]]

    def factory(*args: Any, **kwargs: Any) -> GRPO:
        bound = factory.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        return GRPO(**bound.arguments)

    factory.__signature__ = signature.replace(parameters=params, return_annotation="GRPO")
    factory.__annotations__ = {k: v for k, v in GRPO.__init__.__annotations__.items() if k != "return"}
    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return register_objective(name)(factory)


bnpo = _grpo_variant("bnpo", """TRL's ``loss_type="bnpo"``: GRPO's symmetric clip with the loss averaged over every token of the batch
    (token-mean) instead of per sequence. TRL divides by the tokens of each device's local batch, so its loss changes
    with ``per_device_train_batch_size``; here the batch is the mini-batch on every process (micro-batching and the
    number of processes do not change it), which is TRL's ``bnpo`` with the mini-batch on one device, and DAPO's
    normaliser without DAPO's clip-higher. :class:`GRPO`'s arguments, token-mean by default.""", aggregation="token-mean")
dapo = _grpo_variant("dapo", """DAPO (Yu et al. 2025): GRPO with clip-higher (0.2 / 0.28) and token-mean aggregation.""",
                     clip_high=0.28, aggregation="token-mean")
