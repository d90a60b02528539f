"""The tool runner (polopt_lightning/rollout/tool_runner.py): calls run concurrently, each with its time limit, results
in the calls' order; the process runner kills a call past its limit (and what it started), the errors name the tool."""

import os
import signal
import subprocess
import threading
import time

import pytest

from polopt_lightning.rollout.environments import add, calculator
from polopt_lightning.rollout.tool_runner import ToolCall, ToolRunner, is_trusted, trusted


def stamped(seconds: float, label: str):
    start = time.time()
    time.sleep(seconds)
    return label, start, time.time()


def grows(path, seconds=0.6):
    """Whether the file at ``path`` grows within ``seconds``."""
    before = os.path.getsize(path)
    time.sleep(seconds)
    return os.path.getsize(path) > before


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_calls_run_at_once_and_their_results_keep_the_calls_order(mode):
    runner = ToolRunner(mode, max_workers=3)
    start = time.perf_counter()
    # the first call ends last: the results are still in the calls' order
    results = runner.run([ToolCall(stamped, {"seconds": s, "label": f"call {i}"}, timeout=5)
                          for i, s in enumerate([1.0, 0.8, 0.6])])
    wall = time.perf_counter() - start
    assert [r.value[0] for r in results] == ["call 0", "call 1", "call 2"] and all(r.ok for r in results)
    starts, ends = [r.value[1] for r in results], [r.value[2] for r in results]
    assert max(starts) < min(ends)  # all three were running at one moment
    assert wall < 2.2, wall  # one after another: 2.4 s


def test_at_most_max_workers_calls_run_at_once_each_timed_from_its_own_start():
    # one at a time: 3 x 0.5 s, longer than the 1 s limit in all, within it each
    results = ToolRunner("process", max_workers=1).run(
        [ToolCall(stamped, {"seconds": 0.5, "label": str(i)}, timeout=1.0) for i in range(3)])
    assert all(r.ok for r in results), [r.error for r in results]
    assert results[0].value[2] <= results[1].value[1] and results[1].value[2] <= results[2].value[1]
    assert ToolRunner().max_workers >= 1
    with pytest.raises(ValueError, match="rollout.tool_runner must be one of"):
        ToolRunner("greenlet")
    with pytest.raises(ValueError, match="rollout.tool_workers must be an integer >= 1"):
        ToolRunner(max_workers=0)


def test_a_hung_call_is_killed_at_its_limit_with_what_it_started(tmp_path):
    own, spawned, pids = tmp_path / "own", tmp_path / "spawned", tmp_path / "pids"

    def hang() -> str:  # a closure: the forked child inherits it, no pickling
        shell = subprocess.Popen(["sh", "-c", f"while :; do echo x >> {spawned}; sleep 0.05; done"])
        pids.write_text(f"{os.getpid()} {shell.pid}")
        while True:
            with open(own, "a") as f:
                f.write("x\n")
            time.sleep(0.05)

    start = time.perf_counter()
    [hung, quick] = ToolRunner("process", max_workers=2).run(
        [ToolCall(hang, timeout=1.5), ToolCall(stamped, {"seconds": 0, "label": "quick"}, timeout=1.5)])
    wall = time.perf_counter() - start
    child, shell = map(int, pids.read_text().split())
    try:
        assert hung.timed_out and hung.error == "the tool timed out after 1.5 s" and hung.name == "hang"
        assert quick.ok and quick.value[0] == "quick" and quick.seconds < 1  # the batch's other call: not held back
        assert 1.4 < wall < 4, wall
        assert os.path.getsize(own) > 0 and os.path.getsize(spawned) > 0  # both were running ...
        assert not grows(own) and not grows(spawned)  # ... and are gone: the call's process and the one it started
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)  # killed and reaped
    finally:
        for pid in (child, shell):  # a failed check must not leave them behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_errors_name_the_tool_and_say_what_went_wrong():
    def raises() -> None:
        raise ValueError("no such thing")

    def unpicklable():
        return (x for x in range(3))

    def exits():
        os._exit(3)

    secret = 41

    def closure(plus: int) -> dict:
        return {"sum": secret + plus}

    results = ToolRunner("process", max_workers=4).run(
        [ToolCall(raises, timeout=5), ToolCall(unpicklable, timeout=5), ToolCall(exits, timeout=5),
         ToolCall(closure, {"plus": 1}, timeout=5), ToolCall(closure, {"minus": 1}, timeout=5, name="adder")])
    assert results[0].error == "ValueError: no such thing" and not results[0].timed_out
    assert results[1].error.startswith("tool 'unpicklable' returned a generator, which cannot be sent back from its "
                                       "process (it does not pickle: TypeError")
    assert results[2].error == "tool 'exits' ended without a result (exit code 3)"
    assert results[3].ok and results[3].value == {"sum": 42}
    assert results[4].name == "adder" and results[4].error.startswith("TypeError") and "minus" in results[4].error
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # every call's process reaped


def test_trusted_tools_run_in_this_process_alongside_the_forked_calls():
    def forked(seconds: float):
        return os.getpid(), *stamped(seconds, "forked")[1:]

    @trusted
    def inline(seconds: float):
        return os.getpid(), *stamped(seconds, "inline")[1:]

    assert is_trusted(add) and is_trusted(calculator) and is_trusted(inline) and not is_trusted(forked)
    results = ToolRunner("process", max_workers=2).run(
        [ToolCall(inline, {"seconds": 1.0}, timeout=5), ToolCall(forked, {"seconds": 1.0}, timeout=5),
         ToolCall(inline, {"seconds": 0.0}, timeout=5)])
    assert [r.value[0] == os.getpid() for r in results] == [True, False, True]  # in the calls' order
    assert max(r.value[1] for r in results[:2]) < min(r.value[2] for r in results[:2])  # at once


def test_an_interrupted_run_leaves_no_call_running(tmp_path):
    out = tmp_path / "out"

    def forever() -> None:
        while True:
            with open(out, "a") as f:
                f.write("x\n")
            time.sleep(0.05)

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            ToolRunner("process").run([ToolCall(forever, timeout=None)])  # no limit: only the interruption ends it
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert os.path.getsize(out) > 0 and not grows(out)


def test_the_thread_runner_answers_at_the_limit_but_cannot_stop_the_call():
    release, ended = threading.Event(), threading.Event()

    def hang() -> str:
        release.wait(30)
        ended.set()
        return "late"

    try:
        start = time.perf_counter()
        [result] = ToolRunner("thread").run([ToolCall(hang, timeout=0.5)])
        assert result.timed_out and result.error == "the tool timed out after 0.5 s"
        assert time.perf_counter() - start < 2.5 and not ended.is_set()  # answered; the call itself runs on
    finally:
        release.set()  # let the abandoned thread end
    assert ended.wait(5)
