"""The supervised anchor: a negative log-likelihood term on reference answers, added to any objective's loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ANCHOR_SCHEDULES = ("constant", "linear-decay", "adaptive")


@dataclass
class SupervisedAnchor:
    """``lambda x NLL(reference answers)``: the policy's mean negative log-likelihood per token of each prompt's
    reference answer (teacher-forced, ``answer + EOS``), added to the policy loss. It pulls the policy towards
    known-good answers while RL moves it, which keeps it from drifting far from what it could do (the brief's
    "supervision" beside the reward).

    ``lambda`` follows ``schedule``:

    - ``constant``: ``coef`` throughout;
    - ``linear-decay``: from ``coef`` at step 0 to ``final_coef`` at ``decay_steps`` (default: the run's
      ``trainer.max_steps``), then ``final_coef``;
    - ``adaptive``: starts at ``coef``, is multiplied by ``raise_factor`` (up to ``max_coef``) at every step where a
      collapse rule fires (the :class:`~polopt_lightning.callbacks.CollapseMonitor`'s events when the run has one,
      otherwise the same rules at their default settings, run by the anchor's scheduler), and relaxes back towards
      ``coef`` by ``relax`` of the gap at every step without one.

    The schedule is driven by :class:`~polopt_lightning.callbacks.AnchorScheduler`, which
    :class:`~polopt_lightning.PolicyOptimizationModule` adds to the trainer itself when it has an anchor.

    Attributes:
        coef: ``lambda`` at the start (>= 0).
        schedule: ``constant`` | ``linear-decay`` | ``adaptive``.
        column: the dataset column with each prompt's reference answer (rows where it is ``None`` are left out).
        final_coef: ``linear-decay``: ``lambda`` at the end of the decay.
        decay_steps: ``linear-decay``: optimizer steps the decay takes; ``None``: ``trainer.max_steps``.
        raise_factor: ``adaptive``: ``lambda`` is multiplied by this at a step with a collapse event.
        max_coef: ``adaptive``: the cap.
        relax: ``adaptive``: the fraction of the gap to ``coef`` closed at each step without an event.
    """

    coef: float = 0.05
    schedule: str = "constant"
    column: str = "answer"
    final_coef: float = 0.0
    decay_steps: int | None = None
    raise_factor: float = 2.0
    max_coef: float = 1.0
    relax: float = 0.05

    def __post_init__(self) -> None:
        if self.schedule not in ANCHOR_SCHEDULES:
            raise ValueError(f"anchor.schedule must be one of {ANCHOR_SCHEDULES}, got {self.schedule!r}")
        for key in ("coef", "final_coef", "max_coef"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"anchor.{key} must be finite and >= 0, got {value}")
        if self.schedule == "adaptive" and (self.raise_factor < 1 or self.max_coef < self.coef or self.coef <= 0):
            raise ValueError(f"anchor.schedule=adaptive needs coef > 0, raise_factor >= 1 and max_coef >= coef; got "
                             f"coef={self.coef}, raise_factor={self.raise_factor}, max_coef={self.max_coef}")
        if not 0 <= self.relax <= 1:
            raise ValueError(f"anchor.relax must be in [0, 1], got {self.relax}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"anchor.decay_steps must be >= 1 or null, got {self.decay_steps}")
        self.value = float(self.coef)  # the current lambda

    def check_rows(self, rows: Any) -> None:
        """Before training: some of the training ``rows`` hold :attr:`column` (a row without it, or with ``None``, is
        left out of the anchor; none with it would fail the first step)."""
        if rows and not any(row.get(self.column) is not None for row in rows):
            raise ValueError(f"anchor.column={self.column!r}: no training row has a value in that column (the rows' "
                             f"columns: {sorted(rows[0])})")

    # ------------------------------------------------------------------------------------------------------------
    def at_step(self, step: int, total_steps: int | None = None) -> float:
        """Set and return ``lambda`` for optimizer step ``step`` (``constant`` and ``linear-decay``; ``adaptive``
        keeps its current value)."""
        if self.schedule == "linear-decay":
            span = self.decay_steps or total_steps
            if not span or span < 1:
                raise ValueError("anchor.schedule=linear-decay needs anchor.decay_steps or a trainer.max_steps to decay over")
            self.value = self.coef + (self.final_coef - self.coef) * min(1.0, step / span)
        elif self.schedule == "constant":
            self.value = float(self.coef)
        return self.value

    def observe(self, events: int) -> float:
        """``adaptive``: one step with ``events`` collapse events; returns the new ``lambda``."""
        if self.schedule != "adaptive":
            return self.value
        if events:
            self.value = min(self.max_coef, self.value * self.raise_factor)
        else:
            self.value = self.coef + (self.value - self.coef) * (1 - self.relax)
        return self.value

    def loss(self, logprobs: Tensor, mask: Tensor, tokens: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """``(lambda x NLL, NLL)`` for reference-answer log-probs ``[B, T]`` under ``mask``; the NLL is the sum over
        the masked tokens divided by ``tokens`` (default their count: the token mean; a trainer splitting the batch
        passes the whole batch's count)."""
        if logprobs.shape != mask.shape:
            raise ValueError(f"anchor: mask must have the shape of logprobs {tuple(logprobs.shape)}, got "
                             f"{tuple(mask.shape)}")
        valid = mask.bool()
        total = torch.where(valid, -logprobs, torch.zeros_like(logprobs)).sum()
        count = valid.sum().to(total) if tokens is None else torch.as_tensor(tokens, dtype=total.dtype,
                                                                              device=total.device)
        nll = total / count.clamp(min=1)
        return self.value * nll, nll.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
