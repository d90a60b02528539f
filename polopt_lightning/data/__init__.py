"""Prompt data and built-in tasks."""

from .datamodule import PromptDataModule
from .tasks import ArithmeticTask, FileTask

__all__ = ["ArithmeticTask", "FileTask", "PromptDataModule"]
