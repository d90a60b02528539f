"""The progress bar of an RL run, whose epochs are unbounded (``max_epochs=-1``: the prompt loader cycles and
``trainer.max_steps`` ends the run)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


def progress_bar(**kwargs: Any) -> ProgressBar:
    """Lightning's own bar (rich where it is installed, else tqdm; ``kwargs`` are its arguments, e.g. rich's
    ``console_kwargs``), without the last epoch of a run that has none: rich's reads ``Epoch 1/-2`` under
    ``max_epochs=-1``."""
    if not _RICH_AVAILABLE:
        return TQDMProgressBar(**kwargs)  # it shows the epoch alone
    from lightning.pytorch.callbacks import RichProgressBar

    class UnboundedEpochsBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            trainer: L.Trainer = self.trainer
            if trainer.max_epochs is not None and trainer.max_epochs >= 0:
                return super()._get_train_description(current_epoch)
            description = f"Epoch {current_epoch}"
            return f"{description:{len(self.validation_description)}}"  # as rich pads it, against flicker

    return UnboundedEpochsBar(**kwargs)
