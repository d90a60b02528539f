import math

import pytest
import torch

from polopt_lightning.step.advantages import frac_zero_std, group_relative_advantages, zero_std_groups

NAN = float("nan")


def test_group_scale_zero_mean_unit_std():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, -1.0, 4.0, 0.0])
    adv = group_relative_advantages(rewards, group_size=4, scale="group").view(2, 4)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(-1), torch.ones(2))  # unbiased std, as the estimator uses


def test_hand_case():
    # group [1, 0]: mean .5, unbiased std sqrt(.5)
    adv = group_relative_advantages(torch.tensor([1.0, 0.0]), 2)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]) / math.sqrt(0.5))


def test_scale_none_and_batch():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0])
    torch.testing.assert_close(group_relative_advantages(rewards, 2, scale="none"), torch.tensor([0.5, -0.5, -1.0, 1.0]))
    batch_std = rewards.std()
    torch.testing.assert_close(
        group_relative_advantages(rewards, 2, scale="batch"), torch.tensor([0.5, -0.5, -1.0, 1.0]) / batch_std
    )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_groups_get_zero(scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 7.0, 7.0, 7.0])
    adv = group_relative_advantages(rewards, 3, scale=scale).view(3, 3)
    assert torch.isfinite(adv).all()
    assert (adv[0] == 0).all() and (adv[2] == 0).all() and (adv[1] != 0).all()
    assert frac_zero_std(rewards, 3).item() == pytest.approx(2 / 3)
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True]


def test_none_rewards_are_left_out():
    rewards = torch.tensor([1.0, NAN, 0.0, 1.0, NAN, NAN, NAN, 2.0])
    adv = group_relative_advantages(rewards, 4, scale="group")
    assert torch.isfinite(adv).all()
    # group 0: valid [1, 0, 1] -> mean 2/3, std of those three
    valid = torch.tensor([1.0, 0.0, 1.0])
    expected = (valid - valid.mean()) / valid.std()
    torch.testing.assert_close(adv[[0, 2, 3]], expected)
    assert adv[1] == 0
    # group 1 has a single valid reward: no signal, all zero
    assert (adv[4:] == 0).all()
    assert zero_std_groups(rewards, 4).tolist() == [False, True]


def test_bad_input():
    with pytest.raises(ValueError, match="whole number of groups"):
        group_relative_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="scale must be one of"):
        group_relative_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match=r"flat \[N\]"):
        group_relative_advantages(torch.zeros(2, 2), 2)
