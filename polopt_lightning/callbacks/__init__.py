"""Lightning callbacks for policy optimisation: checkpoints that fit manual optimisation, validation history, the
collapse monitor, the completions log, and the schedules of task weights, reward weights and the supervised anchor."""

from .checkpoint import AtomicCheckpointIO, ExceptionCheckpoint, RolloutCheckpoint
from .collapse import CollapseEvent, CollapseMonitor, CollapseRules
from .completions import CompletionsLog
from .history import ValidationHistory
from .progress import ProgressLog, progress_bar
from .weights import (
    TASK_WEIGHT_MODES,
    AnchorScheduler,
    RewardWeights,
    RewardWeightScheduler,
    TaskWeights,
    TaskWeightScheduler,
)

__all__ = ["TASK_WEIGHT_MODES", "AnchorScheduler", "AtomicCheckpointIO", "CollapseEvent", "CollapseMonitor",
           "CollapseRules", "CompletionsLog", "ExceptionCheckpoint", "ProgressLog", "RewardWeightScheduler",
           "RewardWeights", "RolloutCheckpoint", "TaskWeightScheduler", "TaskWeights", "ValidationHistory",
           "progress_bar"]
