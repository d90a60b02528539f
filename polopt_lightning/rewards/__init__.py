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
from .code import CodeExecutionReward, extract_code, parse_tests
from .composer import RewardComposer, RewardError, RewardFunction, RewardOutput, TrainerState, reward_name
from .math import MathAccuracyReward, TagFormatReward
from .mixture import MixtureRewards
from .model import RewardModel

__all__ = [
    "CodeExecutionReward",
    "DigitMatchReward",
    "ExactMatchReward",
    "MathAccuracyReward",
    "MixtureRewards",
    "NumericDistanceReward",
    "NumericMatchReward",
    "PositionMatchReward",
    "RegexFormatReward",
    "RewardComposer",
    "RewardError",
    "RewardFunction",
    "RewardModel",
    "RewardOutput",
    "build_rewards",
    "SoftOverlongPenalty",
    "TagFormatReward",
    "TrainerState",
    "extract_code",
    "last_number",
    "parse_tests",
    "reward_name",
]


def build_rewards(reward_fns, weights=None, on_error: str = "raise", accuracy: str | None = None):
    """The module's rewards and the name of the function whose mean is ``val/accuracy``: ``(rewards, accuracy)``.

    ``reward_fns``: TRL-style functions, a list or a mapping from key to function (combined by a
    :class:`RewardComposer` with ``weights`` and ``on_error``), a ready composer, or a task mixture's
    :class:`MixtureRewards` (whose accuracy is each task's own: ``None``). ``accuracy`` names a function by its key
    or name; the name is returned. Settings that do not apply raise a ValueError naming them.
    """
    if reward_fns is None:
        raise ValueError("reward_fns is required: give at least one reward function")
    if isinstance(reward_fns, MixtureRewards):
        if accuracy is not None:
            raise ValueError("accuracy_reward is set for a task mixture, whose accuracy is each task's own "
                             "(MixtureRewards(accuracy={task: function}))")
        if weights is not None:
            raise ValueError("reward_weights is set beside a MixtureRewards: give each task's weights to its "
                             "RewardComposer (or set them with MixtureRewards.set_weights)")
        return reward_fns, None
    rewards = reward_fns if isinstance(reward_fns, RewardComposer) else RewardComposer(reward_fns, weights=weights,
                                                                                       on_error=on_error)
    if accuracy is not None:
        try:
            accuracy = rewards.resolve(accuracy)  # its key or its name -> its name
        except ValueError:
            raise ValueError(f"accuracy_reward={accuracy!r} is not a reward function; the keys: {rewards.keys}"
                             + (f" (or the functions' names {rewards.names})" if rewards.keys != rewards.names
                                else "")) from None
    return rewards, accuracy or rewards.names[0]
