"""Edges of polopt_lightning/step/advantages.py that mutation testing (tests/mutation.sh, docs/testing.md) found unchecked:
the defaults, the registry's checks, the messages, groups of two, weights that count fewer than two."""

import pytest
import torch

from polopt_lightning.step.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    baselined,
    batch_values,
    batch_weights,
    estimate_advantages,
    group_relative_advantages,
    register_estimator,
    weighted_moments,
)

NAN = float("nan")


def test_the_default_estimator_is_grpo_with_its_group_scale():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0, 2.0, NAN])
    torch.testing.assert_close(estimate_advantages(rewards, 2), group_relative_advantages(rewards, 2, "group"))
    values, keep = baselined(rewards, 2)
    torch.testing.assert_close(values, torch.tensor([[0.5, -0.5], [-1.0, 1.0], [0.0, 0.0]]))
    assert keep.tolist() == [[True, True], [True, True], [False, False]]
    # a non-whitening estimator's batch values are the valid rewards themselves
    torch.testing.assert_close(batch_values(rewards, 2), torch.tensor([1.0, 0.0, 3.0, 5.0, 2.0]))


def test_grpo_divides_by_the_batch_std_it_is_given():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0])
    torch.testing.assert_close(estimate_advantages(rewards, 2, "grpo", "batch", batch_std=torch.tensor(4.0)),
                               torch.tensor([0.5, -0.5, -1.0, 1.0]) / 4.0)


def test_rloo_in_groups_of_two():
    # each reward against the one other: r_i - r_j (G/(G-1) = 2 times the group-mean difference)
    torch.testing.assert_close(estimate_advantages(torch.tensor([1.0, 0.0, 3.0, 7.0]), 2, "rloo"),
                               torch.tensor([1.0, -1.0, -4.0, 4.0]))


def test_the_estimators_messages_and_refusals():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    with pytest.raises(ValueError, match=r"the other completions of its prompt, and a group of one has none \(every "
                                         r"advantage would be 0\); draw at least 2 completions per prompt"):
        estimate_advantages(rewards, 1, "rloo")
    with pytest.raises(ValueError, match=r"does not whiten \(reinforce_pp, reinforce_pp_baseline with scale 'batch' "
                                         r"do\)"):
        estimate_advantages(rewards, 2, "rloo", "batch", token_counts=torch.ones(4))  # batch, but no whitening
    with pytest.raises(ValueError, match="scale must be one of"):
        estimate_advantages(rewards, 2, "rloo", "std")
    with pytest.raises(ValueError, match=r"token_counts must have the shape of rewards \(4,\), got \(3,\)"):
        batch_weights(rewards, torch.ones(3))


def test_weighted_moments_with_fewer_than_two_counted_and_a_small_variance():
    mean, std = weighted_moments(torch.tensor([3.0, 5.0]), torch.tensor([1.0, 0.0]))
    assert mean.item() == 3.0 and std.item() == 0.0 and std.shape == ()
    mean, std = weighted_moments(torch.tensor([0.0, 0.2]), torch.tensor([1.0, 1.0]))  # exactly two counted
    torch.testing.assert_close(mean, torch.tensor(0.1))
    torch.testing.assert_close(std, torch.tensor([0.0, 0.2]).std())  # var 0.02: not clamped up to 1


def test_register_estimator_checks_and_stores():
    with pytest.raises(ValueError, match="baseline must be one of .*'group', 'leave_one_out', 'none'.*, got 'median'"):
        register_estimator(AdvantageEstimator("x_bad", "median", None, False, ""))
    with pytest.raises(ValueError, match="default_scale must be one of"):
        register_estimator(AdvantageEstimator("x_bad", "group", "token", False, ""))
    assert "x_bad" not in ADVANTAGE_ESTIMATORS
    try:
        for baseline in ("group", "leave_one_out", "none"):
            for scale in (None, "group", "batch", "none"):
                est = AdvantageEstimator(f"x_{baseline}", baseline, scale, False, "")
                assert register_estimator(est) is est and ADVANTAGE_ESTIMATORS[est.name] is est
    finally:
        for baseline in ("group", "leave_one_out", "none"):
            ADVANTAGE_ESTIMATORS.pop(f"x_{baseline}", None)


def test_batch_scales_with_the_moments_given_or_too_few_rewards():
    rewards = torch.tensor([1.0, 0.0, 3.0, 7.0])
    loo = torch.tensor([1.0, -1.0, -4.0, 4.0])
    # RLOO does not whiten: scale "batch" divides by the rewards' std, or by the one given (no mean needed)
    torch.testing.assert_close(estimate_advantages(rewards, 2, "rloo", "batch"), loo / rewards.std())
    torch.testing.assert_close(estimate_advantages(rewards, 2, "rloo", "batch", batch_std=torch.tensor(2.0)), loo / 2)
    # two valid rewards in the batch: their std, not 0
    torch.testing.assert_close(group_relative_advantages(torch.tensor([1.0, 0.0]), 2, "batch"),
                               torch.tensor([0.5, -0.5]) / torch.tensor([1.0, 0.0]).std())
    torch.testing.assert_close(estimate_advantages(torch.tensor([1.0, 0.0]), 1, "reinforce_pp"),
                               torch.tensor([0.5, -0.5]) / torch.tensor([1.0, 0.0]).std())
    # one valid reward, or none: advantages 0, never NaN
    for r in (torch.tensor([2.0, NAN, NAN, NAN]), torch.full((4,), NAN)):
        for est in ("grpo", "reinforce_pp", "reinforce_pp_baseline"):
            assert torch.equal(estimate_advantages(r, 2, est, "batch"), torch.zeros(4)), (r, est)
        assert torch.equal(estimate_advantages(r, 1, "reinforce_pp", "batch"), torch.zeros(4))


def test_a_group_scale_without_signal_gives_zero_for_every_estimator():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # group 0: equal rewards
    for est in ("rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert estimate_advantages(rewards, 2, est, "group")[:2].tolist() == [0.0, 0.0], est


def test_the_advantages_dtype_follows_float_rewards_else_float32():
    for fn in (lambda r: estimate_advantages(r, 2, "rloo"), lambda r: group_relative_advantages(r, 2)):
        assert fn(torch.tensor([1.0, 0.0], dtype=torch.float64)).dtype == torch.float64
        assert fn(torch.tensor([1, 0])).dtype == torch.float32


def test_a_group_size_below_one_is_refused():
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        group_relative_advantages(torch.zeros(4), 0)
