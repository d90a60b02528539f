"""Lightning callbacks for policy optimisation: checkpoints that fit manual optimisation, validation history."""

from .checkpoint import AtomicCheckpointIO, ExceptionCheckpoint, RolloutCheckpoint
from .history import ValidationHistory

__all__ = ["AtomicCheckpointIO", "ExceptionCheckpoint", "RolloutCheckpoint", "ValidationHistory"]
