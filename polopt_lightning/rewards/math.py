"""Answer checking for mathematics: :class:`MathAccuracyReward` compares final answers as mathematical objects
(``math-verify``: LaTeX, ``\\boxed{}``, fractions, percentages, plain numbers), and :class:`TagFormatReward` rewards the
``<think>...</think><answer>...</answer>`` layout reasoning recipes ask for."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from .builtin import _column, _text

MATH_INSTALL = "needs math-verify: pip install 'polopt-lightning[math]'"


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(f"MathAccuracyReward (reward=math) {MATH_INSTALL}") from exc
    return math_verify


class MathAccuracyReward:
    """1.0 when the completion's final answer equals the reference answer as mathematics (``\\frac{1}{2}``, ``0.5``
    and ``1/2`` agree; ``\\boxed{}`` answers first), else 0.0, also when the completion holds no answer that parses.
    A reference answer that does not parse gives ``None`` (the sample is left out of the reward, as in TRL) with a
    warning naming it.

    Args:
        answer_column: dataset column with the reference answer; GSM8K's ``"... #### 72"`` is read after ``####``.
        answer_tag: read only the inside of the completion's last ``<answer_tag>...</answer_tag>`` (0.0 without one);
            ``None``: the whole completion.
        plain_numbers: also take a final answer written without ``\\boxed{}`` or an anchor ("... so 72", the last
            ``$...$``); ``False``: only ``\\boxed{}`` or "the answer is" answers count (TRL's ``accuracy_reward``).
        timeout_seconds: the longest a single parse or comparison may take (``math-verify``'s timer, main thread only).
        name: the name it is logged under.
    """

    def __init__(self, answer_column: str = "answer", answer_tag: str | None = None, plain_numbers: bool = True,
                 timeout_seconds: int = 5, name: str = "math_accuracy") -> None:
        self.mv = _math_verify()
        self.answer_column, self.answer_tag, self.plain_numbers = answer_column, answer_tag, plain_numbers
        self.timeout_seconds = timeout_seconds
        self.__name__ = name
        self._tag = re.compile(rf"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", re.DOTALL) \
            if answer_tag else None
        self._warned: set[str] = set()

    def _timeout(self) -> int | None:
        """math-verify times itself with a signal: only possible on the main thread."""
        return self.timeout_seconds if threading.current_thread() is threading.main_thread() else None

    def reference(self, answer: Any) -> list[Any]:
        text = str(answer)
        if "####" in text:  # GSM8K: the reasoning, then "#### <answer>"
            text = text.rsplit("####", 1)[1].strip()
        mv = self.mv
        targets = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        parsed = mv.parse(text, extraction_config=targets, extraction_mode="first_match",
                          parsing_timeout=self._timeout())
        if not parsed and "\\" in text and "$" not in text:  # bare LaTeX ("\frac{1}{2}"): one math expression
            parsed = mv.parse(f"${text}$", extraction_config=targets, extraction_mode="first_match",
                              parsing_timeout=self._timeout())
        return parsed

    def prediction(self, completion: Any) -> list[Any]:
        text = _text(completion)
        if self._tag is not None:
            found = self._tag.findall(text)
            if not found:
                return []
            text = found[-1]
        mv = self.mv
        latex = mv.LatexExtractionConfig(
            normalization_config=mv.LatexNormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                             boxed="all", units=True),
            boxed_match_priority=0, try_extract_without_anchor=self._tag is not None or self.plain_numbers)
        targets = [latex, mv.ExprExtractionConfig()] if self.plain_numbers else [latex]
        return mv.parse(text, extraction_config=targets, extraction_mode="first_match",
                        parsing_timeout=self._timeout())

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        import warnings

        answers = _column(columns, self.answer_column, self.__name__)
        out: list[float | None] = []
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            gold = self.reference(answer)
            if not gold:
                if str(answer) not in self._warned:
                    self._warned.add(str(answer))
                    warnings.warn(f"{self.__name__}: the reference answer {str(answer)[:80]!r} of sample {i} does not "
                                  "parse as mathematics; the sample's reward is None", RuntimeWarning, stacklevel=2)
                out.append(None)
                continue
            predicted = self.prediction(completion)
            out.append(float(bool(predicted) and self.mv.verify(gold, predicted, timeout_seconds=self._timeout())))
        return out


class TagFormatReward:
    """``reward`` when the completion is laid out in the given tags, in order, each once, with only white space
    between them: by default ``<think>...</think><answer>...</answer>`` (DeepSeek-R1's format); else 0.0.

    Args:
        tags: the blocks, in order (``["think"]`` with ``trailing=True`` is TRL's ``think_format_reward``).
        trailing: allow any text after the last block.
        reward: value on a match.
        name: the name it is logged under.
    """

    def __init__(self, tags: Sequence[str] = ("think", "answer"), trailing: bool = False, reward: float = 1.0,
                 name: str = "format") -> None:
        if not tags or any(not t or not re.fullmatch(r"[\w-]+", t) for t in tags):
            raise ValueError(f"{name}: tags must be non-empty names of letters, digits, '_' or '-', got {list(tags)}")
        blocks = [rf"<{t}>(?:(?!<{t}>|</{t}>).)*</{t}>" for t in tags]
        self.regex = re.compile(r"\s*" + r"\s*".join(blocks) + (r".*" if trailing else r"\s*"), re.DOTALL)
        self.reward = float(reward)
        self.__name__ = name

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return [self.reward if self.regex.fullmatch(_text(c)) else 0.0 for c in completions]
