"""Making experience through its public surface, without a module or a Trainer: a sampler given as a function,
rewards, dynamic sampling and overlong filtering, and the typed experience it returns."""

import torch

from polopt_lightning.rewards import RewardComposer
from polopt_lightning.rollout import RolloutBatch
from polopt_lightning.step.experience import Experience, ExperienceMaker


def length(prompts, completions, completion_ids, **kw):
    return [float(len(ids)) for ids in completion_ids]


def draw(lengths, finished=None, G=2):
    """A rollout whose rows have these completion lengths (tokens 5, pad 0), one prompt token each."""
    N, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return RolloutBatch(prompt_ids=torch.ones(N, 1, dtype=torch.long), prompt_mask=torch.ones(N, 1, dtype=torch.long),
                        completion_ids=5 * mask, completion_mask=mask, sampling_logprobs=-0.5 * mask.float(),
                        finished=torch.tensor(finished or [True] * N), group_size=G)


def test_dynamic_sampling_keeps_the_groups_with_a_signal_and_draws_until_the_batch_is_full(tiny):
    _, tok = tiny
    maker = ExperienceMaker(tok, RewardComposer([length]), {"num_generations": 2, "advantage_scale": "group",
                                                              "dynamic_sampling": True, "max_extra_draws": 1})
    draws = iter([draw([1, 3, 2, 2]), draw([1, 2, 3, 3])])  # groups: signal, none; then signal, none
    batch = {"prompt_ids": torch.ones(2, 1), "prompts": ["a", "b"]}
    exp, metrics = maker.make(batch, lambda prompts: next(draws), lambda: batch, torch.device("cpu"))
    assert isinstance(exp, Experience) and exp.num_rows == 4
    assert exp.completion_mask.sum(-1).tolist() == [1, 3, 1, 2]  # the first group of each draw
    assert exp.group_index.tolist() == [0, 0, 1, 1]
    assert torch.allclose(exp.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / 2 ** 0.5, atol=1e-4)
    assert exp.old_logprobs is None and exp.ref_logprobs is None and exp.anchor_ids is None
    assert float(metrics["train/dynamic_sampling/dropped_groups"]) == 2
    assert float(metrics["train/dynamic_sampling/extra_draws"]) == 1
    assert float(metrics["train/frac_zero_std"]) == 0.5  # of the first draw, as the step's reward metrics


def test_the_experience_takes_its_advantages_from_the_configured_estimator(tiny):
    """Rewards 1, 3 (a group with a signal) and 4, 4 (none) through each estimator with its default scale, by hand:
    GRPO's group mean over the group's std, RLOO's mean of the others, REINFORCE++'s whitening over the batch (where
    the constant group keeps nonzero advantages)."""
    _, tok = tiny
    s = 2 ** 0.5  # the group (1, 3)'s std; and the batch's: rewards 1, 3, 4, 4 are 3 - 2, 3 + 0, 3 + 1, 3 + 1
    want = {"grpo": [-1 / s, 1 / s, 0.0, 0.0], "rloo": [-2.0, 2.0, 0.0, 0.0],
            "reinforce_pp": [-2 / s, 0.0, 1 / s, 1 / s]}
    for estimator, advantages in want.items():
        maker = ExperienceMaker(tok, RewardComposer([length]), {"num_generations": 2,
                                                                "advantage_estimator": estimator})
        exp, _ = maker.make({"prompt_ids": torch.ones(2, 1), "prompts": ["a", "b"]},
                            lambda prompts: draw([1, 3, 4, 4]), lambda: None, torch.device("cpu"))
        torch.testing.assert_close(exp.advantages, torch.tensor(advantages), msg=estimator)


def test_overlong_filtering_masks_the_truncated_completions(tiny):
    _, tok = tiny
    maker = ExperienceMaker(tok, RewardComposer([length]), {"num_generations": 2, "advantage_scale": "none",
                                                              "mask_truncated_completions": True})
    exp, _ = maker.make({"prompt_ids": torch.ones(1, 1), "prompts": ["a"]},
                        lambda prompts: draw([2, 3], finished=[True, False]), lambda: None, torch.device("cpu"))
    assert exp.completion_mask.sum(-1).tolist() == [2, 0]
    assert exp.advantages.tolist() == [-0.5, 0.5]  # no scaling: rewards minus the group mean
