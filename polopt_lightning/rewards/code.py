"""Code-execution reward: the completion's last fenced code block run in the sandbox against the row's tests (as TRL's
and open-r1's code rewards), the fraction that pass."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ..sandbox import ExecResult, Sandbox, sandbox_from_config
from .builtin import _column, _text

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, language: str | None = "python") -> str | None:
    """The last fenced code block of ``text`` (```python ... ```, or a fence naming no language), ``None`` when there
    is none. ``language=None`` takes a block of any language."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    wanted = ({"", language.lower()} | ({"py", "python3", "py3"} if language.lower() == "python" else set())
              if language else None)
    picked = [body for lang, body in blocks if wanted is None or lang in wanted]
    return picked[-1] if picked else None


def _text_of(value: Any) -> str:
    """A test's input or output as text: a list (lines, as APPS and TACO store some) joined by newlines."""
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)


def _case(t: Mapping[str, Any]) -> dict[str, str]:
    kind = t.get("type", t.get("testtype", "stdin_stdout"))
    if kind not in ("stdin_stdout", "stdin"):
        raise ValueError(f"a test of type {kind!r} is not run here (only stdin/stdout cases and assert statements)")
    return {"input": _text_of(t["input"]), "output": _text_of(t["output"])}


def _asserts(code: str) -> list[str]:
    """Python test code as tests: each top-level ``assert`` one test, after the code's other statements (imports,
    helper definitions); code without an assert is one test (HumanEval's ``check(candidate)``)."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise ValueError(f"the tests are neither JSON nor Python: {exc}") from None
    lines = code.splitlines()
    first = (lambda node: min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]))
    chunks = [("\n".join(lines[first(node) - 1:node.end_lineno]), isinstance(node, ast.Assert)) for node in tree.body]
    prelude = "\n".join(text for text, is_assert in chunks if not is_assert)
    tests = [f"{prelude}\n{text}".strip("\n") for text, is_assert in chunks if is_assert]
    if tests:
        return tests
    if not any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) for node in tree.body):
        # HumanEval's `test` defines check() without calling it: run as it is, any program would pass
        raise ValueError("the test code asserts nothing and calls nothing at its top level (HumanEval's test "
                         "defines check: append check(<the function's name>))")
    return [code]


def parse_tests(value: Any) -> list[dict[str, str] | str]:
    """A row's tests as a list, each a stdin/stdout case ``{"input": ..., "output": ...}`` or Python test code (an
    ``assert``, after the test code's imports and helpers). Accepted: such a list; open-r1's ``verification_info`` (a
    mapping with ``test_cases``, or with ``inputs`` and ``outputs`` lists, lists of lines joined); any of these as a
    JSON string; a string of Python test code. What cannot be read, or holds no test, raises a ValueError."""
    tests = _parse(value)
    if not tests:
        raise ValueError("no tests")
    return tests


def _parse(value: Any) -> list[dict[str, str] | str]:
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in "[{":
            try:
                return _parse(json.loads(stripped))
            except json.JSONDecodeError as exc:
                raise ValueError(f"the tests look like JSON but are not: {exc}") from None
        return _asserts(value)
    if isinstance(value, Mapping):
        if "test_cases" in value:
            return _parse(value["test_cases"])
        if "inputs" in value and "outputs" in value:
            if len(value["inputs"]) != len(value["outputs"]):
                raise ValueError(f"{len(value['inputs'])} inputs for {len(value['outputs'])} outputs")
            return [{"input": _text_of(i), "output": _text_of(o)} for i, o in zip(value["inputs"], value["outputs"])]
        if "input" in value and "output" in value:
            return [_case(value)]
        raise ValueError(f"a test mapping needs test_cases, inputs/outputs or input/output; got keys {sorted(value)}")
    if isinstance(value, Sequence):
        tests: list[dict[str, str] | str] = []
        for t in value:
            if isinstance(t, str):
                tests.extend(_asserts(t))
            elif isinstance(t, Mapping) and "input" in t and "output" in t:
                tests.append(_case(t))
            else:
                raise ValueError(f"a test must be Python test code or an input/output mapping, got {t!r}")
        return tests
    raise ValueError(f"cannot read tests from a {type(value).__name__}: {value!r}")


def _same_output(got: str, expected: str) -> bool:
    """Outputs compared line by line, trailing white space and trailing empty lines ignored."""
    norm = (lambda s: [line.rstrip() for line in s.strip("\n").rstrip().splitlines()])
    return norm(got) == norm(expected)


class CodeExecutionReward:
    """The fraction of a row's tests the completion's code passes, run in a :class:`~polopt_lightning.sandbox.Sandbox`
    (never in this process): the last fenced code block of the completion (``extract_code``), 0 without one.

    A stdin/stdout test runs the code with the input and passes when its output equals the expected one (line by line,
    trailing white space ignored). An assert test runs the code followed by the statement and passes when the program
    exits 0 after printing a random marker placed after the statement (so ``sys.exit(0)`` before it is no pass). Each
    test is one execution; a completion's tests, and the batch's completions, run through the sandbox's pool at once.

    Args:
        tests_column: the dataset column with each row's tests (:func:`parse_tests` reads its forms).
        sandbox: a :class:`~polopt_lightning.sandbox.Sandbox`, or its settings (``conf/sandbox``: limits, isolation).
        language: the fenced block's language (only ``python`` runs).
        partial: the fraction passed; ``False``: 1 only when every test passes.
    """

    def __init__(self, tests_column: str = "tests", sandbox: Sandbox | Mapping[str, Any] | None = None,
                 language: str = "python", partial: bool = True) -> None:
        if language != "python":
            raise ValueError(f"CodeExecutionReward runs python code; language={language!r} is not supported")
        self.tests_column, self.language, self.partial = tests_column, language, partial
        self.sandbox = sandbox_from_config(sandbox)
        self.last_results: list[list[ExecResult]] = []  # the last call's executions, per completion
        self.__name__ = "code_execution"

    def _job(self, code: str, test: dict[str, str] | str):
        if isinstance(test, str):
            marker = secrets.token_hex(8)
            program = f"{code}\n\n{test}\nprint({marker!r})\n"
            check = (lambda r: r.ok and r.stdout.rstrip().endswith(marker))
            return (lambda sb: sb.run_python(program)), check
        return (lambda sb: sb.run_python(code, stdin=test["input"])), (
            lambda r: r.ok and _same_output(r.stdout, test["output"]))

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        rows = _column(columns, self.tests_column, self.__name__)
        jobs, checks, owner = [], [], []
        counts = []
        for i, (completion, value) in enumerate(zip(completions, rows, strict=True)):
            try:
                tests = parse_tests(value)
            except ValueError as exc:
                raise ValueError(f"{self.__name__}: the {self.tests_column!r} column of sample {i}: {exc}") from None
            code = extract_code(_text(completion), self.language)
            counts.append(len(tests))
            if code is None:
                continue
            for test in tests:
                job, check = self._job(code, test)
                jobs.append(job)
                checks.append(check)
                owner.append(i)
        results = self.sandbox.map(jobs)
        passed = [0] * len(completions)
        self.last_results = [[] for _ in completions]
        for i, check, result in zip(owner, checks, results):
            passed[i] += int(check(result))
            self.last_results[i].append(result)
        return [0.0 if n == 0 else (p / n if self.partial else float(p == n)) for p, n in zip(passed, counts)]
