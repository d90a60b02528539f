"""Tool calls run concurrently, each with its time limit, and a call past it killed: the runner multi-turn rollouts call
their tools with (:mod:`~polopt_lightning.rollout.multi_turn`), and what a sandbox with resource limits can build on.

:class:`ToolRunner` takes a list of :class:`ToolCall` (a function, its arguments, a time limit) and returns one
:class:`ToolResult` per call, in the calls' order (a value, an error, or a timeout), running at most ``max_workers``
calls at once; a call's time limit counts from its own start, not from the batch's.

- ``process`` (the default): each call runs in a child process forked from this one (``os.fork``, POSIX only), in a
  process group of its own. The child inherits the function, so closures and locally defined tools need no pickling;
  its result comes back pickled through a pipe (a result that does not pickle becomes an error naming the tool). A
  call past its limit is killed with its process group (SIGKILL), and so is whatever a call leaves running in its
  group when it ends; a process a tool detaches into a session of its own (``setsid``) is out of reach.
- ``thread``: each call runs in a daemon thread of this process: tools may use torch or CUDA and share this
  process's state, but a call past its limit is only abandoned: Python cannot stop a thread, so it keeps running
  (tools that may hang must bound their own work).

A fork costs the trainer time that grows with its resident memory (tens to hundreds of milliseconds: docs/
multi_turn.md); a tool marked :func:`trusted` (pure Python that returns promptly) runs in a thread under either
runner.

A forked child is a copy of the trainer at the fork, with only the forking thread: it must not use torch (or anything
else that runs on thread pools or CUDA: GNU OpenMP's workers and CUDA contexts do not survive a fork, a torch
operation there can hang or fail), nor rely on locks other threads may have held. Plain Python, subprocesses and I/O
are fine; a tool that needs torch needs the ``thread`` runner, or a fresh interpreter it starts itself. Python's
``random`` is reseeded in each child (as after any fork); stdin is ``/dev/null``, stdout and stderr are the trainer's.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import selectors
import signal
import struct
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..sandbox.core import available_cpus, sandbox_from_config
from ..sandbox.tools import run_tool

#: how tool calls run: ``process`` (forked children, killed at their limit) or ``thread`` (daemon threads, abandoned)
TOOL_RUNNERS = ("process", "thread")

_LENGTH = struct.Struct("<Q")  # the pickled result's length, before it on the pipe


def trusted(fn: Callable) -> Callable:
    """Marks a tool as trusted: pure Python that returns promptly and cannot hang (the built-in ``add`` and
    ``calculator``). The ``process`` runner runs its calls in threads of this process rather than forking it, which
    costs more than such a call (tens of milliseconds, growing with the trainer's memory: docs/multi_turn.md); its
    time limit still answers for it, but cannot stop it. Returns ``fn`` itself."""
    fn.__polopt_trusted_tool__ = True
    return fn


def is_trusted(fn: Callable) -> bool:
    """Whether ``fn`` is marked :func:`trusted`."""
    return bool(getattr(fn, "__polopt_trusted_tool__", False))


@dataclass
class ToolCall:
    """One call: ``fn(**arguments)``, for at most ``timeout`` seconds (``None``: no limit); ``name`` names it in
    errors (default: the function's ``__name__``)."""

    fn: Callable[..., Any]
    arguments: Mapping[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or getattr(self.fn, "__name__", repr(self.fn))


@dataclass
class ToolResult:
    """What a call gave: its ``value``, or an ``error`` (the exception as ``"Type: message"``, or what went wrong
    around the call); ``timed_out`` when it ran past its limit (and was killed, by the process runner); ``seconds``
    it ran."""

    name: str
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def _timed_out(call: ToolCall, seconds: float) -> ToolResult:
    return ToolResult(call.name, error=f"the tool timed out after {call.timeout:g} s", timed_out=True,
                      seconds=seconds)


class ToolRunner:
    """Runs a batch of tool calls concurrently (module docstring: the ``process`` and ``thread`` runners).

    Args:
        mode: ``"process"`` (a forked child per call, killed past its limit; POSIX) or ``"thread"``.
        max_workers: calls running at once at most (``None``: :func:`available_cpus`, since a time limit is wall
            time and a CPU-bound call sharing a core with others would time out early; raise it for tools that wait
            on I/O). The others wait their turn, and their time limit starts when they do.
    """

    def __init__(self, mode: str = "process", max_workers: int | None = None, sandbox: Any = None) -> None:
        if mode not in TOOL_RUNNERS:
            raise ValueError(f"rollout.tool_runner must be one of {list(TOOL_RUNNERS)}, got {mode!r}")
        if mode == "process" and not hasattr(os, "fork"):
            raise ValueError("rollout.tool_runner=process forks a process per tool call (os.fork, POSIX), which this "
                             "platform lacks: use rollout.tool_runner=thread")
        if max_workers is not None and (not isinstance(max_workers, int) or isinstance(max_workers, bool)
                                        or max_workers < 1):
            raise ValueError(f"rollout.tool_workers must be an integer >= 1 or null, got {max_workers!r}")
        self.mode = mode
        self.max_workers = max_workers if max_workers is not None else available_cpus()
        self._sandbox = sandbox  # a Sandbox, its settings, or None (the defaults), built at the first untrusted call

    @property
    def sandbox(self) -> Any:
        """The :class:`~polopt_lightning.sandbox.Sandbox` untrusted tools run in (built from its settings when first
        asked: where code cannot be isolated, this raises and names what is missing)."""
        self._sandbox = sandbox_from_config(self._sandbox)
        return self._sandbox

    def __repr__(self) -> str:
        return f"ToolRunner(mode={self.mode!r}, max_workers={self.max_workers})"

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Every call run, at most ``max_workers`` at once; their results in the calls' order. Returns when each call
        has ended, failed or run past its limit. No forked call outlives it (its process, and its group, are killed
        and reaped, even when this is interrupted); a thread's call past its limit runs on."""
        calls = list(calls)
        boxed = [i for i, c in enumerate(calls) if is_untrusted(c.fn)]
        if boxed:  # untrusted tools' calls in the sandbox (its pool), alongside the others
            results = dict(zip(boxed, _run_sandboxed([calls[i] for i in boxed], self.sandbox)))
            rest = [i for i in range(len(calls)) if i not in results]
            results.update(zip(rest, self.run([calls[i] for i in rest])))
            return [results[i] for i in range(len(calls))]
        if self.mode == "thread" or all(is_trusted(c.fn) for c in calls):
            return _run_threads(calls, self.max_workers) if calls else []
        forked = [i for i, c in enumerate(calls) if not is_trusted(c.fn)]
        if len(forked) == len(calls):
            return _run_processes(calls, self.max_workers)
        # trusted tools' calls in threads, alongside the forked calls (they return at once: no slot of max_workers)
        inline = [i for i, c in enumerate(calls) if is_trusted(c.fn)]
        threaded: list[ToolResult] = []
        helper = threading.Thread(target=lambda: threaded.extend(_run_threads([calls[i] for i in inline], len(inline))),
                                  daemon=True, name="tool-trusted")
        helper.start()
        results = dict(zip(forked, _run_processes([calls[i] for i in forked], self.max_workers)))
        helper.join()
        results.update(zip(inline, threaded))
        return [results[i] for i in range(len(calls))]


# --- the sandbox ------------------------------------------------------------------------------------------------------
def is_untrusted(fn: Callable) -> bool:
    """Whether ``fn``'s calls run in the sandbox (:func:`polopt_lightning.sandbox.tools.untrusted`, the ``python``
    tool)."""
    return bool(getattr(fn, "__polopt_untrusted_tool__", False))


def _run_sandboxed(calls: list[ToolCall], sandbox: Any) -> list[ToolResult]:
    def job(call: ToolCall) -> Callable:
        def run(sb: Any) -> ToolResult:
            start = time.monotonic()
            value, error, timed_out = run_tool(sb, call.fn, call.arguments, call.timeout)
            return ToolResult(call.name, value=value, error=error, timed_out=timed_out,
                              seconds=time.monotonic() - start)
        return run

    return sandbox.map([job(c) for c in calls])


# --- threads ----------------------------------------------------------------------------------------------------------
def _run_threads(calls: list[ToolCall], max_workers: int) -> list[ToolResult]:
    results: list[ToolResult | None] = [None] * len(calls)
    done: queue.SimpleQueue = queue.SimpleQueue()  # (index, ok, value or error); an abandoned call's comes too late

    def target(i: int, call: ToolCall) -> None:
        try:
            done.put((i, True, call.fn(**call.arguments)))
        except BaseException as err:  # the model sees what went wrong
            done.put((i, False, f"{type(err).__name__}: {err}"))

    pending, running = deque(range(len(calls))), {}  # running: index -> (start, deadline)
    while pending or running:
        while pending and len(running) < max_workers:
            i = pending.popleft()
            start = time.monotonic()
            running[i] = (start, start + calls[i].timeout if calls[i].timeout is not None else float("inf"))
            threading.Thread(target=target, args=(i, calls[i]), daemon=True, name=f"tool-{calls[i].name}").start()
        now = time.monotonic()
        for i in [i for i, (_, deadline) in running.items() if deadline <= now]:
            results[i] = _timed_out(calls[i], now - running.pop(i)[0])  # abandoned: its thread runs on
        if not running:
            continue
        nearest = min(deadline for _, deadline in running.values())
        try:
            i, ok, value = done.get(timeout=None if nearest == float("inf") else max(nearest - now, 0.0))
        except queue.Empty:
            continue
        if i in running:
            seconds = time.monotonic() - running.pop(i)[0]
            results[i] = ToolResult(calls[i].name, value=value, seconds=seconds) if ok else \
                ToolResult(calls[i].name, error=value, seconds=seconds)
    return results  # type: ignore[return-value]


# --- processes --------------------------------------------------------------------------------------------------------
class _Child:
    """A running call's process: its pid (and process group), the read end of its pipe, what came through it."""

    def __init__(self, index: int, pid: int, fd: int, start: float, timeout: float | None) -> None:
        self.index, self.pid, self.fd, self.start = index, pid, fd, start
        self.deadline = start + timeout if timeout is not None else float("inf")
        self.data = bytearray()
        self.status: int | None = None  # its wait status, once reaped

    def complete(self) -> bool:
        return len(self.data) >= _LENGTH.size and len(self.data) >= _LENGTH.size + _LENGTH.unpack_from(self.data)[0]

    def kill(self) -> None:
        """Kill its process group (whatever the call left running; the child itself too, if it still runs) and close
        the pipe. Before the child is reaped: until then its pid, which is the group's id, cannot be reused."""
        for kill, target in ((os.killpg, self.pid), (os.kill, self.pid)):
            try:
                kill(target, signal.SIGKILL)
            except OSError:  # gone already (or the group was never made)
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def reap(self, block: bool) -> int | None:
        """The child's wait status once it has exited (``None``: not yet, when not ``block``)."""
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored)
                pid, status = self.pid, 0
            self.status = status if pid else None
        return self.status


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed or odd stream: nothing to flush
            pass


def _child_main(call: ToolCall, read_fd: int, write_fd: int) -> None:
    """In the forked child: the call, its outcome pickled into the pipe; never returns (``os._exit``, so nothing of
    the parent's, its atexit handlers, test runner or finalizers, runs here)."""
    code = 0
    try:
        try:
            os.setpgid(0, 0)  # a group of its own, to be killed with what it starts (the parent sets it too)
        except OSError:
            pass
        os.close(read_fd)
        gc.freeze()  # the collector leaves the inherited objects alone: their pages stay shared with the parent
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        try:
            outcome = (True, call.fn(**call.arguments))
        except BaseException as err:  # the model sees what went wrong
            outcome = (False, f"{type(err).__name__}: {err}")
        try:
            data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            data = pickle.dumps((False, f"tool {call.name!r} returned a {type(outcome[1]).__name__}, which cannot be "
                                        f"sent back from its process (it does not pickle: {type(err).__name__}: "
                                        f"{err})"))
        _flush_std_streams()  # before the result: the parent kills the group once it has it
        _write_all(write_fd, _LENGTH.pack(len(data)) + data)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _start(index: int, call: ToolCall) -> _Child | ToolResult:
    read_fd, write_fd = os.pipe()
    _flush_std_streams()  # else the child would inherit, and write again, what this process has buffered
    try:
        with warnings.catch_warnings():  # Python 3.12 warns about forking with threads: the child must not need them
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as err:
        os.close(read_fd)
        os.close(write_fd)
        return ToolResult(call.name, error=f"tool {call.name!r}: its process could not start: {err}")
    if pid == 0:  # pragma: no cover (the child; coverage does not follow it)
        _child_main(call, read_fd, write_fd)
    start = time.monotonic()
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists before it can be killed
    except OSError:
        pass
    return _Child(index, pid, read_fd, start, call.timeout)


def _result(call: ToolCall, child: _Child) -> ToolResult:
    seconds = time.monotonic() - child.start
    if not child.complete():  # the pipe closed without a result: the process ended (how, its status says)
        code = os.waitstatus_to_exitcode(child.reap(block=True))
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return ToolResult(call.name, error=f"tool {call.name!r} ended without a result ({how})", seconds=seconds)
    try:
        ok, value = pickle.loads(bytes(child.data[_LENGTH.size:]))
    except Exception as err:
        return ToolResult(call.name, error=f"tool {call.name!r}: its result could not be read back: "
                                           f"{type(err).__name__}: {err}", seconds=seconds)
    return ToolResult(call.name, value=value, seconds=seconds) if ok else \
        ToolResult(call.name, error=value, seconds=seconds)


def _run_processes(calls: list[ToolCall], max_workers: int) -> list[ToolResult]:
    results: list[ToolResult | None] = [None] * len(calls)
    pending, running = deque(range(len(calls))), {}  # running: index -> _Child
    ended: list[_Child] = []  # killed or done, not reaped yet: a big process takes a while to exit, in parallel
    selector = selectors.DefaultSelector()

    def end(child: _Child) -> None:
        del running[child.index]
        selector.unregister(child.fd)
        child.kill()
        if child.reap(block=False) is None:
            ended.append(child)

    try:
        while pending or running:
            while pending and len(running) < max_workers:
                i = pending.popleft()
                child = _start(i, calls[i])
                if isinstance(child, ToolResult):
                    results[i] = child
                else:
                    running[i] = child
                    selector.register(child.fd, selectors.EVENT_READ, child)
            now = time.monotonic()
            for child in [c for c in running.values() if c.deadline <= now]:
                end(child)
                results[child.index] = _timed_out(calls[child.index], now - child.start)
            if not running:
                continue
            nearest = min(c.deadline for c in running.values())
            for key, _ in selector.select(None if nearest == float("inf") else max(nearest - now, 0.0)):
                child = key.data
                chunk = os.read(child.fd, 1 << 16)
                child.data += chunk
                if chunk and not child.complete():
                    continue  # more to come
                end(child)  # the whole result, or the pipe closed without it (the process ended)
                results[child.index] = _result(calls[child.index], child)
    finally:  # also after an interruption (KeyboardInterrupt, an error here): nothing is left running or unreaped
        for child in running.values():
            child.kill()
        for child in [*running.values(), *ended]:
            child.reap(block=True)
        selector.close()
    return results  # type: ignore[return-value]
