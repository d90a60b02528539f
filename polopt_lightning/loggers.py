"""Experiment loggers for the ``logger`` config group, with the defaults a run on a machine without accounts needs:
W&B offline unless a key is set, MLflow in a local file store unless a tracking server is named. Each names the extra
that installs it when its package is missing."""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as _LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def require(package: str, key: str) -> None:
    """An ImportError naming ``logger=<key>`` and the extra, when ``package`` is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"logger={key} needs the {package} package: pip install "
                          f"'polopt-lightning[{INSTALL[key]}]'")


def wandb_has_key() -> bool:
    """Whether W&B can log online: ``WANDB_API_KEY`` set, or a login saved in ``~/.netrc``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class TensorBoardLogger(_LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` that writes one event file per run. Lightning finalizes its loggers at the end
    of every ``Trainer`` call, and Lightning's TensorBoard logger closes its writer there, so the next call opened
    another file: ``polopt-train`` validates before RL, trains and validates after, three files a run. Here the end of
    a call flushes; :meth:`close` (``polopt-train`` calls it when the run is done) or a failed call closes."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status != "success":
            super().finalize(status)
            return
        if self._experiment is not None:
            self.experiment.flush()
        self.save()

    @rank_zero_only
    def close(self) -> None:
        """Flush and close the event file (a later call would open another)."""
        if self._experiment is not None:
            self.experiment.flush()
            self.experiment.close()


def close_loggers(loggers: list[Any]) -> None:
    """Close the loggers that keep a file open across ``Trainer`` calls (:class:`TensorBoardLogger`)."""
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.close()


def tensorboard_logger(save_dir: str, name: str = "tensorboard", version: Any = None, **kwargs: Any) -> Any:
    """A :class:`TensorBoardLogger` (event files in ``<save_dir>/<name>/version_N``, one per run)."""
    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        require("tensorboard", "tensorboard")
    return TensorBoardLogger(save_dir=save_dir, name=name, version=version, default_hp_metric=False, **kwargs)


def wandb_logger(save_dir: str, project: str = "polopt-lightning", name: str | None = None, mode: str | None = None,
                 **kwargs: Any) -> Any:
    """Lightning's ``WandbLogger``; ``mode=None``: ``online`` when a W&B key is set (:func:`wandb_has_key`), else
    ``offline`` (the run folder in ``<save_dir>/wandb``, uploaded later with ``wandb sync``)."""
    require("wandb", "wandb")
    from lightning.pytorch.loggers import WandbLogger

    if mode not in (None, "online", "offline", "disabled"):
        raise ValueError(f"logger.wandb.mode must be online, offline, disabled or null, got {mode!r}")
    mode = mode or ("online" if wandb_has_key() else "offline")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=save_dir, project=project, name=name, mode=mode, offline=mode == "offline", **kwargs)


def mlflow_logger(save_dir: str, experiment_name: str = "polopt-lightning", run_name: str | None = None,
                  tracking_uri: str | None = None, **kwargs: Any) -> Any:
    """Lightning's ``MLFlowLogger``; ``tracking_uri=None``: ``MLFLOW_TRACKING_URI`` when set, else a file store in
    ``<save_dir>/mlruns`` (``mlflow ui --backend-store-uri <that folder>``; MLflow 3 keeps file stores in maintenance
    mode: ``MLFLOW_ALLOW_FILE_STORE`` is set for it, and a server or ``sqlite:///...`` URI is the choice for more)."""
    require("mlflow", "mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:  # the file store, which MLflow 3 keeps in maintenance mode and refuses unless allowed
        uri = (Path(save_dir) / "mlruns").resolve().as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLFlowLogger(experiment_name=experiment_name, run_name=run_name, tracking_uri=uri, **kwargs)
