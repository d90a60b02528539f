"""A table of sampled completions (prompt, completion, each reward, advantage) every N steps: to a JSON-lines file in
the run folder and to every logger that holds tables (W&B, TensorBoard, MLflow), as TRL's ``log_completions`` and
verl's ``log_val_generations`` do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L

from ..distributed import all_gather_objects


class CompletionsLog(L.Callback):
    """Logs the rows of a training step's experience every ``every_n_steps`` optimizer steps (the step that crosses
    each multiple), gathered from every process.

    Rows: ``step``, ``prompt`` (as the model read it), ``completion``, ``rewards/<function>`` and ``advantage``. They
    are appended to ``path`` (one JSON object a line) and handed to each logger that can hold a table: W&B
    (``log_table``, key ``completions``), TensorBoard (a Markdown table under ``completions``), MLflow (a table
    artifact ``completions/step_<N>.json``). CSV holds no table: the JSON-lines file is its record.

    Args:
        every_n_steps: log at the steps that cross each multiple of this.
        max_rows: at most this many rows per table (the first ones: whole groups first); ``None``: all.
        path: the JSON-lines file; ``None``: ``completions.jsonl`` in the trainer's ``default_root_dir``.
        key: the table's name in the loggers.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int | None = 64, path: str | None = None,
                 key: str = "completions") -> None:
        if every_n_steps < 1:
            raise ValueError(f"callbacks.completions.every_n_steps must be >= 1, got {every_n_steps}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"callbacks.completions.max_rows must be >= 1 or null, got {max_rows}")
        self.every_n_steps, self.max_rows, self.path, self.key = every_n_steps, max_rows, path, key
        self._before = 0

    def file(self, trainer: L.Trainer) -> Path:
        return Path(self.path) if self.path else Path(trainer.default_root_dir) / "completions.jsonl"

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._before = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._before or step // self.every_n_steps == self._before // self.every_n_steps:
            return
        samples = getattr(getattr(pl_module, "experience", None), "last_samples", None)
        if samples is None:
            return
        columns = list(samples)
        local = [dict(zip(columns, values)) for values in zip(*samples.values())]
        rows = [row for part in all_gather_objects(local) for row in part]  # every process's, in rank order
        if not trainer.is_global_zero:
            return
        rows = [{"step": step, **row} for row in rows[: self.max_rows]]
        path = self.file(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        for logger in trainer.loggers:
            log_table(logger, self.key, ["step", *columns], rows, step)


def log_table(logger: Any, key: str, columns: list[str], rows: list[dict[str, Any]], step: int) -> bool:
    """``rows`` as a table in ``logger``, when its kind holds tables; whether it did."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    data = [[row.get(c) for c in columns] for row in rows]
    if isinstance(logger, WandbLogger):
        logger.log_table(key=key, columns=columns, data=data, step=step)
        return True
    if isinstance(logger, TensorBoardLogger):
        def cell(value: Any) -> str:
            text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in values) + " |" for values in data]
        logger.experiment.add_text(key, "\n".join(lines), global_step=step)
        return True
    if isinstance(logger, MLFlowLogger):
        table = {c: [row.get(c) for row in rows] for c in columns}
        logger.experiment.log_dict(logger.run_id, table, f"{key}/step_{step:06d}.json")
        return True
    return False
