"""Built-in reward functions for verifiable tasks. Each is a small configurable callable (Hydra can build it) that
follows TRL's convention ``fn(prompts, completions, **columns) -> list[float | None]``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _column(columns: dict[str, Any], key: str, fn_name: str) -> Sequence[Any]:
    if key not in columns:
        raise KeyError(f"{fn_name} needs the column {key!r}; the batch has {sorted(columns)}")
    return columns[key]


def reference_number(answer: Any) -> float | None:
    """A reference answer as the number the numeric rewards compare: itself where it is one, else the last number its
    text holds (``None`` where it holds none)."""
    return answer if isinstance(answer, (int, float)) else last_number(str(answer))


class _AnswerColumn:
    """A reward that reads each sample's reference answer from ``answer_column`` (a number where ``NUMERIC``)."""

    NUMERIC = False
    answer_column: str

    def check_row(self, row: dict[str, Any]) -> str | None:
        """What is wrong with ``row`` for this reward (its answer missing, ``None``, or holding no number where one
        is needed), else ``None``: checked on every row before training (:meth:`RewardComposer.check_rows`)."""
        col = self.answer_column
        if col not in row:
            return f"has no {col!r} column (answer_column)"
        value = row[col]
        if value is None:
            return f"has {col!r} = None"
        if self.NUMERIC and reference_number(value) is None:
            return f"has {col!r} = {value!r}, which holds no number"
        return None


def _text(completion: Any) -> str:
    """Completion text; conversational completions (a list of messages) use the last message's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas in thousands ignored), or ``None``."""
    matches = _NUMBER.findall(text.replace(",", ""))
    if not matches:
        return None
    try:
        return float(matches[-1])
    except ValueError:
        return None


class ExactMatchReward(_AnswerColumn):
    """1.0 when the completion equals the reference answer, else 0.0.

    Args:
        answer_column: dataset column with the reference answer.
        strip: compare after stripping surrounding white space.
        case_sensitive: compare letter case.
    """

    def __init__(self, answer_column: str = "answer", strip: bool = True, case_sensitive: bool = True) -> None:
        self.answer_column, self.strip, self.case_sensitive = answer_column, strip, case_sensitive
        self.__name__ = "exact_match"

    def _norm(self, s: str) -> str:
        s = s.strip() if self.strip else s
        return s if self.case_sensitive else s.lower()

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
        answers = _column(columns, self.answer_column, self.__name__)
        return [float(self._norm(_text(c)) == self._norm(str(a))) for c, a in zip(completions, answers)]


class NumericMatchReward(_AnswerColumn):
    """1.0 when the last number in the completion equals the reference answer within ``tolerance``.

    Args:
        answer_column: dataset column with the reference answer (a number or a string holding one).
        tolerance: absolute tolerance.
        missing: reward when the completion holds no number (0.0; ``None`` to leave the sample out).
    """

    NUMERIC = True

    def __init__(self, answer_column: str = "answer", tolerance: float = 1e-6, missing: float | None = 0.0) -> None:
        self.answer_column, self.tolerance, self.missing = answer_column, tolerance, missing
        self.__name__ = "numeric_match"

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
        answers = _column(columns, self.answer_column, self.__name__)
        out: list[float | None] = []
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            target = reference_number(answer)
            if target is None:
                raise ValueError(f"{self.__name__}: reference answer {answer!r} of sample {i} holds no number")
            got = last_number(_text(completion))
            out.append(self.missing if got is None else float(abs(got - float(target)) <= self.tolerance))
        return out


class PositionMatchReward(_AnswerColumn):
    """Partial credit: the share of positions where the completion and the reference answer agree, over the longer
    of the two. Positions are characters, or items when ``separator`` is set (``"1,3,5"`` has three), aligned from
    the left or from the right (units under units). A near miss scores above a wild guess, so groups where no sample
    is exactly right still carry signal.

    Args:
        answer_column: dataset column with the reference answer.
        align: ``"left"`` (a reversed string, a sorted list) or ``"right"`` (numbers).
        separator: split both into items at this string (e.g. ``","``); ``None`` compares characters.
        name: name the reward is logged under.
    """

    def __init__(self, answer_column: str = "answer", align: str = "left", separator: str | None = None,
                 name: str = "position_match") -> None:
        if align not in ("left", "right"):
            raise ValueError(f"{name}: align must be 'left' or 'right', got {align!r}")
        if separator == "":
            raise ValueError(f"{name}: separator must be a non-empty string or None")
        self.answer_column, self.align, self.separator = answer_column, align, separator
        self.__name__ = name

    def _units(self, text: str) -> list[str]:
        text = text.strip()
        units = [u.strip() for u in text.split(self.separator)] if self.separator else list(text)
        return units[::-1] if self.align == "right" else units

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
        answers = _column(columns, self.answer_column, self.__name__)
        out = []
        for completion, answer in zip(completions, answers):
            got, want = self._units(_text(completion)), self._units(str(answer))
            width = max(len(got), len(want), 1)
            out.append(sum(a == b for a, b in zip(got, want)) / width)
        return out


class DigitMatchReward(PositionMatchReward):
    """Partial credit for numbers: the share of characters that match the reference answer, aligned from the right
    (units under units), over the longer of the two (:class:`PositionMatchReward` with ``align="right"``).

    Args:
        answer_column: dataset column with the reference answer.
    """

    def __init__(self, answer_column: str = "answer") -> None:
        super().__init__(answer_column, align="right", name="digit_match")


class NumericDistanceReward(_AnswerColumn):
    """Partial credit for a count or a small number: ``max(0, 1 - |got - want| / max(|want|, 1))``, with ``got`` the
    last number in the completion (0 when it holds none). An answer one off a count of 4 scores 0.75.

    Args:
        answer_column: dataset column with the reference answer.
    """

    NUMERIC = True

    def __init__(self, answer_column: str = "answer") -> None:
        self.answer_column = answer_column
        self.__name__ = "numeric_distance"

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
        answers = _column(columns, self.answer_column, self.__name__)
        out = []
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            want = reference_number(answer)
            if want is None:
                raise ValueError(f"{self.__name__}: reference answer {answer!r} of sample {i} holds no number")
            got = last_number(_text(completion))
            out.append(0.0 if got is None else max(0.0, 1.0 - abs(got - float(want)) / max(abs(float(want)), 1.0)))
        return out


class RegexFormatReward:
    """``reward`` when the completion matches ``pattern`` (``re.search``, or ``re.fullmatch`` if ``full``).

    Args:
        pattern: regular expression.
        full: require the whole (stripped) completion to match.
        reward: value on a match; 0.0 otherwise.
        name: name the reward is logged under.
    """

    def __init__(self, pattern: str, full: bool = False, reward: float = 1.0, name: str = "format") -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"RegexFormatReward pattern {pattern!r} is not a valid regular expression: {exc}") from exc
        self.full, self.reward = full, float(reward)
        self.__name__ = name

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
        match = self.regex.fullmatch if self.full else self.regex.search
        return [self.reward if match(_text(c).strip() if self.full else _text(c)) else 0.0 for c in completions]


class SoftOverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With ``L = max_completion_length`` and buffer ``C = overlong_buffer``: 0 for ``|y| <= L - C``,
    ``(L - C - |y|) / C`` in between (falls linearly to -1), and -1 beyond ``L``; times ``penalty_factor``.
    ``|y|`` is the token count from the ``completion_ids`` column the trainer passes (the character count when
    called without it).
    """

    def __init__(self, max_completion_length: int, overlong_buffer: int, penalty_factor: float = 1.0) -> None:
        if not 0 < overlong_buffer <= max_completion_length:
            raise ValueError(
                f"overlong_buffer must be in (0, max_completion_length={max_completion_length}], got {overlong_buffer}"
            )
        self.max_completion_length, self.overlong_buffer = int(max_completion_length), int(overlong_buffer)
        self.penalty_factor = float(penalty_factor)
        self.__name__ = "overlong_penalty"

    def __call__(self, prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
        ids = columns.get("completion_ids")
        lengths = [len(x) for x in ids] if ids is not None else [len(_text(c)) for c in completions]
        expected = self.max_completion_length - self.overlong_buffer
        out = []
        for length in lengths:
            if length <= expected:
                out.append(0.0)
            elif length <= self.max_completion_length:
                out.append(self.penalty_factor * (expected - length) / self.overlong_buffer)
            else:
                out.append(-self.penalty_factor)
        return out
