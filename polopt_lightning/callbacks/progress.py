"""The progress bar of an RL run, whose epochs are unbounded (``max_epochs=-1``: the prompt loader cycles and
``trainer.max_steps`` ends the run)."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


class _RolloutsTotal:
    """A bar whose count is rollouts (training batches) totals rollouts too: Lightning totals the optimizer steps left
    to ``trainer.max_steps``, and a rollout makes ``update.num_iterations x update.mini_batches`` of them, so a run of
    10 steps at 2 a rollout ended at ``5/10``."""

    trainer: L.Trainer

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches  # type: ignore[misc]
        trainer = self.trainer
        config = getattr(trainer.lightning_module, "update_config", None)
        per = config.num_iterations * config.mini_batches if config is not None else 1
        if per <= 1 or trainer.max_epochs != -1 or not trainer.max_steps or trainer.max_steps < 0:
            return total
        return min(trainer.num_training_batches, -(-(trainer.max_steps - trainer.global_step) // per))


def progress_bar(**kwargs: Any) -> ProgressBar:
    """Lightning's own bar (rich where it is installed, else tqdm; ``kwargs`` are its arguments, e.g. rich's
    ``console_kwargs``), totalling rollouts (:class:`_RolloutsTotal`), without the last epoch of a run that has none:
    rich's reads ``Epoch 1/-2`` under ``max_epochs=-1``."""
    if not _RICH_AVAILABLE:
        class RolloutsBar(_RolloutsTotal, TQDMProgressBar):  # it shows the epoch alone
            pass

        return RolloutsBar(**kwargs)
    from lightning.pytorch.callbacks import RichProgressBar

    class UnboundedEpochsBar(_RolloutsTotal, RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            trainer: L.Trainer = self.trainer
            if trainer.max_epochs is not None and trainer.max_epochs >= 0:
                return super()._get_train_description(current_epoch)
            description = f"Epoch {current_epoch}"
            return f"{description:{len(self.validation_description)}}"  # as rich pads it, against flicker

    return UnboundedEpochsBar(**kwargs)


log = logging.getLogger("polopt_lightning")


class ProgressLog(L.Callback):
    """Without a progress bar (``trainer.enable_progress_bar=false``: log files, batch jobs), a log line now and then
    while training: the optimizer step out of ``trainer.max_steps``, the last rollout's mean reward and the seconds a
    step since the last line. The first step's line comes at once, then one at most every ``every_s`` seconds, and
    the last step's.

    Args:
        every_s: seconds at least between two lines.
    """

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: tuple[float, int] | None = None  # when the last line was written (or training started), its step
        self._said = False

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._last, self._said = (time.perf_counter(), trainer.global_step), False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not trainer.is_global_zero or self._last is None:
            return
        (since, at), now, step = self._last, time.perf_counter(), trainer.global_step
        final = 0 <= trainer.max_steps <= step
        if step == at or (self._said and now - since < self.every_s and not final):
            return
        reward = trainer.callback_metrics.get("reward")
        total = f"/{trainer.max_steps}" if trainer.max_steps >= 0 else ""
        said = f", reward {float(reward):.4g}" if reward is not None else ""
        log.info("step %d%s%s, %.2f s a step", step, total, said, (now - since) / (step - at))
        self._last, self._said = (now, step), True
