"""The update's entropy terms (both off by default; settings in :class:`~polopt_lightning.step.update.UpdateConfig`):

- an **entropy bonus**, ``loss - coef x H`` with ``H`` the mean per-token entropy of the policy over the mini-batch's
  tokens (the same meaning whatever the objective's aggregation, as TRL's ``entropy_coef``; with
  ``update.entropy_aggregation="objective"``, aggregated as the objective's loss, verl's form), its coefficient fixed or
  adapted to a target entropy (Skywork-OR1, He et al. 2025; TRL's ``use_adaptive_entropy``): after each optimizer
  step the coefficient rises by ``delta`` when the step's entropy is at or below the target and falls by ``delta``
  otherwise, within ``[coef_min, coef_max]``, and it acts only on steps that follow one at or below the target;
- the **top-entropy token mask** (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
  Effective RL for LLM Reasoning"; TRL's ``top_entropy_quantile``): only the share ``rho`` of tokens with the highest
  entropy carry the policy-gradient term (the KL term and the normaliser still count every token, as in TRL).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..distributed import all_gather_rows, all_reduce


class EntropyControl:
    """The entropy bonus's coefficient (fixed or adaptive, with its state for checkpoints) and the top-entropy mask.

    Args:
        coef: the bonus's coefficient (the starting one when adaptive); 0 and no target: no bonus.
        target: the target entropy (nats per token) of the adaptive coefficient; ``None``: fixed coefficient.
        delta, coef_min, coef_max: the adaptive coefficient's step and bounds.
        top_quantile: the share of tokens (by entropy, highest first) that carry the policy-gradient term; 1: all.
    """

    def __init__(self, coef: float = 0.0, target: float | None = None, delta: float = 0.005, coef_min: float = 0.0,
                 coef_max: float = 1.0, top_quantile: float = 1.0) -> None:
        self.coef, self.target, self.delta = float(coef), target, float(delta)
        self.coef_min, self.coef_max, self.top_quantile = float(coef_min), float(coef_max), float(top_quantile)
        self.last = math.inf  # the last step's entropy: none yet, so an adaptive bonus waits for a measurement

    @classmethod
    def of(cls, config: Any) -> EntropyControl:
        """From an :class:`~polopt_lightning.step.update.UpdateConfig`'s ``entropy_*`` and ``top_entropy_quantile``."""
        return cls(config.entropy_coef, config.entropy_target, config.entropy_coef_delta, config.entropy_coef_min,
                   config.entropy_coef_max, config.top_entropy_quantile)

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    @property
    def bonus(self) -> bool:
        """Whether the loss has an entropy term (an adaptive one may act later even at coefficient 0)."""
        return self.coef != 0.0 or self.adaptive

    @property
    def masks(self) -> bool:
        return self.top_quantile < 1.0

    def applied(self) -> float:
        """The coefficient this step's loss uses: the fixed one, or the adaptive one after a step at or below the
        target (0 otherwise)."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last <= self.target else 0.0

    def observe(self, entropy: float) -> None:
        """After an optimizer step: its entropy (over the tokens the bonus acts on) moves the adaptive coefficient."""
        if not self.adaptive:
            return
        self.last = float(entropy)
        step = self.delta if self.last <= self.target else -self.delta
        self.coef = min(max(self.coef + step, self.coef_min), self.coef_max)

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last = float(state["coef"]), float(state["last"])

    def top_mask(self, entropies: Tensor, mask: Tensor) -> Tensor:
        """``[B, T]`` bool: the tokens of ``mask`` whose entropy is at least the ``1 - top_quantile`` quantile (linear
        interpolation, TRL's) of every process's masked entropies; ``mask`` itself when ``top_quantile`` is 1."""
        mask = mask.bool()
        if not self.masks:
            return mask
        return mask & (entropies >= entropy_threshold(entropies[mask], 1.0 - self.top_quantile))


def entropy_threshold(values: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of ``values`` (``[n]``, a different ``n`` on each process) over every process; ``+inf``
    when there is none (nothing passes)."""
    count = all_reduce(torch.tensor(float(values.numel()), device=values.device), "max")
    padded = torch.full((int(count),), float("nan"), device=values.device, dtype=torch.float32)
    padded[:values.numel()] = values.float()
    gathered = all_gather_rows(padded)
    gathered = gathered[~torch.isnan(gathered)]
    if gathered.numel() == 0:
        return torch.tensor(float("inf"), device=values.device)
    return torch.quantile(gathered, q)
