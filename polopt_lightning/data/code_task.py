"""A generated programming task for code-execution rewards: small stdin/stdout problems with tests and a reference
solution, for runs that need no download (``task=code``, ``experiment=code``)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from .tasks import _check_sizes, _draw_unique

#: the problem families: an expression of the two integers read, with a constant ``{k}`` drawn per problem
TEMPLATES = ("a+b+{k}", "a*b+{k}", "a-b+{k}", "max(a,b)+{k}", "min(a,b)*{k}", "a*{k}+b", "(a+b)%{k}")


@dataclass
class CodeTask:
    """Write a program that reads two integers and prints an expression of them: the prompt
    ``"# read a b, print a*b+7\\n"``, the tests ``n_tests`` stdin/stdout cases (``{"input": "3 4", "output": "19"}``,
    the ``tests`` column that :class:`~polopt_lightning.rewards.CodeExecutionReward` runs), the reference solution in
    a fenced block (``solution``, what the supervised warm start teaches: ``warm_start.answer_column=solution``), and
    ``tool_demonstration``: the first test's expression tried with the ``python`` tool, then the solution
    (``[python(code='print(3*4+7)')]<eos>(19)```python...``, for ``experiment=code_tool``).

    Attributes:
        n_tests: test cases per problem.
        max_operand: the test inputs are 0..``max_operand``.
        max_constant: the problems' constants are 2..``max_constant``.
        train_size, val_size: prompts (distinct, train and validation disjoint).
        seed: draws the problems and their tests.
        eos: the tokenizer's EOS text (the policy's turn ends with it, in ``tool_demonstration``).
        tool_open, tool_close: how the chat template wraps a tool message (``data.chat_template=plain_tools``).
    """

    n_tests: int = 2
    max_operand: int = 99
    max_constant: int = 99
    train_size: int = 400
    val_size: int = 50
    seed: int = 0
    eos: str = "<eos>"
    tool_open: str = "("
    tool_close: str = ")"

    def __post_init__(self) -> None:
        _check_sizes("CodeTask", self.train_size, self.val_size)
        if self.n_tests < 1 or self.max_operand < 1 or self.max_constant < 2:
            raise ValueError(f"task.n_tests and task.max_operand must be >= 1 and task.max_constant >= 2, got "
                             f"{self.n_tests}, {self.max_operand}, {self.max_constant}")

    def problem(self, rng: random.Random) -> tuple[str, str]:
        return f"# read a b, print {rng.choice(TEMPLATES).format(k=rng.randint(2, self.max_constant))}\n", ""

    def splits(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(train, val)`` rows ``{"prompt", "tests", "solution", "tool_demonstration"}``; disjoint by
        construction."""
        rows = _draw_unique(self.problem, self.train_size + self.val_size, self.seed, "CodeTask")
        rng = random.Random(self.seed + 1)
        out = []
        for row in rows:
            expr = row["prompt"].split("print ", 1)[1].strip()
            tests, tried = [], ""
            for _ in range(self.n_tests):
                a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
                value = str(eval(expr, {"max": max, "min": min}, {"a": a, "b": b}))  # the task's own templates
                tests.append({"input": f"{a} {b}", "output": value})
                filled = re.sub(r"\b[ab]\b", lambda m, a=a, b=b: str(a if m.group() == "a" else b), expr)
                tried = tried or (f"[python(code='print({filled})')]"
                                  f"{self.eos}{self.tool_open}{value}{self.tool_close}")
            solution = f"```python\na,b=map(int,input().split())\nprint({expr})\n```"
            out.append({"prompt": row["prompt"], "tests": tests, "solution": solution,
                        "tool_demonstration": tried + solution})
        return out[self.val_size:], out[: self.val_size]
