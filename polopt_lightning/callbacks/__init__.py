"""Lightning callbacks for policy optimisation: checkpoints that fit manual optimisation, validation history, the
collapse monitor."""

from .checkpoint import AtomicCheckpointIO, ExceptionCheckpoint, RolloutCheckpoint
from .collapse import CollapseEvent, CollapseMonitor, CollapseRules
from .history import ValidationHistory

__all__ = ["AtomicCheckpointIO", "CollapseEvent", "CollapseMonitor", "CollapseRules", "ExceptionCheckpoint", "RolloutCheckpoint", "ValidationHistory"]
