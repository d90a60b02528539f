"""The sandbox (polopt_lightning/sandbox): model-written code and untrusted tools cannot touch the machine. Each attack
of issue 53 runs through the code reward (reward 0) and the python tool (an error message), the calling process goes
on, nothing outside the working folder changes and no process is left. Where the kernel forbids namespaces, the
tests that need them are skipped with the reason and the refusal itself is tested (it always is, by simulation)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from polopt_lightning.rewards import CodeExecutionReward, extract_code, parse_tests
from polopt_lightning.rollout.tool_runner import ToolCall, ToolRunner
from polopt_lightning.sandbox import Limits, Sandbox, SandboxUnavailable, usage
from polopt_lightning.sandbox.tools import python, run_tool, untrusted

from .helpers.sandbox_tools import spin, where_am_i


@pytest.fixture(scope="module")
def sandbox():
    missing = Sandbox.__new__(Sandbox)
    try:
        box = Sandbox(Limits(wall_s=2, cpu_s=2, memory_mib=256, processes=16, output_kib=16))
    except SandboxUnavailable as exc:
        pytest.skip(f"this kernel does not let this user isolate code: {exc}")
    del missing
    return box


def alive(run_ids: list[str]) -> list[int]:
    """Processes whose environment names one of ``run_ids`` (the sandbox gives each run ``SANDBOX_RUN``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if any(f"SANDBOX_RUN={r}".encode() in env for r in run_ids):
            found.append(int(entry.name))
    return found


def none_left(run_ids: list[str], within: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := alive(run_ids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def host(tmp_path, monkeypatch):
    """What the attacks aim at: a secret file outside the working folder, a file to delete, a token in this process's
    environment, a port listening on 127.0.0.1, a SIGUSR1 handler that counts."""
    (tmp_path / "secret.txt").write_text("SECRET-7d3f")
    (tmp_path / "keep.txt").write_text("keep me")
    monkeypatch.setenv("POLOPT_TEST_TOKEN", "TOKEN-91ab")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    signals: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *a: signals.append(1))
    yield {"dir": tmp_path, "port": listener.getsockname()[1], "signals": signals, "listener": listener,
           "files": {p.name: p.read_bytes() for p in tmp_path.iterdir()}}
    signal.signal(signal.SIGUSR1, old)
    listener.close()


def attacks(host) -> dict[str, tuple[str, str]]:
    """name -> (program, what it prints if the attack works): the reward's test expects that output."""
    d, port, me = host["dir"], host["port"], os.getpid()
    return {
        "infinite loop": ("while True:\n    pass\nprint('done')", "done"),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "done"),
        "memory hog": ("x = bytearray(8 * 2**30)\nprint('allocated')", "allocated"),
        "output flood": ("while True:\n    print('x' * 1000)", "x"),
        "read a secret": (f"print(open({str(d / 'secret.txt')!r}).read())", "SECRET-7d3f"),
        "write outside": (f"open({str(d / 'evil.txt')!r}, 'w').write('x')\nprint('written')", "written"),
        "delete outside": (f"import os\nos.remove({str(d / 'keep.txt')!r})\nprint('deleted')", "deleted"),
        "connect to localhost": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                                 "print('connected')", "connected"),
        "parent's environment": ("import glob, os\nfound = [open(p, 'rb').read() for p in glob.glob('/proc/*/environ')"
                                 " if os.access(p, os.R_OK)]\nprint([l for l in found if b'TOKEN-91ab' in l] and "
                                 "'TOKEN-91ab' or os.environ.get('POLOPT_TEST_TOKEN'))", "TOKEN-91ab"),
        "signal the parent": (f"import os, signal\nos.kill({me}, signal.SIGUSR1)\nos.kill(os.getppid(), "
                              "signal.SIGKILL)\nprint('sent')", "sent"),
        "child left sleeping": ("import os, time, sys\nif os.fork() == 0:\n    time.sleep(1.5)\n    print('late')\n"
                                "    sys.stdout.flush()\n    time.sleep(60)\nprint('ok')", "ok\nlate"),
        "child in its own session": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
                                     "    print('late', flush=True)\n    time.sleep(60)\nprint('ok', flush=True)",
                                     "ok\nlate"),
    }


def check_host(host) -> None:
    """Nothing outside the working folder changed, no connection came, no signal arrived."""
    assert {p.name: p.read_bytes() for p in host["dir"].iterdir()} == host["files"]
    with pytest.raises(TimeoutError):
        host["listener"].accept()
    assert host["signals"] == []


def test_every_attack_scores_zero_and_leaves_nothing(sandbox, host):
    """Issue 53's attacks as completions scored by the code reward: each scores 0 (the same reward scores the honest
    program 1), the caller goes on, the host is as it was and no process of theirs is left."""
    cases = attacks(host)
    reward = CodeExecutionReward(sandbox=sandbox)
    completions = [f"here:\n```python\n{code}\n```" for code, _ in cases.values()] + ["```python\nprint('ok')\n```"]
    tests = [[{"input": "", "output": want}] for _, want in cases.values()] + [[{"input": "", "output": "ok"}]]
    runs_before = usage().runs
    scores = reward([""] * len(completions), completions, tests=tests)
    assert dict(zip([*cases, "honest"], scores)) == {**{name: 0.0 for name in cases}, "honest": 1.0}
    assert usage().runs - runs_before == len(completions)
    results = dict(zip(cases, (r[0] for r in reward.last_results)))
    assert results["infinite loop"].timed_out and results["fork bomb"].timed_out
    assert results["output flood"].output_exceeded and len(results["output flood"].stdout) <= 16 * 1024
    assert "MemoryError" in results["memory hog"].stderr
    assert "Network is unreachable" in results["connect to localhost"].stderr
    assert "No such process" in results["signal the parent"].stderr
    assert results["child left sleeping"].stdout == "ok\n" and results["child in its own session"].stdout == "ok\n"
    assert none_left([r.run_id for r in results.values()]) == []
    check_host(host)


def test_every_attack_through_the_python_tool_is_an_error_message(sandbox, host):
    """The same attacks as calls of the python tool in one batch of a ToolRunner: each answer says what went wrong
    (an exception, the time limit, the output limit) and carries nothing of the host."""
    cases = attacks(host)
    runner = ToolRunner(sandbox=sandbox)
    calls = [ToolCall(python, {"code": code}, timeout=2) for code, _ in cases.values()]
    results = dict(zip(cases, runner.run(calls)))
    for name, result in results.items():
        assert result.ok, (name, result)  # the tool answered: an error message is its value, the episode goes on
        if name.startswith("child"):
            assert result.value == "ok", (name, result.value)  # the child was killed before it printed
            continue
        if name == "parent's environment":
            assert result.value == "None"  # no environment it may read holds the token, its own has none
            continue
        assert "error:" in result.value, (name, result.value)
        assert "SECRET-7d3f" not in result.value and "TOKEN-91ab" not in result.value
    assert "ran past its time limit" in results["infinite loop"].value
    # the time-out is the sandbox's own flag (counted as the tool runner's time-outs), not read from a message
    assert results["infinite loop"].timed_out and not results["output flood"].timed_out
    assert "more output than allowed" in results["output flood"].value
    check_host(host)


def test_what_the_code_sees(sandbox):
    """No capabilities, its own PID namespace and hostname, its own folder writable and nothing else, a scrubbed
    environment."""
    code = """import os, json
status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
writable = {}
for p in ['/', '/usr', '/etc', '/dev', '/proc', '/sandbox', '/tmp']:
    try:
        open(os.path.join(p, 'probe'), 'w').close()
        writable[p] = True
    except OSError:
        writable[p] = False
print(json.dumps({'cap': [status[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb')],
                  'nnp': status['NoNewPrivs'].strip(), 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
                  'host': os.uname().nodename, 'env': sorted(os.environ), 'cwd': os.getcwd(), 'w': writable,
                  'files': sorted(os.listdir('.'))}))
"""
    import json

    result = sandbox.run_python(code, files={"data/input.txt": "42"})
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert seen["cap"] == ["0000000000000000"] * 4 and seen["nnp"] == "1"
    assert seen["pids"] == [1, 2] and seen["host"] == "sandbox" and seen["cwd"] == "/sandbox"
    assert seen["env"] == ["HOME", "LANG", "PATH", "SANDBOX_RUN", "TMPDIR"]
    assert seen["w"] == {"/": False, "/usr": False, "/etc": False, "/dev": False, "/proc": False, "/sandbox": True,
                         "/tmp": True}
    assert seen["files"] == ["data", "main.py", "probe"]


def test_limits_each_stop_what_they_name(sandbox):
    small = Limits(wall_s=5, cpu_s=1, memory_mib=256, processes=4, file_mib=1, disk_mib=2, open_files=16,
                   output_kib=4)
    cpu = sandbox.run_python("while True:\n    pass", limits=small)
    assert cpu.returncode == 128 + signal.SIGKILL or cpu.returncode == 128 + signal.SIGXCPU, cpu
    assert not cpu.timed_out and cpu.wall_s < 4
    procs = sandbox.run_python("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                               "            time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n)", limits=small)
    assert procs.ok and int(procs.stdout) <= 4, procs
    big_file = sandbox.run_python("open('f', 'wb').write(b'x' * 2**21)", limits=small)
    assert "File too large" in big_file.stderr
    disk = sandbox.run_python("for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * 2**19)\n"
                              "open('g', 'wb').write(b'x' * 2**19)", limits=small)
    assert "No space left" in disk.stderr, disk
    files = sandbox.run_python("fs = [open(f'f{i}', 'w') for i in range(64)]", limits=small)
    assert "Too many open files" in files.stderr


def test_stdin_and_files_reach_the_code(sandbox):
    result = sandbox.run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())), open('n.txt').read())",
                                files={"n.txt": "seven"}, stdin="3 4\n" * 20000)
    assert result.ok and result.stdout.split() == ["140000", "seven"]
    with pytest.raises(ValueError, match="outside the working folder"):
        sandbox.run_python("pass", files={"../x.py": ""})


def test_untrusted_tools_run_in_the_sandbox(sandbox):
    runner = ToolRunner(sandbox=sandbox)
    [done, slow] = runner.run([ToolCall(where_am_i, {"tag": "t"}, timeout=5), ToolCall(spin, {"seconds": 1}, 2)])
    assert done.ok and done.value["tag"] == "t" and done.value["pid"] == 2 and done.value["cwd"] == "/sandbox"
    assert done.value["run"] and done.value["home"] == "/sandbox"
    assert slow.timed_out and slow.error == "the tool timed out after 2 s"

    def local(x: int) -> int:
        """A closure.

        Args:
            x: a number.
        """
        return x

    with pytest.raises(ValueError, match="'local' cannot be marked untrusted"):
        untrusted(local)
    value, error, timed_out = run_tool(sandbox, where_am_i, {"tag": {1, 2}}, 5)
    assert value is None and "not JSON" in error and not timed_out


def test_the_pool_runs_executions_at_once(sandbox):
    """Four executions of a second's sleep through a pool of two: two at once, never more (~2 s, not 1 nor 4)."""
    pool = Sandbox(sandbox.limits, max_concurrency=2)
    start = time.monotonic()
    results = pool.map([lambda sb, i=i: sb.run_python(f"import time\ntime.sleep(1)\nprint({i})") for i in range(4)])
    took = time.monotonic() - start
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert 2.0 <= took < 3.5, took


# --- where code cannot be isolated ------------------------------------------------------------------------------------
def test_no_isolation_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(Sandbox, "isolation_missing", lambda self: "unshare: EPERM (Operation not permitted)")
    with pytest.raises(SandboxUnavailable, match=r"cannot isolate untrusted code on this machine: unshare: EPERM.*"
                                                 r"sandbox\.allow_unisolated=true"):
        Sandbox()
    with pytest.raises(SandboxUnavailable, match="sandbox.isolation=none runs code with your rights"):
        Sandbox(isolation="none")
    with pytest.raises(SandboxUnavailable, match="unshare: EPERM"):
        Sandbox(isolation="namespaces", allow_unisolated=True)
    with pytest.raises(SandboxUnavailable, match="unshare: EPERM"):
        CodeExecutionReward()
    from polopt_lightning.rollout.multi_turn import MultiTurnEngine

    with pytest.raises(SandboxUnavailable, match="unshare: EPERM"):  # at construction, before any rollout
        MultiTurnEngine("tools", tools=[python])
    MultiTurnEngine("tools", tools=["polopt_lightning.rollout.environments.add"])  # no untrusted tool: no sandbox


def test_unisolated_when_allowed_keeps_the_limits(monkeypatch, tmp_path):
    monkeypatch.setattr(Sandbox, "isolation_missing", lambda self: "unshare: EPERM (simulated)")
    with pytest.warns(UserWarning, match="without isolation.*simulated"):
        box = Sandbox(Limits(wall_s=2, output_kib=4), allow_unisolated=True)
    assert box.isolation == "none"
    ok = box.run_python("import os\nprint(sorted(os.environ))")
    assert ok.ok and ok.stdout.strip() == str(["HOME", "LANG", "PATH", "SANDBOX_RUN", "TMPDIR"])
    loop = box.run_python("while True:\n    pass")
    assert loop.timed_out
    flood = box.run_python("while True:\n    print('x' * 100)")
    assert flood.output_exceeded
    child = box.run_python("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('ok')")
    assert child.stdout == "ok\n" and none_left([loop.run_id, flood.run_id, child.run_id]) == []


def test_a_setup_failure_is_named(sandbox):
    result = sandbox.run(["/nonexistent/python", "x.py"])
    assert result.returncode == 125 and "nonexistent" in (result.error or ""), result


# --- the reward's parts ------------------------------------------------------------------------------------------------
def test_extract_code_takes_the_last_python_block():
    text = "try\n```python\nprint(1)\n```\nthen\n```bash\nls\n```\nfinally\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code") is None
    assert extract_code(text, language=None) == "print(2)\n"
    assert extract_code("```python3\nprint(3)\n```") == "print(3)\n"


def test_parse_tests_reads_the_peers_forms():
    cases = [{"input": "1 2", "output": "3"}]
    assert parse_tests(cases) == cases
    assert parse_tests({"test_cases": [{"input": "1 2", "output": "3", "type": "stdin_stdout"}]}) == cases
    assert parse_tests('{"inputs": ["1 2"], "outputs": ["3"]}') == cases
    assert parse_tests("assert f(1) == 2\nassert f(2) == 3\n") == ["assert f(1) == 2", "assert f(2) == 3"]
    assert parse_tests("import math\ndef g(x):\n    return x\nassert g(1) == 1\nassert math.e > 2") == [
        "import math\ndef g(x):\n    return x\nassert g(1) == 1", "import math\ndef g(x):\n    return x\nassert math.e > 2"]
    # APPS/TACO: numbers, and lists of lines
    assert parse_tests('{"inputs": [3, ["1", "2"]], "outputs": [7, "x"]}') == [
        {"input": "3", "output": "7"}, {"input": "1\n2", "output": "x"}]
    for bad, why in [({"x": 1}, "test_cases, inputs/outputs or input/output"), ('[{"input": "1", "output": 9', "look like JSON"),
                     ([], "no tests"), ("this is not a test", "neither JSON nor Python"),
                     ([{"input": "f(1)", "output": "2", "type": "function_call"}], "type 'function_call' is not run")]:
        with pytest.raises(ValueError, match=why):
            parse_tests(bad)


def test_assert_tests_count_what_passes_and_an_early_exit_is_no_pass(sandbox):
    reward = CodeExecutionReward(sandbox=sandbox)
    tests = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 99"]
    good = "```python\ndef f(x):\n    return 2 * x\n```"
    cheat = "```python\nimport sys\nsys.exit(0)\n```"
    assert reward(["", ""], [good, cheat], tests=[tests, tests]) == [pytest.approx(2 / 3), 0.0]
    strict = CodeExecutionReward(sandbox=sandbox, partial=False)
    assert strict([""], [good], tests=[tests]) == [0.0]
    with pytest.raises(ValueError, match="the 'tests' column of sample 0"):
        reward([""], [good], tests=[{"x": 1}])


def test_the_launcher_as_an_unprivileged_user():
    """The path a user other than root takes (the namespace's root mapped to that user, no second user): run here as
    ``nobody`` with the system's Python, the launcher alone (the package need not be readable by that user). It runs
    the program isolated and limits its processes."""
    import json
    import shutil
    import subprocess

    from polopt_lightning.sandbox import core

    python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(python):
        pytest.skip("needs root (to become nobody with setpriv) and /usr/bin/python3: not this machine")
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="polopt-nobody-"))  # pytest's folders are closed to other users
    files = top / "files"
    files.mkdir()
    (files / "main.py").write_text("import os\nn = 0\ntry:\n    while n < 50:\n        if os.fork() == 0:\n"
                                   "            import time; time.sleep(30)\n        n += 1\nexcept OSError:\n    pass\n"
                                   "print(os.getuid(), n, sorted(os.listdir('/')))\n")
    for p in (top, files):
        p.chmod(0o777)
    (files / "main.py").chmod(0o644)
    limits = dict(vars(Limits(processes=4)))
    spec = {"argv": [python, "-E", "-s", "-S", "-B", "main.py"], "env": {"PATH": "/usr/bin"}, "files": str(files),
            "limits": limits, "isolate": True, "binds": core._default_binds(python), "parent": os.getpid()}
    launcher = Path(core._LAUNCHER)
    if any(os.stat(p).st_mode & 0o005 != 0o005 for p in [*launcher.parents][:-1] if p != Path("/")):
        pytest.skip(f"nobody cannot reach {launcher}: a folder above it is closed to others")
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-S",
                               "-B", core._LAUNCHER, "0"], input=json.dumps(spec), capture_output=True, text=True,
                              timeout=30)  # the spec on the descriptor named: here stdin
    finally:
        shutil.rmtree(top, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    uid, forks, *_ = proc.stdout.split(" ", 2)
    assert uid == "0" and int(forks) == 3  # 4 processes: the program and 3 children
    assert "'sandbox'" in proc.stdout and "'root'" not in proc.stdout


def test_the_pages_quick_start_runs(sandbox):
    """docs/sandbox.md's first Python block, as written: its result is the one its comment shows."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "sandbox.md").read_text()
    block = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    scope: dict = {}
    exec(compile(block, "docs/sandbox.md", "exec"), scope)
    assert (scope["result"].ok, scope["result"].stdout) == (True, "7\n")
    assert isinstance(scope["reward"], CodeExecutionReward)


def test_a_sandbox_copies_and_pickles(sandbox):
    """A reward holding a sandbox survives what Lightning and spawned processes do to a module's parts."""
    import copy
    import pickle

    for twin in (copy.deepcopy(sandbox), pickle.loads(pickle.dumps(CodeExecutionReward(sandbox=sandbox))).sandbox):
        assert twin.isolation == sandbox.isolation and twin.run_python("print(2)").stdout == "2\n"


def test_settings_from_the_command_line_reach_the_sandbox(tmp_path):
    """`sandbox.limits.<key>=` composes (the group documents its limits without setting them) and reaches the code
    reward's sandbox; bad settings name their key."""
    from polopt_lightning.sandbox import sandbox_from_config

    from .helpers import compose_with

    cfg = compose_with(["experiment=code", "sandbox.limits.wall_s=1.5", "sandbox.max_concurrency=1"], tmp_path)
    assert cfg.reward.functions.code_execution.sandbox.limits.wall_s == 1.5
    built = sandbox_from_config(cfg.reward.functions.code_execution.sandbox)
    assert built.limits.wall_s == 1.5 and built.limits.cpu_s == Limits().cpu_s and built.max_concurrency == 1
    with pytest.raises(ValueError, match="sandbox.limits.wall_s must be a positive number, got 0"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="sandbox.binds: '/' would show the code the whole machine"):
        Sandbox(binds=["/"])
    with pytest.raises(ValueError, match="sandbox.python='/nonexistent/python' is not an executable"):
        Sandbox(python="/nonexistent/python")


def test_a_folder_under_tmp_can_be_shown(sandbox, tmp_path):
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="polopt-bind-"))
    try:
        (folder / "data.txt").write_text("shown")
        folder.chmod(0o755)  # under root the code runs as an unprivileged user: what it reads, others may read
        box = Sandbox(sandbox.limits, binds=[str(folder)])
        result = box.run_python(f"print(open({str(folder / 'data.txt')!r}).read())\n"
                                f"open({str(folder / 'new.txt')!r}, 'w')")
        assert result.stdout == "shown\n" and "Read-only file system" in result.stderr
        assert sorted(p.name for p in folder.iterdir()) == ["data.txt"]
    finally:
        import shutil

        shutil.rmtree(folder)


def test_the_launchers_settings_are_not_shown_to_the_code(sandbox):
    result = sandbox.run_python("print(open('/proc/1/cmdline').read())")
    assert result.ok and "limits" not in result.stdout and str(os.getpid()) not in result.stdout


def test_the_python_tool_names_a_wrong_argument(sandbox):
    assert run_tool(sandbox, python, {"cod": "print(1)"}, 2) == (
        None, "the python tool takes one argument, code; got ['cod']", False)


def test_a_refused_sandbox_stops_the_run_before_the_warm_start(monkeypatch, tmp_path):
    """Where code cannot be isolated, `polopt-train experiment=code` stops on the refusal before minutes of supervised
    warm start (the rewards are built first)."""
    from polopt_lightning import cli

    from .helpers import compose_with, set_hydra

    monkeypatch.setattr(Sandbox, "isolation_missing", lambda self: "unshare: EPERM (simulated)")
    monkeypatch.setattr(cli, "_warm_start", lambda *a, **k: pytest.fail("the warm start ran before the rewards"))
    cfg = compose_with(["experiment=code", "task.train_size=40", "task.val_size=8"], tmp_path)
    set_hydra(cfg)
    with pytest.raises(Exception, match=r"(?s)reward\.functions\.code_execution|cannot isolate.*EPERM") as err:
        cli.train(cfg)
    assert "cannot isolate untrusted code on this machine: unshare: EPERM (simulated)" in str(err.value)


def test_no_namespace_or_shared_memory_inside(sandbox):
    """The code cannot make a user namespace of its own (whose root would regain every capability there) nor System V
    shared memory (memory no process's limit counts); a probe failing after the namespaces were granted is not taken
    for their absence (no fall back to running unisolated)."""
    result = sandbox.run_python("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                "print(libc.unshare(0x10000000), errno.errorcode[ctypes.get_errno()])\n"
                                "print(libc.shmget(0, 1 << 20, 0o1600), errno.errorcode[ctypes.get_errno()])")
    assert result.ok and result.stdout.split() == ["-1", "ENOSPC", "-1", "ENOSPC"], result
