"""Group-relative advantage estimators (GRPO and its variants).

Rewards arrive as one flat ``[N]`` tensor with ``N = prompts * group_size``, laid out group by group: the
completions of prompt 0 first, then those of prompt 1, and so on. NaN marks a reward that a reward function
declined to give (``None``): it is left out of the group statistics and gets advantage 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("group", "batch", "none")
# A group whose valid rewards spread less than this has no learning signal: its advantages are exactly 0, not
# (r - mean) / tiny amplified rounding noise.
ZERO_STD_TOLERANCE = 1e-6


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [N] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a whole number of groups of group_size={group_size}"
        )
    return rewards.float().view(-1, group_size)  # [P, G]


def _group_stats(grouped: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per group: mean and unbiased std over valid rewards, the valid mask and whether the group has signal."""
    valid = torch.isfinite(grouped)  # [P, G]
    count = valid.sum(-1, keepdim=True)  # [P, 1]
    values = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = values.sum(-1, keepdim=True) / count.clamp(min=1)
    sq_dev = torch.where(valid, (grouped - mean) ** 2, torch.zeros_like(grouped))
    std = (sq_dev.sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    has_signal = (count >= 2) & (std > ZERO_STD_TOLERANCE)  # [P, 1]
    return mean, std, valid, has_signal


def group_relative_advantages(rewards: Tensor, group_size: int, scale: str = "group",
                              batch_std: Tensor | None = None) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a standard deviation.

    Args:
        rewards: ``[N]`` rewards, group by group; NaN for a missing reward.
        group_size: completions per prompt (``G``).
        scale: ``"group"`` divides by the group's std (DeepSeekMath), ``"batch"`` by the std of all valid
            rewards in the batch (more robust for small groups), ``"none"`` keeps the raw difference (Dr. GRPO).
        batch_std: with ``scale="batch"``, the standard deviation to divide by instead of these rewards' own: the
            whole step's over every process when each holds a share of the batch.

    Returns:
        ``[N]`` advantages. Groups whose valid rewards are all equal (or that hold fewer than two valid
        rewards) get exactly 0, and so do NaN rewards.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    grouped = _grouped(rewards, group_size)
    mean, std, valid, has_signal = _group_stats(grouped)
    centered = grouped - mean
    if scale == "group":
        centered = centered / std.clamp(min=ZERO_STD_TOLERANCE)
    elif scale == "batch":
        if batch_std is None:
            flat = grouped[valid]
            batch_std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        centered = centered / batch_std.clamp(min=ZERO_STD_TOLERANCE)
    advantages = torch.where(valid & has_signal, centered, torch.zeros_like(centered))
    return advantages.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Boolean ``[P]``: which groups carry no learning signal (all valid rewards equal, or < 2 valid)."""
    _, _, _, has_signal = _group_stats(_grouped(rewards, group_size))
    return ~has_signal.squeeze(-1)


def frac_zero_std(rewards: Tensor, group_size: int) -> Tensor:
    """Share of groups with no learning signal: TRL's ``frac_reward_zero_std``; 1.0 means a step learns nothing."""
    return zero_std_groups(rewards, group_size).float().mean()
