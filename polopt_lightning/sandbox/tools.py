"""Tools that run in the sandbox: the ``python`` tool (the model's code, run), and any tool marked :func:`untrusted`
(its module loaded and the function called inside the sandbox, its arguments and result as JSON).

:class:`~polopt_lightning.rollout.tool_runner.ToolRunner` sends such calls to its sandbox (``rollout.sandbox``), with
the call's time limit as the execution's wall time; the trainer waits on them in threads (no fork of the trainer).
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from .core import ExecResult, Sandbox

_CALL = '''import importlib.util, json, sys, types
for name in ("polopt_lightning", "polopt_lightning.sandbox", "polopt_lightning.sandbox.tools"):
    sys.modules[name] = types.ModuleType(name)  # a stand-in: the decorator, without the package (and torch)
sys.modules["polopt_lightning.sandbox.tools"].untrusted = lambda fn: fn
spec = importlib.util.spec_from_file_location({module!r}, {file!r})
module = importlib.util.module_from_spec(spec)
sys.modules[{module!r}] = module
spec.loader.exec_module(module)
fn = getattr(module, {name!r})
fn = getattr(fn, "__wrapped__", fn)
result = fn(**json.loads(sys.stdin.read()))
sys.stdout.write("\\n" + {marker!r} + json.dumps(result))
'''


def untrusted(fn: Callable) -> Callable:
    """Marks a tool as untrusted: its calls run in the sandbox (a fresh interpreter that loads the function's module
    file, calls it with the arguments as JSON and sends its JSON result back), not in the trainer. The function must
    be a top-level function of a module file (not ``__main__``'s, not a closure); the module may import the
    interpreter's installed packages (not ones installed in editable mode: their folders are not shown) and this
    decorator (a stand-in there: ``polopt_lightning`` itself is not loaded); its result must be JSON. Returns ``fn``."""
    _module_file(fn)  # refused now, naming the function, if it cannot be loaded there
    fn.__polopt_untrusted_tool__ = True
    return fn


def _module_file(fn: Callable) -> Path:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is None or file is None or getattr(module, "__name__", "") == "__main__" or "." in qualname or (
            "<" in qualname):
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be marked untrusted: the sandbox loads it from "
                         "its module's file, so it must be a top-level function of an importable module (not "
                         "__main__'s, not a closure or a method)")
    return Path(file)


class ToolOutcome(NamedTuple):
    """What :func:`run_tool` gives: the tool's value (``None`` on an error), the error, and whether it ran past its
    time limit (and was killed)."""

    value: Any
    error: str | None
    timed_out: bool = False


def run_tool(sandbox: Sandbox, fn: Callable, arguments: Mapping[str, Any], timeout: float | None) -> ToolOutcome:
    """``fn(**arguments)`` in ``sandbox`` within ``timeout`` seconds (at most its ``limits.wall_s``): its
    :class:`ToolOutcome`. The :func:`python` tool runs its code directly (its value says how the code ended, a time-out
    too); another tool's module file is loaded in a fresh interpreter."""
    limits = sandbox.limits if timeout is None else replace(sandbox.limits, wall_s=min(timeout, sandbox.limits.wall_s))
    if fn is python or getattr(fn, "__wrapped__", None) is python:
        if set(arguments) != {"code"}:
            return ToolOutcome(None, f"the python tool takes one argument, code; got {sorted(arguments)}")
        result = sandbox.run_python(str(arguments["code"]), limits=limits)
        return ToolOutcome(result.summary() if result.error is None else None, result.error, result.timed_out)
    marker = "<<polopt-result-" + secrets.token_hex(8) + ">>"
    file = _module_file(fn)
    program = _CALL.format(module=fn.__module__, file="tool_module.py", name=fn.__name__, marker=marker)
    try:
        payload = json.dumps(dict(arguments))
    except (TypeError, ValueError) as exc:
        return ToolOutcome(None, f"the arguments of tool {fn.__name__!r} are not JSON: {exc}")
    result = sandbox.run_python(program, files={"tool_module.py": file.read_bytes()}, stdin=payload, limits=limits,
                                packages=True)
    return _tool_value(fn.__name__, result, marker, limits.wall_s)


def _tool_value(name: str, result: ExecResult, marker: str, wall_s: float) -> ToolOutcome:
    if result.timed_out:
        return ToolOutcome(None, f"the tool timed out after {wall_s:g} s", True)
    if result.error is not None:
        return ToolOutcome(None, result.error)
    if result.output_exceeded:
        return ToolOutcome(None, f"tool {name!r} wrote more output than the sandbox allows")
    if result.returncode != 0 or marker not in result.stdout:
        last = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        return ToolOutcome(None, last[0])
    try:
        return ToolOutcome(json.loads(result.stdout.rsplit(marker, 1)[1]), None)
    except json.JSONDecodeError as exc:
        return ToolOutcome(None, f"tool {name!r} returned something that is not JSON: {exc}")


def python(code: str) -> str:
    """Runs a Python program in a sandbox and returns what it prints (and its error, if it fails).

    Args:
        code: the program; print what you want to see.
    """
    raise RuntimeError("the python tool runs in a sandbox: call it through a ToolRunner (rollout=tools), or run "
                       "Sandbox().run_python(code)")


python.__polopt_untrusted_tool__ = True
