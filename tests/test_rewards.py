import asyncio
import math
import re

import pytest
import torch

from polopt_lightning.rewards import (
    ExactMatchReward,
    NumericMatchReward,
    RegexFormatReward,
    RewardComposer,
    RewardError,
    SoftOverlongPenalty,
    last_number,
)

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]
ANSWERS = ["2", "4", "6"]


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_weighted_composition_and_metrics():
    comp = RewardComposer([ExactMatchReward(), length_reward], weights=[2.0, 0.5])
    out = comp(PROMPTS, ["2", "55", "6"], answer=ANSWERS)
    torch.testing.assert_close(out.per_function, torch.tensor([[1.0, 1.0], [0.0, 2.0], [1.0, 1.0]]))
    torch.testing.assert_close(out.total, torch.tensor([2.5, 1.0, 2.5]))
    assert out.metrics["reward"].item() == pytest.approx(2.0)
    assert out.metrics["reward_std"].item() == pytest.approx(torch.tensor([2.5, 1.0, 2.5]).std().item())
    assert out.metrics["rewards/exact_match/mean"].item() == pytest.approx(2 / 3)
    assert out.metrics["rewards/length_reward/mean"].item() == pytest.approx(4 / 3)
    assert out.metrics["reward_errors/exact_match"].item() == 0
    # weights by name, and replaced between steps
    comp.set_weights({"exact_match": 1.0, "length_reward": 0.0})
    torch.testing.assert_close(comp(PROMPTS, COMPLETIONS, answer=ANSWERS).total, torch.tensor([1.0, 0.0, 1.0]))


def test_none_is_left_out_of_the_total():
    def sometimes(prompts, completions, **kw):
        return [None, 1.0, None]

    def never(prompts, completions, **kw):
        return [None, None, None]

    out = RewardComposer([sometimes, never]).__call__(PROMPTS, COMPLETIONS)
    assert math.isnan(out.total[0]) and out.total[1] == 1.0
    assert out.metrics["rewards/never/none_frac"].item() == 1.0
    assert math.isnan(out.metrics["rewards/never/mean"].item())


def test_async_functions_run_concurrently():
    events = []  # each function's start and end, in the order they happen: overlapping, not one after the other

    async def slow_a(prompts, completions, **kw):
        events.append("a starts")
        await asyncio.sleep(0.05)
        events.append("a ends")
        return [1.0] * len(completions)

    async def slow_b(prompts, completions, **kw):
        events.append("b starts")
        await asyncio.sleep(0.05)
        events.append("b ends")
        return [2.0] * len(completions)

    out = RewardComposer([slow_a, slow_b, length_reward])(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(out.total, torch.tensor([4.0, 4.0, 4.0]))
    assert events[:2] == ["a starts", "b starts"] and sorted(events[2:]) == ["a ends", "b ends"], events


def test_async_inside_running_event_loop():
    async def a(prompts, completions, **kw):
        return [1.0] * len(completions)

    async def main():  # a notebook cell runs inside a loop
        return RewardComposer([a])(PROMPTS, COMPLETIONS)

    assert asyncio.run(main()).total.tolist() == [1.0, 1.0, 1.0]


def raises_on_five(prompts, completions, **kw):
    return [1.0 / (5 - int(c)) for c in completions]


def wrong_length(prompts, completions, **kw):
    return [1.0]


def returns_string(prompts, completions, **kw):
    return [0.0, "good", 1.0]


def returns_nan(prompts, completions, **kw):
    return [0.0, 1.0, float("inf")]


def returns_scalar(prompts, completions, **kw):
    return 1.0


def reads_messages(prompts, completions, **kw):  # written for TRL's conversational format
    return [-len(c[0]["content"]) for c in completions]


@pytest.mark.parametrize(
    "fn,match",
    [
        (raises_on_five, r"'raises_on_five' raised on sample 1: ZeroDivisionError"),
        (wrong_length, r"'wrong_length' returned 1 values for 3 completions"),
        (returns_string, r"'returns_string' returned str 'good' for sample 1"),
        (returns_nan, r"'returns_nan' returned non-finite inf for sample 2"),
        (returns_scalar, r"'returns_scalar' returned float, expected a list"),
        (reads_messages, r"'reads_messages' raised on sample 0: TypeError: string indices must be integers.* \(the "
                         r"completions are plain strings here, since the prompts are: a reward reading "
                         r"completion\[0\]\['content'\] needs chat prompts"),
    ],
)
def test_bad_reward_raises_with_name_and_index(fn, match):
    with pytest.raises(RewardError, match=match):
        RewardComposer([length_reward, fn])(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    "fn,bad",
    [(raises_on_five, [1]), (returns_string, [1]), (returns_nan, [2]), (wrong_length, [0, 1, 2])],
)
def test_on_error_none_warns_counts_and_keeps_the_rest(fn, bad):
    comp = RewardComposer([fn, length_reward], on_error="none")
    with pytest.warns(RuntimeWarning, match=fn.__name__):
        out = comp(PROMPTS, COMPLETIONS)
    col = out.per_function[:, 0]
    assert [i for i in range(3) if math.isnan(col[i])] == bad
    assert out.metrics[f"reward_errors/{fn.__name__}"].item() == len(bad)
    # the other function's rewards are intact, and the total still counts them
    assert out.per_function[:, 1].tolist() == [1.0, 1.0, 1.0]
    assert torch.isfinite(out.total).all()


def test_batch_only_failure_is_reported():
    def fails_on_batches(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("batch too large")
        return [1.0]

    with pytest.raises(RewardError, match="'fails_on_batches' raised on the batch of 3"):
        RewardComposer([fails_on_batches])(PROMPTS, COMPLETIONS)


def test_async_failure_is_located():
    async def bad_async(prompts, completions, **kw):
        if "5" in completions:
            raise ValueError("five")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="'bad_async' raised on sample 1: ValueError: five"):
        RewardComposer([bad_async])(PROMPTS, COMPLETIONS)


def test_constructor_validation():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardComposer([length_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="unknown functions"):
        RewardComposer([length_reward], weights={"nope": 1.0})
    with pytest.raises(ValueError, match="on_error"):
        RewardComposer([length_reward], on_error="ignore")
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3"):
        RewardComposer([length_reward])(PROMPTS, COMPLETIONS, answer=["1", "2"])


def test_duplicate_names_are_made_unique():
    comp = RewardComposer([ExactMatchReward(), ExactMatchReward(strip=False)])
    assert comp.names == ["exact_match", "exact_match_2"]


def test_exact_and_numeric_match():
    assert ExactMatchReward()(PROMPTS, [" 2\n", "4 ", "x"], answer=ANSWERS) == [1.0, 1.0, 0.0]
    assert NumericMatchReward()(PROMPTS, ["so 1,000", "it is 4.0", "none"], answer=[1000, "4", "6"]) == [1.0, 1.0, 0.0]
    assert NumericMatchReward(missing=None)(["p"], ["no digits"], answer=["3"]) == [None]
    assert last_number("a -3.5e2 then 7") == 7.0 and last_number("x") is None
    with pytest.raises(KeyError, match="needs the column 'answer'"):
        ExactMatchReward()(PROMPTS, COMPLETIONS)
    # conversational completions use the last message
    assert ExactMatchReward()(["p"], [[{"role": "assistant", "content": "4"}]], answer=["4"]) == [1.0]


def test_regex_format():
    fn = RegexFormatReward(r"<answer>\d+</answer>", full=True)
    assert fn(["p"] * 2, ["<answer>12</answer>", "12"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RegexFormatReward("(")


def test_soft_overlong_penalty():
    fn = SoftOverlongPenalty(max_completion_length=10, overlong_buffer=4)
    ids = [[0] * n for n in (6, 8, 10, 11)]
    assert fn(["p"] * 4, ["x"] * 4, completion_ids=ids) == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong_buffer"):
        SoftOverlongPenalty(10, 0)


def test_a_row_without_its_reference_answer_is_named_before_training(tmp_path, arithmetic_rows):
    """A row the built-in rewards cannot score (no answer column, ``None``, or no number where one is compared) is
    refused when fit starts, naming the function, the split and the row, not when a batch first draws it (hours in,
    as the reward's own error, whose sample index counts within a batch)."""

    from polopt_lightning.models import build_tiny_model
    from polopt_lightning.rewards.builtin import DigitMatchReward, NumericDistanceReward, PositionMatchReward
    from tests.helpers import make, trainer

    composer = RewardComposer({"exact": ExactMatchReward(), "n": NumericMatchReward(answer_column="solution")})
    composer.check_rows([{"prompt": "p", "answer": "x", "solution": "it is 3"}], "training")  # all good
    for row, message in [({"prompt": "p", "solution": "3"}, "exact (exact_match): training row 1 (counted from 0) "
                                                               "has no 'answer' column"),
                         ({"prompt": "p", "answer": None, "solution": "3"}, "has 'answer' = None"),
                         ({"prompt": "p", "answer": "a", "solution": "none"},
                          "n (numeric_match): training row 1 (counted from 0) has 'solution' = 'none', which holds no "
                          "number")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            composer.check_rows([{"prompt": "p", "answer": "x", "solution": 1}, row], "training")
    for fn in (DigitMatchReward(), PositionMatchReward(), NumericDistanceReward()):  # every built-in with an answer
        assert fn.check_row({"prompt": "p"}) == "has no 'answer' column (answer_column)"
    assert NumericDistanceReward().check_row({"answer": "four"}) and not DigitMatchReward().check_row({"answer": "x"})
    # the drop-in module: refused as fit starts, before any rollout
    train, val = arithmetic_rows
    val = [*val[:3], {k: v for k, v in val[3].items() if k != "answer"}]
    module, dm = make(build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0),
                      (train, val))
    with pytest.raises(ValueError, match=r"reward function exact_match: validation row 3 \(counted from 0\) has no "
                                         r"'answer' column"):
        trainer(tmp_path, 2).fit(module, dm)
    assert module.global_step == 0
