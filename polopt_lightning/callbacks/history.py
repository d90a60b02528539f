"""ValidationHistory: every validation's metrics with its step, the best so far, and what resume needs."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn

MODES = ("max", "min")


class ValidationHistory(L.Callback):
    """Record the ``val/*`` metrics of every validation with the optimizer step and the rollout it ran at.

    Validations run by ``trainer.validate`` (before or after training) are recorded with ``"fitting": False``.
    :meth:`best` ranks them all, as :class:`RolloutCheckpoint` does: the starting policy counts, so after a collapse
    the best is the start, not the best of the collapsed run. The records are part of the checkpoint
    (``state_dict``), so a resumed run keeps the best of the whole run.

    Args:
        monitor: the metric :meth:`best` ranks by.
        mode: ``"max"`` or ``"min"``.
    """

    def __init__(self, monitor: str = "val/accuracy", mode: str = "max") -> None:
        if mode not in MODES:
            raise ValueError(f"ValidationHistory mode must be one of {MODES}, got {mode!r}")
        self.monitor, self.mode = monitor, mode
        self.records: list[dict[str, Any]] = []
        self.rollouts = 0  # training batches done: one rollout each, however many optimizer steps it makes

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.rollouts += 1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            self.records.append({"step": int(trainer.global_step), "rollout": self.rollouts,
                                 "fitting": trainer.state.fn == TrainerFn.FITTING, **metrics})

    def best(self) -> dict[str, Any] | None:
        """The record of the best ``monitor`` among every validation (the earliest of equal ones)."""
        candidates = [r for r in self.records if self.monitor in r]
        if not candidates:
            return None
        sign = 1 if self.mode == "max" else -1
        return max(candidates, key=lambda r: (sign * r[self.monitor], -r["step"]))

    def state_dict(self) -> dict[str, Any]:
        return {"records": list(self.records), "rollouts": self.rollouts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = list(state_dict.get("records", []))
        self.rollouts = int(state_dict.get("rollouts", 0))
