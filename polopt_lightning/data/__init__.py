"""Prompt data, built-in tasks and task mixtures."""

from .datamodule import PromptDataModule
from .dataset_task import DatasetTask
from .tasks import (
    ArithmeticTask,
    CountTask,
    ExpressionTask,
    FileTask,
    MultiplicationTask,
    ReverseTask,
    SortTask,
    TaskMixture,
    ToolArithmeticTask,
)

__all__ = ["ArithmeticTask", "CountTask", "DatasetTask", "ExpressionTask", "FileTask", "MultiplicationTask", "PromptDataModule",
           "ReverseTask", "SortTask", "TaskMixture", "ToolArithmeticTask"]
