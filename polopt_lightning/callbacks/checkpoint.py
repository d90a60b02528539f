"""Checkpoint callbacks for :class:`~polopt_lightning.PolicyOptimizationModule` (manual optimisation).

Lightning's own classes assume things that do not hold for a module whose training step is a whole rollout with its
own optimizer steps; these keep their behaviour and drop the assumptions:

- :class:`RolloutCheckpoint` is ``ModelCheckpoint`` saving after a training step. Under manual optimisation
  Lightning's class warns at every periodic save (with a sample ``training_step``) that the file holds the state
  *after* the optimizer step; for this module that is the state wanted: the rollout's updates are done. It also keeps
  the metrics log ahead of the checkpoints: Lightning saves in ``on_train_batch_end``, *before* it logs that step's
  metrics, so a run killed in between had a checkpoint whose last step was in no log, and a resume from it never
  logged that step again. Here the loggers are flushed before any checkpoint file appears, and a file saved at a
  step's end (through :class:`AtomicCheckpointIO`) is held under its temporary name until the step's metrics are on
  disk, then renamed into place: whichever file a resume finds, the log already holds every step it covers.
- :class:`AtomicCheckpointIO` writes each checkpoint file under a temporary name in its own folder, flushes it to
  disk and renames it over the old one, so a crash (or SIGKILL) while saving leaves the previous ``last.ckpt`` whole.
  Lightning's own writer goes through a temporary file in the system's temporary folder and moves it; where that
  folder is on another file system the move is a copy into the destination, which a crash can cut short.
- :class:`ExceptionCheckpoint` saves a checkpoint when training raises, like ``OnExceptionCheckpoint``, without being
  one: Lightning turns ``fit(ckpt_path=None)`` into ``ckpt_path="last"`` whenever an ``OnExceptionCheckpoint`` is
  present, resuming silently from whatever last checkpoint it finds (and warning twice on a fresh run). Resuming
  here happens only when asked (``ckpt_path=...``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)


class RolloutCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves the state a training step leaves (every rollout's optimizer steps done).

    Takes every ``ModelCheckpoint`` argument. ``every_n_train_steps`` counts optimizer steps, as ``global_step`` does.
    With a ``monitor``, validations run by ``trainer.validate`` rank too (Lightning's class ranks only those inside
    ``fit``): the starting policy validated before ``fit`` is the first candidate, so a run that only gets worse keeps
    its start as ``best``, and a run with no validation inside ``fit`` still has a best checkpoint; the final policy
    validated after ``fit`` is a candidate as well. Not under DeepSpeed, whose engine saves with its optimizer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: AtomicCheckpointIO | None = None  # the writer holding this step's files until its metrics are logged
        self._held_removals: list[str] = []  # checkpoints the held ones replace, removed once those are in place
        self._ranked_outside_fit: int | None = None  # the step of the last validation outside fit ranked here
        self._period: int = 0  # global_step // every_n_train_steps at the last periodic save (or the start of fit)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._period = trainer.global_step // max(1, self._every_n_train_steps)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AtomicCheckpointIO):
            return self._save_at_batch_end(trainer, pl_module, *args, **kwargs)
        joined = io.holding  # another RolloutCheckpoint saved at this step: its files and these go in place together
        io.hold()
        self._held = io  # what this save writes is put in place by the first hook after Lightning logs this step
        try:
            self._save_at_batch_end(trainer, pl_module, *args, **kwargs)
        finally:
            if not joined and not io.held:  # nothing saved at this step
                self._publish(trainer, flush=False)

    def _save_at_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if pl_module.automatic_optimization or self._train_time_interval is not None:
            return super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        # Lightning's manual-optimisation branch differs from the automatic one only by restoring a pre-step state that
        # its own test module keeps, and by a warning when there is none: the automatic branch's saving, here. (The
        # automatic flag cannot be flipped for the call: `trainer.global_step` reads another counter then.)
        # saved whenever the step crosses a multiple of every_n_train_steps: a rollout makes several optimizer steps,
        # and a run resumed mid-rollout (an odd step) would never land on one
        period = trainer.global_step // max(1, self._every_n_train_steps)
        if self._every_n_train_steps < 1 or period == self._period:
            return
        self._period = period
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # saved when validation has logged the monitored metric
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.VALIDATING or self.monitor is None or trainer.sanity_checking:
            return super().on_validation_end(trainer, pl_module)
        if getattr(trainer.strategy, "strategy_name", None) == "deepspeed":
            return  # its engine saves with an optimizer, which exists only inside fit
        step = trainer.global_step
        saved = (step > 0 and self._last_global_step_saved == step) or self._ranked_outside_fit == step
        if saved or self.monitor not in trainer.callback_metrics:
            return  # the policy of this step is ranked already (or the metric is missing: nothing to rank by)
        self._ranked_outside_fit = step
        self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # the folder holds what a validation before fit saved: Lightning's "exists and is not empty" is no news then
        ours = any(getattr(cb, "_ranked_outside_fit", None) is not None for cb in trainer.checkpoint_callbacks)
        with warnings.catch_warnings():
            if ours:
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        _flush_loggers(trainer)  # every step logged so far reaches the disk before a checkpoint covering it
        super()._save_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if self._held is not None:  # the file replacing this one is not in place yet
            self._held_removals.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)

    def _publish(self, trainer: L.Trainer, flush: bool = True) -> None:
        """Put the files held since the last step's end in place, now that Lightning has logged that step."""
        io, self._held = self._held, None
        if io is None:
            return
        if flush:
            _flush_loggers(trainer)
        io.release()
        removals, self._held_removals = self._held_removals, []
        for filepath in removals:
            super()._remove_checkpoint(trainer, filepath)

    # the first hooks after Lightning logs a step's metrics: the next step, a validation, the epoch's or run's end
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._publish(trainer)
        super().on_train_batch_start(trainer, pl_module, *args, **kwargs)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._publish(trainer)
        super().on_validation_start(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._publish(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._publish(trainer)
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._publish(trainer)  # the held files are whole states at a step's end: better in place than lost
        super().on_exception(trainer, pl_module, exception)


def _flush_loggers(trainer: L.Trainer) -> None:
    for logger in trainer.loggers:
        logger.save()


class ExceptionCheckpoint(L.Callback):
    """Save ``<dirpath>/<filename>.ckpt`` when training raises, so a crash loses no more than the current step.

    Args:
        dirpath: folder of the checkpoint.
        filename: file name without the ``.ckpt`` suffix.
    """

    def __init__(self, dirpath: str | Path, filename: str = "on_exception") -> None:
        self.ckpt_path = str(Path(dirpath) / f"{filename}.ckpt")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_step == 0:
            # nothing trained yet: the starting policy is no state to resume from, and a file here would replace
            # one that an earlier failure of this run left
            log.info("training raised %s before its first optimizer step: no exception checkpoint",
                     type(exception).__name__)
            return
        if trainer.world_size > 1:
            # saving is collective (every process contributes its state) and the others may not have raised: a save
            # here could wait forever. last.ckpt, written by all processes together, is the point to resume from.
            log.info("training raised %s in a run of %d processes: no exception checkpoint (last.ckpt is the resume "
                     "point)", type(exception).__name__, trainer.world_size)
            return
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        # a batch begun and not stepped (Ctrl-C in its rollout): a resume from a checkpoint saved mid-batch counts one
        # more batch as stepped (Lightning assumes a save at a batch's end), so its logged steps would skip one
        mid_batch = int(loop is not None and trainer.state.fn == TrainerFn.FITTING
                        and _mid_batch(loop.batch_progress.total))
        if mid_batch:
            loop._batches_that_stepped -= 1
        try:
            trainer.save_checkpoint(self.ckpt_path)
        finally:
            if mid_batch:
                loop._batches_that_stepped += 1
        log.info("training raised %s: state saved to %s", type(exception).__name__, self.ckpt_path)


def _mid_batch(total: Any) -> bool:
    """Whether Lightning's batch progress ``total`` stands inside a batch whose optimizer steps are not all done: one
    fetched (``ready``) and not completed, and not merely short of its end (processed, only ``completed`` to come: a
    resume counts that batch as done, rightly)."""
    at_batch_end = total.ready == total.started == total.processed == total.completed + 1
    return total.ready > total.completed and not at_batch_end


def write_temporary(obj: Any, target: Path) -> Path:
    """``torch.save(obj)`` into a new temporary file beside ``target``, flushed to disk, for the caller to rename
    into place. Each call gets a file of its own (``mkstemp``), so writers of one target at the same time (a study's
    parallel runs sharing a cache, two threads) never share one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _sync_folder(target: Path) -> None:
    fd = os.open(target.parent, os.O_RDONLY)
    try:  # the rename itself reaches the disk
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_in_place(tmp: Path, target: Path) -> None:
    """Rename a written temporary file over ``target`` (the temporary file is gone either way), flushed to disk."""
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _sync_folder(target)


def save_atomically(obj: Any, target: Path) -> None:
    """``torch.save(obj, target)`` whole or not at all: a temporary file of its own (:func:`write_temporary`) renamed
    over ``target``; of writers finishing together the last rename wins."""
    _put_in_place(write_temporary(obj, target), target)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local files appear whole or not at all: written to a temporary file of their own
    beside the target (:func:`write_temporary`), flushed with ``fsync``, then renamed over it (``os.replace``, atomic
    on POSIX). Remote paths (``s3://`` and the like) are saved by Lightning's writer.

    Between :meth:`hold` and :meth:`release` the files are written and flushed, but stay under their temporary names
    until :meth:`release` renames them (in the order saved): :class:`RolloutCheckpoint` holds a step's checkpoints
    until that step's metrics are logged."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[Path, Path] | None = None  # target -> its written temporary file, while holding

    def hold(self) -> None:
        """Keep the files saved from now on under their temporary names until :meth:`release`."""
        if self._held is None:
            self._held = {}

    @property
    def holding(self) -> bool:
        return self._held is not None

    @property
    def held(self) -> list[Path]:
        """The files written and not yet in place."""
        return list(self._held or {})

    def release(self) -> None:
        """Rename the held files into place and stop holding."""
        held, self._held = self._held or {}, None
        for target, tmp in held.items():
            _put_in_place(tmp, target)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or get_filesystem(path).protocol not in ("file", ("file", "local")):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        if self._held is None:
            return save_atomically(checkpoint, target)
        self._held[target] = write_temporary(checkpoint, target)

    def remove_checkpoint(self, path: Any) -> None:
        if self._held is not None:  # a held file removed before it is in place: it never appears
            target = Path(path)
            tmp = self._held.pop(target, None)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        super().remove_checkpoint(path)
