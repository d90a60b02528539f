"""The objective interface, shared tensor helpers and the registry that maps config keys to objectives."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Log-ratios beyond this are clamped before exp(): exp(20) ~ 5e8 is far outside any clip range, so values in the
# normal range are untouched while a stale or corrupted old log-prob cannot overflow to inf (verl clamps at 20 too).
LOG_RATIO_LIMIT = 20.0

# how group-relative advantages may be scaled: an objective names the one it wants (GRPO: group, Dr. GRPO: none)
ADVANTAGE_SCALES = ("group", "batch", "none")


@dataclass
class ObjectiveOutput:
    """What an objective returns.

    Attributes:
        loss: scalar tensor to minimise.
        metrics: detached scalar tensors (clip fractions, ratio statistics, ``kl`` when ``beta > 0``).
        counts: for a metric that is a mean over tokens or sequences, how many it averages: a micro-batched or
            data-parallel update weights each piece's value by it, so the logged mean is the whole mini-batch's.
            A metric without a count is weighted by the piece's share of :meth:`Objective.normaliser`, as the loss
            is (right for the loss and for terms aggregated as it is); one named ``*_max`` is a maximum.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)


class Objective:
    """Base class of policy-gradient objectives.

    Subclasses implement :meth:`compute`; :meth:`__call__` checks shapes and masks the inputs first so every
    objective sees finite values at masked positions (padding may hold ``-inf``/NaN log-probs).

    Attributes:
        beta: weight of the KL penalty against the reference policy; ``0`` disables it.
        kl_estimator: the per-token KL estimator of that term (:func:`kl_estimate`: ``k1``, ``k2``, ``k3``, ``k3+``).
        advantage_scale: how the trainer should scale group-relative advantages for this objective
            (``"group"``, ``"batch"`` or ``"none"``); Dr. GRPO sets ``"none"``.
    """

    beta: float = 0.0
    kl_estimator: str = "k3"
    advantage_scale: str = "group"
    #: whether ``advantages`` may be ``[B, T]`` (per token) instead of ``[B]``.
    accepts_token_advantages: bool = False
    #: the advantage estimator a step uses when ``experience.advantage_estimator`` is null (PPO's ``gae``); ``None``:
    #: ``grpo``.
    advantage_estimator: str | None = None

    def __call__(
        self,
        *,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logprobs: Tensor | None = None,
    ) -> ObjectiveOutput:
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
        for name, t in (("old_logprobs", old_logprobs), ("mask", mask)):
            if t.shape != logprobs.shape:
                raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
        batch = logprobs.shape[0]
        token_adv_ok = self.accepts_token_advantages and advantages.shape == logprobs.shape
        if advantages.shape != (batch,) and not token_adv_ok:
            allowed = f"[B]={batch}" + (f" or [B, T]={tuple(logprobs.shape)}" if self.accepts_token_advantages else "")
            raise ValueError(f"advantages must be {allowed}, got shape {tuple(advantages.shape)}")
        if self.beta > 0:
            if ref_logprobs is None:
                raise ValueError(f"{type(self).__name__}(beta={self.beta}) needs ref_logprobs; pass them or set beta=0")
            if ref_logprobs.shape != logprobs.shape:
                raise ValueError(
                    f"ref_logprobs must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(ref_logprobs.shape)}"
                )
        mask = mask.bool()
        # torch.where (not multiplication) so -inf/NaN at masked positions can poison neither values nor gradients.
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
        old_logprobs = torch.where(mask, old_logprobs.detach(), torch.zeros_like(logprobs)).detach()
        if ref_logprobs is not None and self.beta > 0:
            ref_logprobs = torch.where(mask, ref_logprobs.detach(), torch.zeros_like(logprobs)).detach()
        else:
            ref_logprobs = None
        advantages = torch.nan_to_num(advantages.detach().to(logprobs.dtype), nan=0.0)
        return self.compute(logprobs, old_logprobs, advantages, mask, ref_logprobs)

    def normaliser(self, mask: Tensor) -> Tensor:
        """What this objective divides its summed loss by for ``mask``: the number of non-empty sequences here.

        The trainer uses it to split a mini-batch into micro-batches whose accumulated gradient equals the whole
        mini-batch's. An objective whose loss is not ``sum / normaliser(mask)`` must override it.
        """
        return mask.bool().any(-1).sum().float()

    def aggregate_tokens(self, values: Tensor, mask: Tensor) -> Tensor:
        """Per-token ``values`` ``[B, T]`` reduced to a scalar as this objective reduces its loss (here each sequence's
        token mean, then the mean over the non-empty sequences): ``sum / normaliser(mask)``, so pieces of a mini-batch
        weighted by their share of the normaliser add up to the whole's. The entropy bonus uses it under
        ``update.entropy_aggregation="objective"`` (verl's ``loss_agg_mode`` for its entropy term). An objective that
        overrides :meth:`normaliser` overrides this too."""
        return mean_over_sequences(sequence_mean(values, mask), mask.bool().any(-1))

    def compute(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, ref_logprobs: Tensor | None
    ) -> ObjectiveOutput:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def check_advantage_scale(value: str) -> str:
    if value not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage_scale must be one of {ADVANTAGE_SCALES}, got {value!r}")
    return value


def check_clip(clip_low: float, clip_high: float | None) -> tuple[float, float]:
    """Validate a clip range and return ``(clip_low, clip_high)`` with ``None`` meaning symmetric."""
    clip_high = clip_low if clip_high is None else clip_high
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    return float(clip_low), float(clip_high)


def check_beta(beta: float) -> float:
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    return float(beta)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - lp) - (ref - lp) - 1`` (Schulman's unbiased, >= 0)."""
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0


#: the per-token KL estimators, by name (:func:`kl_estimate`)
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs (Schulman, "Approximating KL
    divergence", 2020), ``[B, T]``:

    - ``k1 = lp - ref``: unbiased value, high variance, negative on some tokens; its gradient ``grad lp`` has zero
      expectation on-policy (as a loss term it pulls nothing); the estimator for a reward penalty.
    - ``k2 = (lp - ref)^2 / 2``: biased value, but its gradient ``(lp - ref) grad lp`` is the reverse KL's gradient in
      expectation on-policy.
    - ``k3 = exp(ref - lp) - (ref - lp) - 1``: unbiased, never negative, low variance (GRPO's, TRL's ``beta`` term).
    - ``k3+``: k3's value with k2's gradient (verl's straight-through ``"k3+"``: ``k2 - sg(k2) + sg(k3)``).

    verl also clamps k3 to ``[-10, 10]``; here only the log-ratio is clamped (at :data:`LOG_RATIO_LIMIT`, as verl).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    if estimator == "k3+":
        k2 = 0.5 * (logprobs - ref_logprobs).square()
        return k2 - k2.detach() + k3_kl(logprobs, ref_logprobs).detach()
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def check_kl_estimator(estimator: str) -> str:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    return estimator


def clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic surrogate ``-min(r*A, clip(r, 1-low, 1+high)*A)``.

    Returns the per-element loss and two boolean tensors: where the clip removed the gradient at the lower bound
    (``r < 1-low`` with ``A < 0``) and at the upper bound (``r > 1+high`` with ``A > 0``).
    """
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + high) & (advantages > 0)
    return loss, clipped_low, clipped_high


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` holds; 0 (not NaN) when nothing is selected."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    if not bool(mask.any()):
        return values.new_zeros(())
    return values[mask.bool()].max()


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over masked tokens, ``[B, T] -> [B]``; empty sequences give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def mean_over_sequences(per_sequence: Tensor, nonempty: Tensor) -> Tensor:
    """Mean of ``[B]`` values over the sequences that have at least one token; empty sequences contribute nothing."""
    nonempty = nonempty.to(per_sequence.dtype)
    return (per_sequence * nonempty).sum() / nonempty.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------------------------------
# Registry: a config names an objective by key; adding one is a decorated class plus a conf/objective/<key>.yaml.

ObjectiveFactory = Callable[..., Objective]
_REGISTRY: dict[str, ObjectiveFactory] = {}


def register_objective(name: str) -> Callable[[ObjectiveFactory], ObjectiveFactory]:
    """Register a class or factory under ``name`` (``@register_objective("my_loss")``)."""

    def decorator(factory: ObjectiveFactory) -> ObjectiveFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"objective {name!r} is already registered to {_REGISTRY[name]!r}")
        _REGISTRY[name] = factory
        return factory

    return decorator


def available_objectives() -> list[str]:
    return sorted(_REGISTRY)


def build_objective(name: str, **kwargs) -> Objective:
    """Build the objective registered under ``name`` with ``kwargs`` (what ``conf/objective/*.yaml`` calls)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown objective {name!r}; known objectives: {', '.join(available_objectives())}")
    return _REGISTRY[name](**kwargs)


def as_objective(value: Any) -> Objective:
    """The module's ``objective`` argument as an :class:`Objective`: one as it is, a registry key, or a dict with
    ``name`` and its arguments (:func:`build_objective`)."""
    if isinstance(value, str):
        value = build_objective(value)
    elif isinstance(value, Mapping):
        value = build_objective(**value)
    if not isinstance(value, Objective):
        raise TypeError(f"objective must be an Objective, a registry key or a dict, got {type(value).__name__}")
    return value


# where build_objective's keywords go, for the CLI's check of their types (polopt_lightning.cli.check_config)
build_objective.target_for = lambda values: _REGISTRY.get(values.get("name"))  # type: ignore[attr-defined]
