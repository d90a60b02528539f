"""Reward functions (TRL-compatible) and their composition."""

from .builtin import (
    DigitMatchReward,
    ExactMatchReward,
    NumericMatchReward,
    RegexFormatReward,
    SoftOverlongPenalty,
    last_number,
)
from .composer import RewardComposer, RewardError, RewardFunction, RewardOutput, reward_name

__all__ = [
    "DigitMatchReward",
    "ExactMatchReward",
    "NumericMatchReward",
    "RegexFormatReward",
    "RewardComposer",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "SoftOverlongPenalty",
    "last_number",
    "reward_name",
]
