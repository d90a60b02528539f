"""Lightning callbacks for policy optimisation: checkpoints that fit manual optimisation, validation history."""

from .checkpoint import ExceptionCheckpoint, RolloutCheckpoint
from .history import ValidationHistory

__all__ = ["ExceptionCheckpoint", "RolloutCheckpoint", "ValidationHistory"]
