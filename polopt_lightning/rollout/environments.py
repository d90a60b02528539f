"""Built-in tools and environments for multi-turn rollouts (:mod:`polopt_lightning.rollout.multi_turn`), and the reward
that passes an environment's own rewards on.

- :func:`add` and :func:`calculator`: tools that add two integers, or evaluate an arithmetic expression, exactly
  (integers of any length), for tasks whose numbers are too long to add in one's head
  (:class:`~polopt_lightning.data.ToolArithmeticTask`). Both are bounded pure Python, marked
  :func:`~polopt_lightning.rollout.tool_runner.trusted`: their calls run in the trainer's threads, not in a forked
  process each.
- :class:`GuessingGame`: an environment that is not a tool: the model guesses a number and is told "higher", "lower"
  or "correct", rewarded for finding it in few turns.
- :func:`environment_reward`: the episode's summed environment rewards (the ``env_reward`` column), as a reward
  function.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping
from typing import Any

from .multi_turn import Environment, EnvStep
from .tool_runner import trusted

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod}
_MAX_DIGITS = 200  # a result longer than this is refused (a tool must not be made to build huge numbers)


@trusted
def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return int(a) + int(b)


@trusted
def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression exactly.

    Args:
        expression: integers with +, -, *, // and % and parentheses, e.g. "123456789+987654321".
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(result))) > _MAX_DIGITS:
                raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
            return result
        raise ValueError(f"not an integer arithmetic expression: {expression!r}")

    return str(value(ast.parse(expression.strip(), mode="eval").body))


class GuessingGame(Environment):
    """Guess a number: the secret is the row's ``answer`` column (an integer); each message's last integer is a guess,
    answered "higher", "lower" or "correct". The reward is 1 for finding it, less ``penalty`` per extra guess, 0 if
    never found; a message without a number ends the episode.

    Args:
        penalty: taken off the reward for each guess after the first.
        column: the row's column holding the secret.
    """

    def __init__(self, penalty: float = 0.1, column: str = "answer") -> None:
        self.penalty, self.column = penalty, column
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, row: Mapping[str, Any]) -> str | None:
        if self.column not in row:
            raise KeyError(f"GuessingGame: the row has no {self.column!r} column (its columns: {sorted(row)})")
        self.secret, self.guesses = int(row[self.column]), 0
        return None

    def step(self, message: str) -> EnvStep:
        numbers = re.findall(r"-?\d+", message)
        if not numbers:
            return EnvStep(reward=0.0, done=True)
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            return EnvStep(observation="correct", reward=max(1.0 - self.penalty * (self.guesses - 1), 0.0), done=True)
        return EnvStep(observation="higher" if guess < self.secret else "lower")


def environment_reward(prompts, completions, env_reward=None, **kwargs) -> list[float | None]:
    """The episode's summed environment rewards (``env_reward``, given by a multi-turn rollout); None without one."""
    if env_reward is None:
        return [None] * len(completions)
    return [float(r) for r in env_reward]
