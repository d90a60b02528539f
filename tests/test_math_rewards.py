"""Answer checking: the math-verify accuracy reward on hand-written cases (equivalent forms, boxed answers, wrong
answers, text that does not parse, GSM8K references, answer tags), the tag-format reward, and the missing extra."""

import builtins

import pytest

from polopt_lightning.rewards import MathAccuracyReward, TagFormatReward

from .helpers import run_if


@run_if("math_verify")
@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is $\\frac{1}{2}$.", "0.5", 1.0),           # equivalent fraction and decimal
    ("So we get \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # unreduced fraction, boxed
    ("First 3, then \\boxed{7}. Later I wrote 9.", "7", 1.0),  # the boxed answer wins over later numbers
    ("\\boxed{8}", "7", 0.0),                                  # wrong
    ("I do not know.", "7", 0.0),                              # nothing that parses
    ("so in all she has 72 clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K reference
    ("$x = 2\\sqrt{2}$", "\\sqrt{8}", 1.0),                   # symbolic equality
    ("First $3$, then $\\frac{6}{12}$", "0.5", 1.0),             # the last LaTeX answer
])
def test_math_accuracy_compares_answers_as_mathematics(completion, answer, expected):
    reward = MathAccuracyReward()
    assert reward(["q"], [completion], answer=[answer]) == [expected]


@run_if("math_verify")
def test_math_accuracy_reads_the_answer_tag_and_chat_completions():
    reward = MathAccuracyReward(answer_tag="answer")
    chat = [{"role": "assistant", "content": "<think>6*7 is 42, not 41</think><answer>42</answer>"}]
    assert reward([[{"role": "user", "content": "6*7?"}]], [chat], answer=["42"]) == [1.0]
    assert reward(["q"], ["<think>it is 42</think> 42"], answer=["42"]) == [0.0]  # no answer tag: nothing read
    strict = MathAccuracyReward(plain_numbers=False)  # TRL's accuracy_reward: only boxed/LaTeX/anchored answers
    assert strict(["q"], ["so 42"], answer=["42"]) == [0.0] and strict(["q"], ["\\boxed{42}"], answer=["42"]) == [1.0]


@run_if("math_verify")
def test_an_unparsable_reference_leaves_the_sample_out_with_a_warning():
    reward = MathAccuracyReward()
    with pytest.warns(RuntimeWarning, match=r"math_accuracy: the reference answer 'no answer here' of sample 1"):
        assert reward(["q", "q"], ["3", "3"], answer=["3", "no answer here"]) == [1.0, None]
    with pytest.raises(KeyError, match="math_accuracy needs the column 'solution'"):
        MathAccuracyReward(answer_column="solution")(["q"], ["3"], answer=["3"])


def test_without_math_verify_the_reward_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify" or name.startswith("math_verify."):
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ImportError, match=r"needs math-verify: pip install 'polopt-lightning\[math\]'"):
        MathAccuracyReward()


@pytest.mark.parametrize("completion, expected", [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("  <think>\nlong\nthought\n</think>\n<answer> 42 </answer>\n", 1.0),
    ("<answer>b</answer><think>a</think>", 0.0),                          # wrong order
    ("<think>a</think><answer>b</answer> and more", 0.0),                # text after the last block
    ("<think>a<think>b</think><answer>c</answer>", 0.0),                 # a nested block
    ("<think>a</think>", 0.0),                                           # no answer
])
def test_tag_format_reward(completion, expected):
    assert TagFormatReward()(["q"], [completion]) == [expected]
    assert TagFormatReward(reward=0.5)(["q"], [[{"role": "assistant", "content": completion}]]) == [expected * 0.5]


def test_think_format_with_trailing_text_and_bad_tags():
    think = TagFormatReward(tags=["think"], trailing=True, name="think_format")
    assert think(["q"], ["<think>x</think> the answer is 4", "no think"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"format: tags must be non-empty names"):
        TagFormatReward(tags=["th ink"])
