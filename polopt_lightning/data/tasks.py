"""Built-in tasks: deterministic prompt sets with reference answers, for runs that need no download."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class ArithmeticTask:
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
class FileTask:
    """Prompts from JSON-lines files (one object per line: the prompt column plus any columns rewards need).

    Attributes:
        train: training file.
        val: validation file, or ``None``.
    """

    train: str
    val: str | None = None

    def splits(self) -> tuple[list[dict], list[dict]]:
        from .datamodule import _load_rows

        return _load_rows(self.train, "task.train"), _load_rows(self.val, "task.val")
