"""Built-in tasks: deterministic prompt sets with reference answers, for runs that need no download."""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .sources import load_rows

log = logging.getLogger(__name__)

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class _TaskRewards:
    """A built-in task's rewards: ``exact_match`` (its accuracy) and a partial-credit term (``partial``) at 0.5."""

    #: builds the partial-credit reward next to the exact match
    partial: Callable[[], Any]

    def rewards(self) -> Any:
        """A :class:`~polopt_lightning.rewards.RewardComposer`: ``exact_match`` (1 for the exact answer, the task's
        accuracy) and the task's partial-credit reward at weight 0.5."""
        from ..rewards import ExactMatchReward, RewardComposer

        partial = type(self).partial()
        return RewardComposer([ExactMatchReward(), partial], weights={"exact_match": 1.0, partial.__name__: 0.5})


def _digit_match() -> Any:
    from ..rewards import DigitMatchReward

    return DigitMatchReward()


@dataclass
class ArithmeticTask(_TaskRewards):
    """Integer arithmetic ``"a+b="`` -> ``"c"``, with disjoint train and validation sets.

    Attributes:
        digits: operands have 1..``digits`` digits (``min_digits`` sets the floor).
        operations: subset of ``+``, ``-``, ``*``.
        train_size: training prompts (capped by how many distinct problems exist).
        val_size: held-out prompts, never in the training set.
        seed: draws the problems and the split; the same seed gives the same sets on every machine.
    """

    digits: int = 2
    operations: list[str] = field(default_factory=lambda: ["+"])
    train_size: int = 4000
    val_size: int = 200
    seed: int = 0
    min_digits: int = 1
    partial = staticmethod(_digit_match)

    def __post_init__(self) -> None:
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"task.operations must be a non-empty subset of {list(OPERATIONS)}, got {self.operations}")
        if not 1 <= self.min_digits <= self.digits:
            raise ValueError(f"task.digits must be >= task.min_digits >= 1, got digits={self.digits}, min_digits={self.min_digits}")
        if self.train_size < 1 or self.val_size < 0:
            raise ValueError(f"task.train_size must be >= 1 and task.val_size >= 0, got {self.train_size}, {self.val_size}")

    def _problems(self) -> list[tuple[int, str, int]]:
        low, high = (0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)), 10**self.digits - 1
        total = (high - low + 1) ** 2 * len(self.operations)
        if self.val_size >= total:
            digits = f"{self.min_digits}..{self.digits}" if self.min_digits < self.digits else self.digits
            raise ValueError(f"task.val_size={self.val_size} takes every one of the {total} distinct problems "
                             f"({digits}-digit operands, operations {self.operations}), leaving none to train on: "
                             "lower task.val_size or widen the task (task.digits)")
        need = self.train_size + self.val_size
        rng = random.Random(self.seed)
        if total <= 4 * need:  # small space: enumerate and shuffle
            problems = [(a, op, b) for op in self.operations for a in range(low, high + 1) for b in range(low, high + 1)]
            rng.shuffle(problems)
            return problems[:need]
        seen: set[tuple[int, str, int]] = set()
        problems = []
        while len(problems) < need:
            p = (rng.randint(low, high), rng.choice(self.operations), rng.randint(low, high))
            if p not in seen:
                seen.add(p)
                problems.append(p)
        return problems

    @staticmethod
    def _row(a: int, op: str, b: int) -> dict[str, str]:
        return {"prompt": f"{a}{op}{b}=", "answer": str(OPERATIONS[op](a, b))}

    def splits(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """``(train, val)`` lists of ``{"prompt", "answer"}`` rows; disjoint by construction."""
        problems = self._problems()
        val = [self._row(*p) for p in problems[: self.val_size]]
        train = [self._row(*p) for p in problems[self.val_size :]]
        return train, val


@dataclass
class ToolArithmeticTask(ArithmeticTask):
    """Addition of numbers too long to add in one's head, with an ``add`` tool (:func:`polopt_lightning.rollout.environments.add`)
    for a multi-turn rollout (``rollout=tools``). Rows as :class:`ArithmeticTask`'s, plus ``demonstration``: what the
    supervised warm start teaches (``warm_start.answer_column=demonstration``): for a share ``tool_share`` of the rows
    the whole tool-using turn sequence, a pythonic call, EOS, the tool's result as the chat template renders a tool
    message, and the answer (``[add(a=12345,b=67890)]<eos>(80235)80235``); for the others the answer alone. The warm
    start thus leaves a policy that calls the tool some of the time; RL rewards the answers, and calling pays.

    Attributes:
        tool_share: the share of demonstrations that call the tool.
        eos: the tokenizer's EOS text (the policy's turn ends with it).
        tool_open, tool_close: how the chat template wraps a tool message (``data.chat_template=plain_tools``).
    """

    digits: int = 5
    min_digits: int = 5
    tool_share: float = 0.5
    eos: str = "<eos>"
    tool_open: str = "("
    tool_close: str = ")"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.operations != ["+"]:
            raise ValueError(f"task.operations: the add tool adds; got {self.operations}")
        if not 0 <= self.tool_share <= 1:
            raise ValueError(f"task.tool_share must be in [0, 1], got {self.tool_share}")

    def splits(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        train, val = super().splits()
        rng = random.Random(self.seed + 1)
        for row in train + val:
            a, b = row["prompt"][:-1].split("+")
            answer = row["answer"]
            call = f"[add(a={a},b={b})]{self.eos}{self.tool_open}{answer}{self.tool_close}{answer}"
            row["demonstration"] = call if rng.random() < self.tool_share else answer
        return train, val


@dataclass
class FileTask:
    """Prompts from JSON-lines files (one object per line: the prompt column plus any columns rewards need).

    Attributes:
        train: training file.
        val: validation file, or ``None``.
    """

    train: str
    val: str | None = None

    def splits(self) -> tuple[list[dict], list[dict]]:
        return load_rows(self.train, "task.train"), load_rows(self.val, "task.val")


def _draw_unique(make: Callable[[random.Random], tuple[str, str]], need: int, seed: int,
                 what: str) -> list[dict[str, str]]:
    """``need`` rows with distinct prompts from ``make(rng)``, the same for a seed on every machine."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    tries = 0
    while len(rows) < need:
        tries += 1
        if tries > 50 * need + 1000:
            raise ValueError(f"{what}: found only {len(rows)} distinct problems for train_size + val_size = {need}; "
                             "lower them or widen the task (longer inputs, a larger alphabet or range)")
        prompt, answer = make(rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer})
    return rows


def _check_sizes(what: str, train_size: int, val_size: int, **lengths: tuple[int, int]) -> None:
    if train_size < 1 or val_size < 0:
        raise ValueError(f"{what}.train_size must be >= 1 and {what}.val_size >= 0, got {train_size}, {val_size}")
    for key, (low, high) in lengths.items():
        if not 1 <= low <= high:
            raise ValueError(f"{what}.{key}: need 1 <= min_{key} <= {key}, got {low} and {high}")


def _check_alphabet(what: str, alphabet: str) -> None:
    if not alphabet or any(c.isspace() or c in "=" for c in alphabet):
        raise ValueError(f"{what}.alphabet must be non-empty, without spaces or '=', got {alphabet!r}")


class _GeneratedTask(_TaskRewards):
    """Shared by the generated tasks: ``problem(rng) -> (prompt, answer)`` drawn until enough distinct prompts."""

    train_size: int
    val_size: int
    seed: int

    def problem(self, rng: random.Random) -> tuple[str, str]:  # pragma: no cover - interface
        raise NotImplementedError

    def splits(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """``(train, val)`` lists of ``{"prompt", "answer"}`` rows; disjoint by construction."""
        rows = _draw_unique(self.problem, self.train_size + self.val_size, self.seed, type(self).__name__)
        return rows[self.val_size:], rows[: self.val_size]


@dataclass
class MultiplicationTask(ArithmeticTask):
    """Integer multiplication ``"12*7="`` -> ``"84"``: :class:`ArithmeticTask` with ``*``, operands of
    ``min_digits``..``digits`` digits. Partial credit: ``digit_match``."""

    operations: list[str] = field(default_factory=lambda: ["*"])
    train_size: int = 2000
    val_size: int = 200


@dataclass
class ExpressionTask(_GeneratedTask):
    """Multi-step integer expressions with parentheses, ``"(3+4)*2="`` -> ``"14"``: ``steps`` operations, each
    applied to the expression so far (parenthesised) and a new operand, on either side.

    Attributes:
        steps: operations per expression (1 gives ``"3+4="``, 2 ``"(3+4)*2="`` or ``"2-(3*4)="``).
        max_operand: operands are 0..``max_operand``.
        operations: subset of ``+``, ``-``, ``*``.
        train_size, val_size, seed: as :class:`ArithmeticTask`.
    """

    steps: int = 2
    max_operand: int = 9
    operations: list[str] = field(default_factory=lambda: ["+", "-", "*"])
    train_size: int = 2000
    val_size: int = 200
    seed: int = 0
    partial = staticmethod(_digit_match)

    def __post_init__(self) -> None:
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"ExpressionTask.operations must be a non-empty subset of {list(OPERATIONS)}, got "
                             f"{self.operations}")
        if self.steps < 1 or self.max_operand < 1:
            raise ValueError(f"ExpressionTask needs steps >= 1 and max_operand >= 1, got {self.steps}, {self.max_operand}")
        _check_sizes("ExpressionTask", self.train_size, self.val_size)

    def problem(self, rng: random.Random) -> tuple[str, str]:
        value = rng.randint(0, self.max_operand)
        text = str(value)
        for step in range(self.steps):
            op, operand = rng.choice(self.operations), rng.randint(0, self.max_operand)
            inner = f"({text})" if step else text
            if rng.random() < 0.5:
                text, value = f"{inner}{op}{operand}", OPERATIONS[op](value, operand)
            else:
                text, value = f"{operand}{op}{inner}", OPERATIONS[op](operand, value)
        return f"{text}=", str(value)


def _item_match() -> Any:
    from ..rewards import PositionMatchReward

    return PositionMatchReward(separator=",", name="item_match")


@dataclass
class SortTask(_GeneratedTask):
    """Sort a list of numbers, ``"sort 3,9,1="`` -> ``"1,3,9"``. Partial credit: ``item_match``, the share of
    positions holding the right number.

    Attributes:
        min_length, length: lists hold ``min_length``..``length`` numbers.
        max_value: numbers are 0..``max_value``.
    """

    length: int = 5
    min_length: int = 3
    max_value: int = 9
    train_size: int = 2000
    val_size: int = 200
    seed: int = 0
    partial = staticmethod(_item_match)

    def __post_init__(self) -> None:
        _check_sizes("SortTask", self.train_size, self.val_size, length=(self.min_length, self.length))
        if self.max_value < 1:
            raise ValueError(f"SortTask.max_value must be >= 1, got {self.max_value}")

    def problem(self, rng: random.Random) -> tuple[str, str]:
        values = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_length, self.length))]
        return f"sort {','.join(map(str, values))}=", ",".join(map(str, sorted(values)))


def _char_match() -> Any:
    from ..rewards import PositionMatchReward

    return PositionMatchReward(name="char_match")


@dataclass
class ReverseTask(_GeneratedTask):
    """Reverse a string, ``"rev abcd="`` -> ``"dcba"``. Partial credit: ``char_match``, the share of positions
    holding the right character.

    Attributes:
        min_length, length: strings of ``min_length``..``length`` characters.
        alphabet: the characters drawn.
    """

    length: int = 6
    min_length: int = 3
    alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    train_size: int = 2000
    val_size: int = 200
    seed: int = 0
    partial = staticmethod(_char_match)

    def __post_init__(self) -> None:
        _check_sizes("ReverseTask", self.train_size, self.val_size, length=(self.min_length, self.length))
        _check_alphabet("ReverseTask", self.alphabet)

    def problem(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_length, self.length)))
        return f"rev {text}=", text[::-1]


def _numeric_distance() -> Any:
    from ..rewards import NumericDistanceReward

    return NumericDistanceReward()


@dataclass
class CountTask(_GeneratedTask):
    """Count a letter in a word, ``"count a abaca="`` -> ``"3"``. Partial credit: ``numeric_distance``
    (``1 - |got - want| / max(want, 1)``, at least 0).

    Attributes:
        min_length, length: words of ``min_length``..``length`` letters.
        alphabet: the letters drawn (a small one makes counts above 1 common).
    """

    length: int = 8
    min_length: int = 4
    alphabet: str = "abcde"
    train_size: int = 2000
    val_size: int = 200
    seed: int = 0
    partial = staticmethod(_numeric_distance)

    def __post_init__(self) -> None:
        _check_sizes("CountTask", self.train_size, self.val_size, length=(self.min_length, self.length))
        _check_alphabet("CountTask", self.alphabet)

    def problem(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_length, self.length)))
        letter = rng.choice(self.alphabet)
        return f"count {letter} {word}=", str(word.count(letter))


@dataclass
class TaskMixture:
    """Several tasks in one run: each row tagged with its task's name in ``column``.

    The training batches draw from the tasks in proportion to their weights (``PromptDataModule`` does it, whole
    groups per prompt; a :class:`~polopt_lightning.callbacks.TaskWeightScheduler` moves the weights during training),
    and validation reports each task's accuracy (``val/<task>/accuracy``) beside the overall one.

    Attributes:
        tasks: name -> a task (anything with ``splits() -> (train, val)``: the built-in tasks, :class:`FileTask`).
        weights: name -> the share of prompts it starts with (normalised; default equal).
        column: the column added to every row with its task's name.
    """

    tasks: Mapping[str, Any]
    weights: Mapping[str, float] | None = None
    column: str = "task"

    def __post_init__(self) -> None:
        self.tasks = dict(self.tasks)
        if not self.tasks:
            raise ValueError("task.tasks is empty: a mixture needs at least one task")
        for name, task in self.tasks.items():
            if not hasattr(task, "splits"):
                raise TypeError(f"task.tasks.{name} is {type(task).__name__}, which has no splits() -> (train, val)")
        weights = {name: 1.0 for name in self.tasks} if self.weights is None else dict(self.weights)
        unknown = sorted(set(weights) - set(self.tasks))
        if unknown:
            raise ValueError(f"task.weights names unknown tasks {unknown}; the tasks: {list(self.tasks)}")
        weights = {name: float(weights.get(name, 1.0)) for name in self.tasks}
        if any(not math.isfinite(w) or w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"task.weights must be finite, >= 0 and not all 0, got {weights}")
        self.weights = {name: w / sum(weights.values()) for name, w in weights.items()}

    @property
    def names(self) -> list[str]:
        return list(self.tasks)

    def splits(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every task's rows, task after task, each with ``column`` set to its task's name."""
        train: list[dict[str, Any]] = []
        val: list[dict[str, Any]] = []
        for name, task in self.tasks.items():
            try:
                task_train, task_val = task.splits()
            except ValueError as e:  # a task names its settings task.<key>: here they are task.tasks.<name>.<key>
                message = re.sub(r"\btask\.(?=\w)", f"task.tasks.{name}.", str(e))
                raise ValueError(message if message != str(e) else f"task.tasks.{name}: {e}") from e
            if not task_train:
                raise ValueError(f"task.tasks.{name} has no training rows")
            if not task_val:
                log.warning("task.tasks.%s has no validation rows: its accuracy (val/%s/accuracy) is not measured, "
                            "val/accuracy and best.ckpt leave it out, and weights=progress cannot weigh it", name,
                            name)
            for part, rows in ((train, task_train), (val, task_val)):
                for i, row in enumerate(rows):
                    if self.column in row and row[self.column] != name:
                        raise ValueError(f"task.tasks.{name}: row {i} already has a column {self.column!r} "
                                         f"({row[self.column]!r}); set task.column to another name")
                    part.append({**row, self.column: name})
        return train, val

    def rewards(self, overrides: Mapping[str, Any] | None = None, accuracy: Mapping[str, str] | None = None) -> Any:
        """:class:`~polopt_lightning.rewards.MixtureRewards` with each task's own rewards (``overrides``: task name ->
        a composer to use instead, e.g. for a :class:`FileTask`, which has no built-in rewards; ``accuracy``: task
        name -> the function whose mean is its accuracy, default its first)."""
        from ..rewards import MixtureRewards

        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.tasks))
        if unknown:
            raise ValueError(f"rewards given for unknown tasks {unknown}; the tasks: {list(self.tasks)}")
        composers = {}
        for name, task in self.tasks.items():
            if name in overrides:
                composers[name] = overrides[name]
            elif hasattr(task, "rewards"):
                composers[name] = task.rewards()
            else:
                raise ValueError(f"task.tasks.{name} ({type(task).__name__}) has no built-in rewards: give it its own "
                                 f"(in the CLI: task.rewards.{name}.functions)")
        return MixtureRewards(composers, accuracy=accuracy, column=self.column)
