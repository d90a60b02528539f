"""Advantage estimators: group-relative (GRPO and its scales), leave-one-out (RLOO), REINFORCE++ (batch-whitened,
with or without a group baseline), ReMax (the greedy completion's reward as the baseline), pass@k (the best completion
of each group against the second best) and GAE over a critic's values (PPO), selectable by name.

Rewards arrive as one flat ``[N]`` tensor with ``N = prompts * group_size``, laid out group by group: the
completions of prompt 0 first, then those of prompt 1, and so on. NaN marks a reward that a reward function
declined to give (``None``): it is left out of the group statistics and gets advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..objectives.base import ADVANTAGE_SCALES

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


@dataclass(frozen=True)
class AdvantageEstimator:
    """How rewards become advantages, by name (``experience.advantage_estimator``).

    Attributes:
        name: the key it is registered under.
        baseline: what each reward is measured against: ``"group"`` (its group's mean), ``"leave_one_out"`` (the mean
            of the group's other rewards: ``G/(G-1)`` times the group-mean difference), ``"none"`` (the reward
            itself, the batch mean subtracted by ``whiten``), ``"greedy"`` (the reward of the prompt's greedy
            completion, drawn for it each step: ReMax), ``"second_best"`` (only each group's best completion gets an
            advantage, its reward less the group's second best: pass@k) or ``"critic"`` (a learned value per token:
            GAE, :func:`gae`; the module then trains a critic).
        default_scale: the scale used when ``experience.advantage_scale`` is null (``None``: the objective's own).
        whiten: with ``scale="batch"``, subtract the batch mean of the baselined values and divide by their standard
            deviation (REINFORCE++'s normalisation); otherwise divide by the standard deviation of the batch's rewards.
        paper: where it comes from.
    """

    name: str
    baseline: str
    default_scale: str | None
    whiten: bool
    paper: str


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
BASELINES = ("group", "leave_one_out", "none", "greedy", "second_best", "critic")


def register_estimator(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Make ``estimator`` selectable by its name (``experience.advantage_estimator=<name>``)."""
    if estimator.baseline not in BASELINES:
        raise ValueError(f"estimator {estimator.name!r}: baseline must be one of {BASELINES}, got "
                         f"{estimator.baseline!r}")
    if estimator.default_scale is not None and estimator.default_scale not in ADVANTAGE_SCALES:
        raise ValueError(f"estimator {estimator.name!r}: default_scale must be one of {ADVANTAGE_SCALES} or None")
    ADVANTAGE_ESTIMATORS[estimator.name] = estimator
    return estimator


for _estimator in (
    AdvantageEstimator("grpo", "group", None, False, "DeepSeekMath (Shao et al., 2024)"),
    AdvantageEstimator("rloo", "leave_one_out", "none", False, "RLOO (Ahmadian et al., 2024)"),
    AdvantageEstimator("reinforce_pp", "none", "batch", True, "REINFORCE++ (Hu, 2025)"),
    AdvantageEstimator("reinforce_pp_baseline", "group", "batch", True, "REINFORCE++ with a group baseline (Hu, 2025)"),
    AdvantageEstimator("remax", "greedy", "none", False, "ReMax (Li et al., 2023)"),
    AdvantageEstimator("pass_at_k", "second_best", None, False, "pass@k training (Tang et al., 2025; verl's grpo_passk)"),
    AdvantageEstimator("gae", "critic", None, False, "PPO with GAE (Schulman et al., 2016; 2017)"),
):
    register_estimator(_estimator)


def get_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"experience.advantage_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {name!r}")
    return ADVANTAGE_ESTIMATORS[name]


def baselined(rewards: Tensor, group_size: int, estimator: str = "grpo", baselines: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
    """``[P, G]`` rewards minus the estimator's baseline, and ``[P, G]`` which of them carry an advantage (valid, and
    in a group with signal when the baseline is the group's). ``baselines`` ``[N]``: each row's baseline reward where
    the estimator's is given (ReMax's greedy completion's, NaN where it has none)."""
    est = get_estimator(estimator)
    grouped = _grouped(rewards, group_size)
    mean, _, valid, has_signal = _group_stats(grouped)
    if est.baseline == "critic":
        raise ValueError(f"the {estimator} estimator measures each token against a critic's value: its advantages "
                         "are per token (gae()), not per completion")
    if est.baseline == "none":
        return torch.where(valid, grouped, torch.zeros_like(grouped)), valid
    if est.baseline == "greedy":
        if baselines is None or baselines.shape != rewards.shape:
            raise ValueError(f"the {estimator} estimator needs each row's baseline reward (the greedy completion's), "
                             f"[N]={tuple(rewards.shape)}; got {None if baselines is None else tuple(baselines.shape)}")
        base = baselines.float().to(grouped.device).view_as(grouped)
        keep = valid & torch.isfinite(base)
        return torch.where(keep, grouped - base, torch.zeros_like(grouped)), keep
    if est.baseline == "second_best":  # only the best valid completion of a group, against the second best
        ranked = torch.where(valid, grouped, torch.full_like(grouped, float("-inf")))
        top, index = ranked.topk(min(2, group_size), dim=-1)
        if group_size < 2:
            return torch.zeros_like(grouped), torch.zeros_like(valid)
        keep = torch.zeros_like(valid).scatter(-1, index[:, :1], True) & (valid.sum(-1, keepdim=True) >= 2)
        gap = (top[:, :1] - top[:, 1:2]).expand_as(grouped)
        return torch.where(keep, gap, torch.zeros_like(grouped)), keep
    centered = grouped - mean
    if est.baseline == "leave_one_out":
        count = valid.sum(-1, keepdim=True).float()
        centered = centered * count / (count - 1).clamp(min=1)
    keep = valid & has_signal
    return torch.where(keep, centered, torch.zeros_like(centered)), keep


def batch_values(rewards: Tensor, group_size: int, estimator: str = "grpo") -> Tensor:
    """The values whose batch moments ``scale="batch"`` divides by (and, for a whitening estimator, subtracts the mean
    of): the baselined values of every valid reward for a whitening estimator, else the valid rewards."""
    est = get_estimator(estimator)
    if not est.whiten:
        return rewards[torch.isfinite(rewards)]
    values, _ = baselined(rewards, group_size, estimator)
    return values[torch.isfinite(_grouped(rewards, group_size))]


def batch_weights(rewards: Tensor, token_counts: Tensor | None) -> Tensor | None:
    """The weights of :func:`batch_values`' entries under per-token whitening: each valid reward's completion's token
    count (``token_counts`` ``[N]``, in the rewards' order); ``None`` for ``None`` (each completion once)."""
    if token_counts is None:
        return None
    if token_counts.shape != rewards.shape:
        raise ValueError(f"token_counts must have the shape of rewards {tuple(rewards.shape)}, got "
                         f"{tuple(token_counts.shape)}")
    return token_counts.to(rewards.device)[torch.isfinite(rewards)]


def weighted_moments(values: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased standard deviation of ``values``, each counted ``weights`` times (a completion's value once per
    token: ``var = sum w (x - mean)^2 / (sum w - 1)``, verl's ``masked_whiten`` over the tokens); 0 for fewer than two
    counted."""
    w, x = weights.double(), values.double()
    count, total, squares = w.sum(), (w * x).sum(), (w * x * x).sum()
    mean = (total / count.clamp(min=1)).float()
    if count < 2:
        return mean, torch.zeros((), device=values.device)
    return mean, ((squares - total ** 2 / count) / (count - 1)).clamp(min=0).sqrt().float()


def estimate_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", scale: str | None = None,
                        batch_mean: Tensor | None = None, batch_std: Tensor | None = None,
                        token_counts: Tensor | None = None, baselines: Tensor | None = None) -> Tensor:
    """``[N]`` advantages of ``rewards`` (group by group, NaN where missing) by the estimator ``estimator``
    (:data:`ADVANTAGE_ESTIMATORS`) and ``scale`` (``None``: the estimator's default, ``"group"`` for GRPO).

    ``grpo`` is :func:`group_relative_advantages`. ``rloo`` measures each reward against the mean of its group's
    others. ``reinforce_pp`` whitens the rewards over the batch (``(r - mean) / std``), group structure aside;
    ``reinforce_pp_baseline`` whitens the group-mean differences. ``remax`` measures each reward against
    ``baselines`` ``[N]``, the reward of its prompt's greedy completion (ReMax; verl's ``remax``: no scale by default).
    ``pass_at_k`` gives each group's best completion its reward less the group's second best and every other
    completion 0 (verl's ``grpo_passk``; with the group scale divided by the group's standard deviation, as verl's
    ``norm_adv_by_std_in_grpo``): the policy is pushed toward one more right answer among ``G`` tries, not toward each
    try being right. ``batch_mean`` / ``batch_std``: the moments of
    :func:`batch_values` over every process (each holds a share of the batch); by default these rewards' own.
    ``token_counts`` ``[N]`` (``experience.whitening="token"``): a whitening estimator's own moments count each
    completion's value once per token (:func:`weighted_moments`), as the REINFORCE++ paper and verl whiten over the
    batch's tokens; ``None``: once per completion. Missing rewards get 0; so do groups without signal where the
    baseline is the group's. A group of one (``group_size=1``) has no baseline: estimators with one refuse it.
    """
    est = get_estimator(estimator)
    scale = scale or est.default_scale or "group"
    if group_size == 1 and est.baseline in ("group", "leave_one_out", "second_best"):
        raise ValueError(f"experience.num_generations=1: the {estimator} estimator measures each completion against "
                         "the other completions of its prompt, and a group of one has none (every advantage would be "
                         "0); draw at least 2 completions per prompt (experience.num_generations >= 2)")
    if token_counts is not None and not (est.whiten and scale == "batch"):
        raise ValueError(f"experience.whitening='token' weighs REINFORCE++'s batch whitening by tokens: the "
                         f"{estimator} estimator with scale {scale!r} does not whiten (reinforce_pp, "
                         "reinforce_pp_baseline with scale 'batch' do)")
    if est.name == "grpo":
        return group_relative_advantages(rewards, group_size, scale, batch_std)
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    values, keep = baselined(rewards, group_size, estimator, baselines)
    if scale == "group":
        _, std, _, has_signal = _group_stats(_grouped(rewards, group_size))
        values, keep = values / std.clamp(min=ZERO_STD_TOLERANCE), keep & has_signal
    elif scale == "batch":
        if batch_std is None or (est.whiten and batch_mean is None):
            flat = batch_values(rewards, group_size, estimator).float()
            if token_counts is not None:
                batch_mean, batch_std = weighted_moments(flat, batch_weights(rewards, token_counts))
            else:
                batch_mean = flat.mean() if flat.numel() else flat.new_zeros(())
                batch_std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        if est.whiten:
            values = values - batch_mean
        values = values / batch_std.clamp(min=ZERO_STD_TOLERANCE)
    advantages = torch.where(keep, values, torch.zeros_like(values))
    return advantages.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


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


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[N, T]`` token rewards of outcome rewards ``[N]``: each completion's reward on its last policy token (the last
    where ``mask`` holds), 0 elsewhere; a missing (NaN) reward or an empty completion gives none."""
    mask = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)  # [N], -1: no token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = (last >= 0) & torch.isfinite(rewards.to(mask.device))
    rows = torch.nonzero(has).flatten()
    out[rows, last[rows]] = rewards.to(out)[rows]
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
        ) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016) over each completion's tokens: ``(advantages,
    returns)``, both ``[N, T]`` and not yet whitened.

    ``delta_t = r_t + gamma V_{t'} - V_t`` with ``t'`` the next token where ``mask`` holds (tokens outside the mask, a
    multi-turn rollout's tool results and the padding, are skipped: their value and TD error do not enter, as verl's
    ``compute_gae_advantage_return`` skips observation tokens) and ``V`` 0 past the last; ``A_t = delta_t + gamma lam
    A_{t'}``; ``returns = A + V`` (the critic's targets). ``values`` are the critic's at sampling time, ``V_t`` the
    value of the state before token ``t``."""
    if not token_rewards.shape == values.shape == mask.shape:
        raise ValueError(f"token_rewards, values and mask must have one shape, got {tuple(token_rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    rewards, values, m = token_rewards.float(), values.float(), mask.float()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        running = step * m[:, t] + (1 - m[:, t]) * running
        out[:, t] = running
    return out, out + values


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """``[3]``: the count, sum and sum of squares of ``values`` where ``mask`` holds (in float64, to be summed over the
    processes before :func:`masked_whiten`)."""
    m = mask.bool()
    v = values.double()[m]
    return torch.stack([v.new_tensor(float(v.numel())), v.sum(), (v * v).sum()])


def masked_whiten(values: Tensor, mask: Tensor, moments: Tensor | None = None) -> Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the tokens where ``mask``
    holds (verl's ``masked_whiten``); ``moments``: :func:`masked_moments` summed over every process (by default these
    values' own). 0 outside the mask."""
    count, total, squares = (masked_moments(values, mask) if moments is None else moments.double()).unbind()
    mean = total / count.clamp(min=1)
    var = (squares - total * mean) / (count - 1).clamp(min=1)
    out = (values.double() - mean) * torch.rsqrt(var.clamp(min=0) + 1e-8)
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(values.dtype)


def turn_index(mask: Tensor) -> Tensor:
    """``[N, T]`` the turn each policy token belongs to (0, 1, ...: the runs of ``mask`` in a row, a multi-turn
    rollout's turns between the environment's tokens), -1 outside ``mask``."""
    m = mask.long()
    starts = torch.cat([m[:, :1], (m[:, 1:] > m[:, :-1]).long()], dim=1)
    return torch.where(m.bool(), starts.cumsum(1) - 1, torch.full_like(m, -1))


def turn_returns(outcome: Tensor, turn_rewards: Tensor, turns: Tensor, gamma: float = 1.0) -> Tensor:
    """``[N, K]`` each turn's discounted return: ``R_k = sum_{j >= k} gamma^(j-k) r_j`` over the completion's own
    ``turns`` ``[N]`` turns, with ``r_j`` the environment's reward for turn ``j`` (``turn_rewards`` ``[N, K]``, NaN:
    none) and the completion's reward (``outcome`` ``[N]``) added to its last turn's, as is any reward given for a turn
    past its last (a turn the token budget cut before the environment answered it); NaN past its last turn, and on
    every turn of a completion without a reward. ``K`` is at least the longest completion's turns."""
    turn_rewards = turn_rewards.float()
    N = turn_rewards.shape[0]
    K = max(turn_rewards.shape[1], int(turns.max()) if turns.numel() else 0)
    turn_rewards = torch.nn.functional.pad(turn_rewards, (0, K - turn_rewards.shape[1]), value=float("nan"))
    k = torch.arange(K, device=turn_rewards.device).expand(N, K)
    inside = k < turns[:, None]
    given = torch.where(torch.isfinite(turn_rewards), turn_rewards, torch.zeros_like(turn_rewards))
    rewards = torch.where(inside, given, torch.zeros_like(given))
    last = k == (turns[:, None] - 1)
    extra = torch.nan_to_num(outcome.float(), nan=0.0) + torch.where(inside, torch.zeros_like(given), given).sum(-1)
    rewards = rewards + torch.where(last, extra[:, None], torch.zeros_like(rewards))
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for j in range(K - 1, -1, -1):
        running = rewards[:, j] + gamma * running
        out[:, j] = running
    keep = inside & torch.isfinite(outcome)[:, None]
    return torch.where(keep, out, torch.full_like(out, float("nan")))


def spread_turns(values: Tensor, index: Tensor) -> Tensor:
    """``[N, T]`` each token's value of its turn (``values`` ``[N, K]``, :func:`turn_index`'s ``index``), 0 outside
    the policy's tokens and where the value is NaN."""
    gathered = values.gather(1, index.clamp(min=0))
    return torch.where((index >= 0) & torch.isfinite(gathered), gathered, torch.zeros_like(gathered))


def turn_token_rewards(outcome: Tensor, turn_rewards: Tensor, mask: Tensor) -> Tensor:
    """``[N, T]`` token rewards of a multi-turn rollout: each turn's environment reward (``turn_rewards`` ``[N, K]``,
    NaN: none) on its last token, the completion's reward (``outcome``) on its last policy token (GAE then carries
    each back to the tokens before it)."""
    index = turn_index(mask)
    turns = index.amax(-1) + 1
    # rewards for turns past a completion's last (cut before the environment answered) go to its last token
    k = torch.arange(turn_rewards.shape[1], device=turn_rewards.device).expand_as(turn_rewards)
    beyond = torch.where((k >= turns[:, None].to(k.device)) & torch.isfinite(turn_rewards), turn_rewards.float(),
                         torch.zeros_like(turn_rewards, dtype=torch.float32)).sum(-1)
    out = outcome_token_rewards(outcome.float() + beyond.to(outcome.device), mask)
    is_end = (index >= 0) & torch.cat([index[:, 1:] != index[:, :-1], torch.ones_like(index[:, :1], dtype=torch.bool)],
                                      dim=1)
    rows, cols = torch.nonzero(is_end, as_tuple=True)
    k = index[rows, cols]
    inside = k < turn_rewards.shape[1]
    rows, cols, k = rows[inside], cols[inside], k[inside]
    values = turn_rewards[rows, k].float()
    ok = torch.isfinite(values) & torch.isfinite(outcome[rows].float())
    out[rows[ok], cols[ok]] += values[ok]
    return out
