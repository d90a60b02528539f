"""Prompt data, built-in tasks and task mixtures."""

from .code_task import CodeTask
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

__all__ = ["ArithmeticTask", "CodeTask", "CountTask", "DatasetTask", "ExpressionTask", "FileTask", "MultiplicationTask", "PromptDataModule",
           "ReverseTask", "SortTask", "TaskMixture", "ToolArithmeticTask"]
