"""Reward functions (TRL-compatible) and their composition."""

from .builtin import (
    DigitMatchReward,
    ExactMatchReward,
    NumericDistanceReward,
    NumericMatchReward,
    PositionMatchReward,
    RegexFormatReward,
    SoftOverlongPenalty,
    last_number,
)
from .composer import RewardComposer, RewardError, RewardFunction, RewardOutput, reward_name
from .mixture import MixtureRewards

__all__ = [
    "DigitMatchReward",
    "ExactMatchReward",
    "MixtureRewards",
    "NumericDistanceReward",
    "NumericMatchReward",
    "PositionMatchReward",
    "RegexFormatReward",
    "RewardComposer",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "SoftOverlongPenalty",
    "last_number",
    "reward_name",
]
