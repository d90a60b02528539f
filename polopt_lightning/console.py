"""The command lines' quiet console: one line per record, and no advertisement, progress bar or dependency noise
unless asked for (``polopt-train verbose=true``). Used by ``polopt-train`` and ``polopt-export``; the library itself
filters nothing."""

from __future__ import annotations

import logging

# Console lines that say nothing about this run, dropped unless `verbose=true` (matched by message, CLI only).
_ADVERTISEMENTS = ("💡 Tip:",)  # Lightning's suggestions to install its cloud packages
_DEPENDENCY_WARNINGS = (
    # peft asks transformers with its deprecated name when it wraps a model (peft 0.21, transformers 5)
    r"`is_gradient_checkpointing` is deprecated",
    # Lightning on the empty validation loader of a task without a validation split: validation is skipped, as meant
    r"Total length of `list` across ranks is zero",
)
# log records that say nothing a user can act on, by logger, dropped by prefix unless `verbose=true`
_DROPPED_RECORDS = {
    "lightning.pytorch.utilities.rank_zero": _ADVERTISEMENTS,
    "lightning.fabric.utilities.rank_zero": _ADVERTISEMENTS,
    # bitsandbytes >= 0.50 looks for an optional kernels package for its CPU 4-bit product, then uses its own
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # bitsandbytes' int8 layers in eval mode (sampling, validation), at every call
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast",),
}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def configure_console(verbose: bool = False) -> None:
    """One line per record on the console, and no advertisement or dependency noise unless ``verbose``.

    Lightning adds its own console handler to the ``lightning`` logger at import, beside the one Hydra gives the
    root logger, so each of its records was printed twice: its handler goes, Hydra's stays (and writes the run's log
    file too). Python warnings go through logging as single records. The rest is dropped by exact message, here in
    the CLI only; the library itself filters nothing.
    """
    import warnings

    import lightning  # noqa: F401  (its handler is added at import: import first, then remove it)

    lightning_logger = logging.getLogger("lightning")
    root_handlers = logging.getLogger().handlers
    if root_handlers:  # only when something else prints its records
        for handler in list(lightning_logger.handlers):
            if type(handler) is logging.StreamHandler:
                lightning_logger.removeHandler(handler)
    logging.captureWarnings(True)
    if verbose:
        return
    for name, prefixes in _DROPPED_RECORDS.items():
        logger = logging.getLogger(name)
        # train() runs once per job, and a Hydra multirun runs its jobs in one process: one filter per logger
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))
    for pattern in _DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font-cache notices when a dependency imports it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars when the model is saved
    # datasets' bars ("Generating train split", "Map") when task=dataset reads files: its own switch where it is
    # imported, else the variable it reads at import (one a user set wins)
    import os
    import sys

    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
