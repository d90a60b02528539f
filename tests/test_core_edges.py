"""Edges of the step that mutation testing (tests/mutation.sh, docs/testing.md) found unchecked: the rewards' composer,
the sampler correction and the learning-rate schedule of the update, and the multi-turn masks."""

import functools
import math
import os
import re
import warnings

import pytest
import torch

from polopt_lightning.rewards import RewardComposer, RewardError
from polopt_lightning.rewards.composer import reward_name

from .helpers.step import term_advantages

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]


def scored(prompts, completions, bonus=0.0, **kw):
    return [float(len(p)) + bonus for p in prompts]


class Judge:
    def __call__(self, prompts, completions, **kw):
        return [1.0] * len(completions)


class Named:  # an object whose __name__ is not a string is named by its class
    __name__ = 7

    def __call__(self, prompts, completions, **kw):
        return [0.0] * len(completions)


# ---------------------------------------------------------------------------------------------- the rewards' composer
def test_each_function_is_logged_under_its_own_its_wrapped_or_its_class_name():
    assert reward_name(scored) == "scored"
    assert reward_name(functools.partial(scored, bonus=1.0)) == "scored"  # the wrapped function's
    assert reward_name(lambda prompts, completions, **kw: []) == "reward"  # a plain lambda
    assert reward_name(functools.partial(lambda prompts, completions, **kw: [])) == "partial"
    assert reward_name(Judge()) == "Judge" and reward_name(Named()) == "Named"


def test_functions_given_alone_by_key_or_in_a_list_are_known_by_key_and_name():
    alone = RewardComposer(scored)
    assert (alone.names, alone.keys, alone.reward_fns) == (["scored"], ["scored"], [scored])
    keyed = RewardComposer({"length": scored, 2: Judge()})
    assert (keyed.names, keyed.keys) == (["scored", "Judge"], ["length", "2"])
    assert keyed.resolve("length") == "scored" and keyed.resolve("Judge") == "Judge"
    with pytest.raises(ValueError, match=re.escape("accuracy_reward: no reward function 'x'; the keys: ['length', "
                                                   "'2'] (or the functions' names ['scored', 'Judge'])")):
        keyed.resolve("x", "accuracy_reward")
    with pytest.raises(ValueError, match=re.escape("reward weights: no reward function 'x'; the keys: ['scored']") + "$"):
        alone.resolve("x")
    with pytest.raises(ValueError, match="^RewardComposer needs at least one reward function$"):
        RewardComposer([])
    with pytest.raises(TypeError, match=re.escape("reward_fns[bad] is not callable: 3")):
        RewardComposer({"ok": scored, "bad": 3})
    with pytest.raises(TypeError, match=re.escape("reward_fns[1] is not callable: 'x'")):
        RewardComposer([scored, "x"])


def test_the_accuracy_is_the_named_functions_column_and_place_reaches_only_functions_that_take_it():
    class Placed:
        def __init__(self):
            self.devices = []

        def __call__(self, prompts, completions, **kw):
            return [0.0] * len(completions)

        def place(self, device):
            self.devices.append(device)

    class Unplaced(Placed):
        place = None  # an attribute that is not callable: left alone

    placed, unplaced = Placed(), Unplaced()
    composer = RewardComposer({"first": scored, "model": placed, "other": unplaced})
    per_function = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert composer.accuracy(per_function).tolist() == [1.0, 4.0]  # the first function by default
    assert composer.accuracy(per_function, {}, "model").tolist() == [2.0, 5.0]  # by key
    assert composer.accuracy(per_function, None, "Unplaced").tolist() == [3.0, 6.0]  # by name
    with pytest.raises(ValueError, match=r"^accuracy_reward: no reward function 'x'"):
        composer.accuracy(per_function, None, "x")
    composer.place("meta")
    assert placed.devices == ["meta"] and unplaced.devices == []


def test_weights_by_key_or_name_default_to_one_and_refuse_repeats_unknowns_and_non_finite_values():
    comp = RewardComposer({"length": scored, "judge": Judge()}, weights={"judge": 3.0})
    assert comp.weights.tolist() == [1.0, 3.0]
    comp.set_weights({"scored": 2.0})  # by name
    assert comp.weights.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match=re.escape("reward weights name unknown functions ['a', 'b']; the keys: "
                                                   "['length', 'judge'] (or the functions' names ['scored', 'Judge'])")):
        comp.set_weights({"b": 1.0, "length": 1.0, "a": 1.0})
    with pytest.raises(ValueError, match=re.escape("reward weights name unknown functions ['x']; the keys: "
                                                   "['scored']") + "$"):  # a list: its keys are its names
        RewardComposer([scored], weights={"x": 1.0})
    with pytest.raises(ValueError, match=re.escape("reward weights give the function 'scored' twice (by its key and "
                                                   "its name)")):
        comp.set_weights({"length": 1.0, "scored": 2.0})
    with pytest.raises(ValueError, match=re.escape("reward weight of 'Judge' is not finite: nan")):
        comp.set_weights([1.0, float("nan")])
    with pytest.raises(ValueError, match=re.escape("got 1 reward weights for 2 reward functions ['scored', 'Judge']")):
        comp.set_weights([1.0])


def test_the_call_hands_each_function_the_prompts_and_reads_tensors_and_one_element_tensors():
    def as_tensor(prompts, completions, **kw):
        return torch.tensor([[1.0], [2.0], [3.0]])  # any shape with one value a completion

    def as_scalars(prompts, completions, **kw):
        return [torch.tensor(0.5), None, torch.tensor([2.0])]

    out = RewardComposer([scored, as_tensor, as_scalars], weights=[1.0, 2.0, -1.0])(PROMPTS, COMPLETIONS)
    assert out.per_function[:, 0].tolist() == [4.0, 4.0, 4.0]  # the prompts' lengths: the prompts reached it
    assert out.per_function[:, 1].tolist() == [1.0, 2.0, 3.0]
    assert out.per_function[0, 2].item() == 0.5 and math.isnan(out.per_function[1, 2]) and out.per_function[2, 2] == 2
    assert out.total.tolist() == [4.0 + 2.0 - 0.5, 4.0 + 4.0, 4.0 + 6.0 - 2.0]
    with pytest.raises(ValueError, match=re.escape("got 2 prompts for 3 completions; pass one prompt per completion")):
        RewardComposer([scored])(PROMPTS[:2], COMPLETIONS)

    def bad(prompts, completions, **kw):
        return [torch.tensor([1.0, 2.0])] * len(completions)

    with pytest.raises(RewardError, match=re.escape("reward function 'bad' returned Tensor tensor([1., 2.]) for "
                                                    "sample 0, expected float or None")):
        RewardComposer([bad])(PROMPTS, COMPLETIONS)


def test_standard_deviations_need_two_values_and_a_single_one_gives_zero():
    comp = RewardComposer([scored, Judge()])
    one = comp.summarize(torch.tensor([[1.0, float("nan")], [float("nan"), 2.0]]), torch.zeros(2))
    assert one["rewards/scored/std"].item() == 0.0 and one["rewards/Judge/std"].item() == 0.0
    two = comp.summarize(torch.tensor([[1.0, 2.0], [3.0, 2.0]]), torch.tensor([0.0, 1.0]))
    assert two["rewards/scored/std"].item() == pytest.approx(math.sqrt(2.0))
    assert two["reward_std"].item() == pytest.approx(math.sqrt(2.0))  # totals 3 and 5
    assert two["reward_errors/Judge"].item() == 1.0 and two["reward"].item() == 4.0


def test_with_on_error_none_each_failure_warns_where_the_caller_called():
    def flaky(prompts, completions, **kw):
        return [1.0, float("inf"), "x"]

    comp = RewardComposer([flaky], on_error="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = comp(PROMPTS, COMPLETIONS)
    messages = [str(w.message) for w in caught]
    assert messages == ["reward function 'flaky' returned non-finite inf for sample 1 -> treated as None "
                        "(on_error='none')", "reward function 'flaky' returned str 'x' for sample 2, expected float "
                        "or None -> treated as None (on_error='none')"]
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames to every call
        assert {w.filename for w in caught} == {__file__}  # stacklevel: the line that called the composer
    assert all(w.category is RuntimeWarning for w in caught) and out.metrics["reward_errors/flaky"].item() == 2


def test_a_failure_is_located_sample_by_sample_and_a_batch_failure_names_its_exception():
    def picky(prompts, completions, flag=None, **kw):
        if len(completions) > 1:
            raise KeyError("batch")
        return [1.0 if flag == [True] else 2.0]

    comp = RewardComposer([picky], on_error="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = comp(PROMPTS, COMPLETIONS, flag=[True, False, True])
    assert [str(w.message) for w in caught] == ["reward function 'picky' raised on the batch of 3: KeyError: 'batch' "
                                                "-> treated as None (on_error='none')"]
    assert out.per_function.isnan().all() and out.metrics["reward_errors/picky"].item() == 3

    def two_bad(prompts, completions, **kw):
        if completions[0] != "5" and len(completions) == 1:
            raise ValueError(f"no {completions[0]}")
        if len(completions) > 1:
            raise ValueError("batch")
        return [5.0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = RewardComposer([two_bad], on_error="none")(PROMPTS, COMPLETIONS)
    assert [str(w.message).split(" -> ")[0] for w in caught] == [
        "reward function 'two_bad' raised on sample 0: ValueError: no 2",
        "reward function 'two_bad' raised on sample 2: ValueError: no 6"]
    assert math.isnan(out.per_function[0, 0]) and out.per_function[1, 0] == 5.0 and math.isnan(out.per_function[2, 0])
    assert out.metrics["reward_errors/two_bad"].item() == 2



def test_every_bad_value_counts_and_the_values_after_it_are_kept():
    def spiky(prompts, completions, **kw):
        return [float("inf"), float("nan"), 2.0]

    with pytest.warns(RuntimeWarning):
        out = RewardComposer([spiky], on_error="none")(PROMPTS, COMPLETIONS)
    assert out.metrics["reward_errors/spiky"].item() == 2 and out.per_function[2, 0].item() == 2.0


def test_a_located_failure_hands_each_sample_its_prompt_and_columns_and_names_its_index_and_cause():
    def located(prompts, completions, answer, scale, **kw):
        if len(completions) > 1:
            raise RuntimeError("batch")
        if answer[0] == "bad":
            return ["x"]
        if answer[0] == "boom":
            raise ZeroDivisionError("boom")
        return [float(len(prompts[0])) * scale + float(answer[0])]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = RewardComposer([located], on_error="none")(PROMPTS, COMPLETIONS, answer=["1", "boom", "bad"], scale=2.0)
    assert [str(w.message).split(" -> ")[0] for w in caught] == [
        "reward function 'located' raised on sample 1: ZeroDivisionError: boom",
        "reward function 'located' returned str 'x' for sample 2, expected float or None"]
    assert out.per_function[0, 0].item() == 9.0 and out.per_function[1:].isnan().all()
    assert out.metrics["reward_errors/located"].item() == 2
    with pytest.raises(RewardError, match="raised on sample 1") as raised:
        RewardComposer([located])(PROMPTS, COMPLETIONS, answer=["1", "boom", "2"], scale=1.0)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)

    def batch_only(prompts, completions, **kw):
        if len(completions) > 1:
            raise KeyError("batch")
        return [1.0]

    with pytest.raises(RewardError, match="raised on the batch of 3: KeyError") as raised:
        RewardComposer([batch_only])(PROMPTS, COMPLETIONS)
    assert isinstance(raised.value.__cause__, KeyError)

# -------------------------------------------------------------------------------- the sampler correction, the schedule
def updater(objective=None, engine=None, **config):
    from polopt_lightning.objectives import GRPO
    from polopt_lightning.step.loop import TorchLoop
    from polopt_lightning.step.update import UpdateConfig, Updater

    return Updater(None, objective or GRPO(), None, engine, UpdateConfig(**config), TorchLoop())


def test_a_weight_is_capped_at_e_to_the_20_before_its_metrics_and_a_weight_at_the_cap_is_not_beyond_it():
    from polopt_lightning.step.terms import sampler_weights

    old, sampler, mask = torch.tensor([[0.0, 25.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2)
    weights, metrics = sampler_weights(old, sampler, mask, "token_truncate", cap=1e12)
    assert weights[0, 1].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert metrics["is_weight_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert metrics["sampler_kl"].item() == pytest.approx((math.exp(20.0) - 1 - 25.0) / 2, rel=1e-6)
    same = torch.tensor([[-1.0, -2.0]])  # weights of exactly 1 at a cap of 1
    for mode in ("token_mask", "sequence_mask"):
        weights, metrics = sampler_weights(same, same, mask, mode, cap=1.0)
        assert weights.eq(1.0).all() and metrics["is_capped_frac"].item() == 0.0


def test_the_correction_follows_the_backend_unless_set():
    from types import SimpleNamespace

    def corrects(**kw):
        return [term.name for term in updater(**kw).terms if term.name == "sampler_correction"] == ["sampler_correction"]

    asks, silent = SimpleNamespace(corrects_sampler=True), SimpleNamespace()
    assert corrects(engine=asks) is True and corrects(engine=silent) is False
    assert corrects(engine=asks, is_correction=False) is False
    assert corrects(engine=silent, is_correction=True) is True


def test_token_level_advantages_take_sequence_weights_and_the_top_entropy_mask_per_row():
    from types import SimpleNamespace

    advantages = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]])  # per token (verl's shape for such estimators)
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.1, 0.0]])
    sampler = torch.tensor([[0.0, -1.5, -2.0], [-0.5, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    exp = SimpleNamespace(advantages=advantages, sampling_logprobs=sampler)
    keep = torch.tensor([[True, False, True], [False, True, True]])
    out, _ = term_advantages(updater(is_correction=True, is_mode="sequence_truncate", is_cap=10.0,
                                     top_entropy_quantile=0.5), exp, torch.arange(2), old, mask, keep)
    w = math.exp(0.5)  # the first row's sequence weight; the second's is 1
    torch.testing.assert_close(out, torch.tensor([[w, 0.0, 3 * w], [0.0, -2.0, -3.0]]))


def test_token_level_advantages_take_token_weights_one_a_token():
    from types import SimpleNamespace

    advantages = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]])
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, -2.0, -1.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    exp = SimpleNamespace(advantages=advantages, sampling_logprobs=sampler)
    out, _ = term_advantages(updater(is_correction=True, is_mode="token_truncate", is_cap=2.0), exp, torch.arange(2),
                             old, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, 4.0, 3 / math.e], [-1.0, -2.0, -3.0]]))  # e capped at 2


def test_a_duck_typed_objective_without_token_advantages_refuses_token_weights():
    from types import SimpleNamespace

    exp = SimpleNamespace(advantages=torch.tensor([1.0]), sampling_logprobs=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="update.is_mode=token_truncate: SimpleNamespace takes one advantage a sequence; "
                                         "use update.is_mode=sequence_truncate or sequence_mask$"):
        updater(objective=SimpleNamespace(), is_correction=True, is_mode="token_truncate")
    sequence = updater(objective=SimpleNamespace(), is_correction=True)  # the default mode: one weight a sequence
    out, _ = term_advantages(sequence, exp, torch.arange(1), torch.zeros(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(out, exp.advantages)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_each_learning_rate_schedule_by_hand(schedule):
    from polopt_lightning.step.update import lr_factor

    floor = 0.1
    by_hand = {  # step: factor, with 4 warm-up steps of 14
        "constant": {0: 0.25, 3: 1.0, 4: 1.0, 9: 1.0, 14: 1.0, 20: 1.0},
        "linear": {0: 0.25, 3: 1.0, 4: 1.0, 9: floor + (1 - floor) * 0.5, 14: floor, 20: floor},
        "cosine": {0: 0.25, 3: 1.0, 4: 1.0, 9: floor + (1 - floor) * 0.5, 14: floor, 20: floor},
    }[schedule]
    assert {s: lr_factor(s, schedule, 4, 14, floor) for s in by_hand} == pytest.approx(by_hand)
    assert lr_factor(6, schedule, 4, 14, floor) == pytest.approx(
        {"constant": 1.0, "linear": floor + (1 - floor) * 0.8,
         "cosine": floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.2))}[schedule])
    # no decay left after the warm-up (total <= warmup) and a decay of one step
    assert lr_factor(5, schedule, 4, 4, floor) == 1.0 and lr_factor(5, schedule, 4, 3, floor) == 1.0
    assert lr_factor(4, schedule, 4, 5, floor) == 1.0
    assert lr_factor(5, schedule, 4, 5, floor) == pytest.approx(1.0 if schedule == "constant" else floor)
    assert lr_factor(0, schedule, 0, 10, floor) == 1.0  # no warm-up


def test_a_resume_with_another_max_steps_follows_the_schedule_over_the_new_total():
    """docs/recipes.md ("Resuming"): the schedule runs over ``trainer.max_steps``; a resume that changes it goes on
    along the decay over the new total from the step it stopped at (Hugging Face's Trainer does the same)."""
    from functools import partial
    from types import SimpleNamespace

    from polopt_lightning.optim import build_optimizer, optimizer_and_schedule
    from polopt_lightning.step.update import UpdateConfig, lr_factor

    config = UpdateConfig(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)

    def schedule(max_steps, params):
        trainer = SimpleNamespace(max_steps=max_steps, precision_plugin=None)
        built = optimizer_and_schedule(params, partial(build_optimizer, lr=1.0), config, trainer, lambda: True)
        return built["optimizer"], built["lr_scheduler"]["scheduler"]

    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer, scheduler = schedule(10, params)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(lr_factor(6, "cosine", 2, 10, 0.1))
    resumed_optimizer, resumed = schedule(20, params)  # the resume: a new schedule, the checkpoint's state loaded
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(lr_factor(6, "cosine", 2, 20, 0.1))
    assert lr_factor(6, "cosine", 2, 20, 0.1) > lr_factor(6, "cosine", 2, 10, 0.1) + 0.2  # the rate jumps up
    resumed_optimizer.step()
    resumed.step()
    assert resumed.get_last_lr()[0] == pytest.approx(lr_factor(7, "cosine", 2, 20, 0.1))
    # the same total: the restored rate stands as saved (a collapse rollback's scaled rate, here 0.123)
    optimizer.param_groups[0]["lr"] = 0.123
    same_optimizer, same = schedule(10, params)
    same_optimizer.load_state_dict(optimizer.state_dict())
    same.load_state_dict(scheduler.state_dict())
    assert same_optimizer.param_groups[0]["lr"] == 0.123


# --------------------------------------------------------------------------------------------- the multi-turn masks
def test_assembled_episodes_keep_each_tokens_owner_in_the_masks_types_and_extras():
    from types import SimpleNamespace

    from polopt_lightning.rollout.multi_turn import Episode, assemble

    a, b = Episode(env=None), Episode(env=None)
    a.add([5, 6], [-0.5, -0.25])  # the policy's turn
    a.add([7], None)  # the environment's answer
    a.add([8], [-1.0])
    a.done, a.finished, a.reward, a.turn_rewards, a.tool_calls = True, True, 1.5, [None, 1.0], 1
    b.add([9], [-2.0])
    b.done, b.finished = False, True  # its last turn ended with EOS but the episode was cut (token budget)
    out = assemble([a, b], torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), 2, pad=0)
    assert out.completion_ids.tolist() == [[5, 6, 7, 8], [9, 0, 0, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert out.context_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert out.sampling_logprobs.tolist() == [[-0.5, -0.25, 0.0, -1.0], [-2.0, 0.0, 0.0, 0.0]]
    assert (out.completion_ids.dtype, out.completion_mask.dtype, out.context_mask.dtype, out.sampling_logprobs.dtype) \
        == (torch.long, torch.long, torch.long, torch.float32)
    assert out.finished.tolist() == [True, False]  # finished only when the episode is done and ended with EOS
    assert out.prompt_ids.tolist() == [[1, 2], [1, 2]] and out.group_size == 2
    assert out.extras == {"env_reward": [1.5, 0.0], "turn_rewards": [[None, 1.0], []], "tool_calls": [1, 0],
                          "tool_errors": [0, 0], "tool_timeouts": [0, 0], "tool_error": [None, None]}
    empty = assemble([Episode(env=None)], torch.tensor([[1]]), torch.tensor([[1]]), 1, pad=3)
    assert empty.completion_ids.tolist() == [[3]] and empty.completion_mask.tolist() == [[0]]  # one column of padding
    # a turn the token budget cuts ends the episode: no text for the environment
    from polopt_lightning.rollout.multi_turn import MultiTurnEngine

    turn = SimpleNamespace(completion_mask=torch.tensor([[1, 1, 1]]), completion_ids=torch.tensor([[4, 5, 6]]),
                           sampling_logprobs=torch.tensor([[-0.1, -0.2, -0.3]]), finished=torch.tensor([True]))
    host = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids))))
    cut = Episode(env=None)
    assert MultiTurnEngine.take_turn(host, cut, turn, 0, left=2) is None
    assert (cut.ids, cut.policy, cut.finished) == ([4, 5], [1, 1], False)
    whole = Episode(env=None)
    assert MultiTurnEngine.take_turn(host, whole, turn, 0, left=3) == "4 5 6" and whole.finished


def test_the_environments_answer_adds_its_reward_ends_the_episode_or_adds_its_tokens_within_the_budget():
    from types import SimpleNamespace

    from polopt_lightning.rollout.multi_turn import EnvStep, Episode, MultiTurnEngine

    host = SimpleNamespace(max_turns=3, max_tokens=6,
                           turns=SimpleNamespace(role="tool", observation_ids=lambda text: [ord(c) for c in text]))
    episode = Episode(env=None)
    episode.add([1, 2], [-0.1, -0.2])
    assert MultiTurnEngine.answer_turn(host, episode, EnvStep("ab", 0.5), 0)  # 2 + 2 of 6 tokens: it goes on
    assert episode.ids == [1, 2, 97, 98] and episode.policy == [1, 1, 0, 0]
    assert episode.messages == [{"role": "tool", "content": "ab"}]
    assert MultiTurnEngine.answer_turn(host, episode, EnvStep(None, None), 1) is False  # nothing to say: the end
    assert episode.done and episode.turn_rewards == [0.5, None] and episode.reward == 0.5
    # a reward on every step adds up; done ends the episode even with an observation, which is then not added
    episode = Episode(env=None)
    assert MultiTurnEngine.answer_turn(host, episode, EnvStep("x", -0.25), 0)
    assert MultiTurnEngine.answer_turn(host, episode, EnvStep("seen", 1.5, done=True), 1) is False
    assert episode.reward == 1.25 and episode.turn_rewards == [-0.25, 1.5] and episode.ids == [120]
    # the last turn ends it; an observation is cut at the budget, which then stops the episode
    assert MultiTurnEngine.answer_turn(host, Episode(env=None), EnvStep("x"), 2) is False
    full = Episode(env=None)
    full.add([1, 2, 3], [0.0, 0.0, 0.0])
    assert MultiTurnEngine.answer_turn(host, full, EnvStep("abcdef"), 0) is False
    assert full.ids == [1, 2, 3, 97, 98, 99] and not full.done  # cut by the budget, not ended by the environment
    over = Episode(env=None)
    over.add(list(range(7)), [0.0] * 7)  # already past the budget: nothing more is added
    assert MultiTurnEngine.answer_turn(host, over, EnvStep("abc"), 0) is False and len(over.ids) == 7


class _Templated:
    """A tokenizer stand-in: its own rendering (``render(messages, generation)``), characters as ids, and a BOS id (1)
    in front unless ``add_special_tokens=False``, as Llama's tokenizers do."""

    chat_template = "stand-in"

    def __init__(self, render, eos_token="</s>"):
        self._render, self.eos_token = render, eos_token

    def apply_chat_template(self, messages, tools, tokenize, add_generation_prompt):
        return self._render(messages, add_generation_prompt)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}


def test_an_observations_tokens_start_after_the_policys_eos_without_special_tokens_or_where_no_eos_is_written():
    from polopt_lightning.rollout.multi_turn import ChatTurns

    def chat(eos):  # every message as "<role>:content", an assistant message closed by `eos`
        def render(messages, generation):
            text = "".join(f"<{m['role']}>:{m['content']}" + (eos if m["role"] == "assistant" else "") + "|"
                           for m in messages)
            return text + ("<assistant>:" if generation else "")
        return render

    def text(ids):
        return "".join(map(chr, ids))

    assert text(ChatTurns(_Templated(chat("</s>"))).observation_ids("46")) == "|<tool>:46|<assistant>:"
    # a template that writes no EOS: the tokens start where the assistant's message ends in the render
    assert text(ChatTurns(_Templated(chat(""))).observation_ids("46")) == "<tool>:46|<assistant>:"
    # a tokenizer without an EOS token: likewise
    assert text(ChatTurns(_Templated(chat("</s>"), eos_token=None)).observation_ids("46")) == "<tool>:46|<assistant>:"
    shuffled = _Templated(lambda messages, generation: "".join(m["content"] for m in reversed(messages)))
    with pytest.raises(ValueError, match=r"^the chat template does not render a conversation as a prefix of its "
                                         r"continuation: multi-turn rollouts need one that does$"):
        ChatTurns(shuffled).observation_ids("46")


def test_left_pad_right_aligns_rows_in_long_ids_and_masks():
    from polopt_lightning.rollout.multi_turn import left_pad

    ids, mask = left_pad([[5, 6], [], [7]], pad=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6], [0, 0], [0, 7]] and mask.tolist() == [[1, 1], [0, 0], [0, 1]]
    assert ids.dtype == mask.dtype == torch.long


# --------------------------------------------------------------------------- the experience: joining draws, moments
def _draw(widths, G, prompt_width, first_token, context=False):
    """A rollout of ``len(widths)`` prompts x G rows whose completion k of prompt p has ``widths[p]`` tokens."""
    from polopt_lightning.rollout.base import RolloutBatch

    P, T = len(widths), max(widths)
    ids = torch.full((P * G, T), 0)
    mask = torch.zeros((P * G, T), dtype=torch.long)
    for p, w in enumerate(widths):
        for k in range(G):
            ids[p * G + k, :w] = first_token + p * G + k
            mask[p * G + k, :w] = 1
    prompts = torch.full((P * G, prompt_width), 7)
    return RolloutBatch(prompt_ids=prompts, prompt_mask=torch.ones_like(prompts), completion_ids=ids,
                        completion_mask=mask, sampling_logprobs=-mask.float(), finished=torch.ones(P * G, dtype=bool),
                        group_size=G, context_mask=mask.clone() if context else None)


def test_draws_of_different_widths_join_padded_on_their_sides_up_to_the_limit_with_their_prompt_fields():
    from polopt_lightning.step.experience import concat_groups

    G = 2
    first = _draw([1, 3], G, prompt_width=2, first_token=10)  # prompts 0, 1: keep only prompt 1
    second = _draw([2, 1, 1], G, prompt_width=4, first_token=20)  # prompts 0-2: keep 0 and 2, the limit takes 0
    targets = lambda P, w: {"anchor_ids": torch.arange(P * w).view(P, w) + 1}  # noqa: E731 (per prompt, [P, w])
    parts = [(first, torch.arange(4.0), torch.tensor([False, True]), targets(2, 2)),
             (second, torch.arange(6.0) + 10, torch.tensor([True, False, True]), targets(3, 3))]
    out, rewards, picked = concat_groups(parts, G, limit=2)
    assert [p.tolist() for p in picked] == [[2, 3], [0, 1]]
    assert rewards.tolist() == [2.0, 3.0, 10.0, 11.0]
    assert out["group_index"].tolist() == [0, 0, 1, 1]
    assert out["completion_ids"].tolist() == [[12, 12, 12], [13, 13, 13], [20, 20, 0], [21, 21, 0]]  # right-padded
    assert out["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]]
    assert out["prompt_ids"].tolist() == [[0, 0, 7, 7], [0, 0, 7, 7], [7, 7, 7, 7], [7, 7, 7, 7]]  # left-padded
    assert out["prompt_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert out["sampling_logprobs"].tolist() == [[-1.0] * 3, [-1.0] * 3, [-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]]
    assert out["context_mask"] is None  # one turn: no context of its own
    assert out["anchor_ids"].tolist() == [[3, 4, 0], [1, 2, 3]]  # prompt 1 of the first draw, prompt 0 of the second
    # a multi-turn draw keeps its context mask; a one-turn draw beside it takes its completion mask as its context
    turns = _draw([2], G, prompt_width=2, first_token=30, context=True)
    turns.context_mask[:, 1] = 1
    turns.context_mask[0, 1], turns.completion_mask[0, 1] = 1, 0  # an environment token
    out, _, _ = concat_groups([(turns, torch.zeros(2), torch.tensor([True]), {}),
                               (_draw([3], G, 2, 40), torch.zeros(2), torch.tensor([True]), {})], G, limit=None)
    assert out["context_mask"].tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert out["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    # three draws: each one's groups numbered after all the groups kept before it
    three = [(_draw([1], G, 2, 50 + 10 * d), torch.zeros(2), torch.tensor([True]), {}) for d in range(3)]
    assert concat_groups(three, G, limit=None)[0]["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    # nothing kept past the limit, even from a draw that has groups to give
    out, rewards, picked = concat_groups([parts[0], parts[1]], G, limit=1)
    assert [p.tolist() for p in picked] == [[2, 3], []] and rewards.tolist() == [2.0, 3.0]


def test_pad_cat_pads_each_side_with_the_value_given():
    from polopt_lightning.step.experience import pad_cat

    a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[4]])
    assert pad_cat([a, b], 9).tolist() == [[1, 2, 3], [4, 9, 9]]
    assert pad_cat([a, b], -1, left=True).tolist() == [[1, 2, 3], [-1, -1, 4]]


def test_batch_moments_count_each_value_and_give_no_spread_below_two():
    from polopt_lightning.step.experience import ExperienceMaker

    moments = ExperienceMaker.batch_moments
    mean, std = moments(torch.tensor([1.0, 2.0, 6.0]), torch.device("cpu"))
    assert (mean.item(), std.item()) == (pytest.approx(3.0), pytest.approx(math.sqrt(7.0)))
    mean, std = moments(torch.tensor([1.0, 3.0]), torch.device("cpu"))  # two values: a spread
    assert (mean.item(), std.item()) == (pytest.approx(2.0), pytest.approx(math.sqrt(2.0)))
    mean, std = moments(torch.tensor([0.5]), torch.device("cpu"))  # one value: its mean, no spread
    assert (mean.item(), std.item(), std.shape) == (0.5, 0.0, ())
    mean, std = moments(torch.tensor([0.2, 0.2, 0.2]), torch.device("cpu"))  # equal values: no spread, not 1
    assert std.item() == pytest.approx(0.0, abs=1e-6)
    mean, std = moments(torch.tensor([1.0, 3.0]), torch.device("cpu"), torch.tensor([1.0, 3.0]))  # weighted: 1,3,3,3
    assert (mean.item(), std.item()) == (pytest.approx(2.5), pytest.approx(1.0))
    mean, std = moments(torch.tensor([]), torch.device("cpu"))
    assert (mean.item(), std.item()) == (0.0, 0.0)  # nothing counted: 0 / max(count, 1)
