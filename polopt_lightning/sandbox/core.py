"""Running untrusted code: a process tree of its own with limits, no network and nothing of the host writable.

:class:`Sandbox` runs a program (:meth:`Sandbox.run`) or Python source (:meth:`Sandbox.run_python`) with files put in
a fresh working folder, and returns an :class:`ExecResult`: exit status, output (cut at ``limits.output_kib``),
whether it ran out of time or output. What stops what (docs/sandbox.md):

- ``isolation="namespaces"`` (Linux, where the kernel lets this user create user namespaces): new user, mount,
  PID, network, IPC and UTS namespaces; a root of its own with only the interpreter's folders and the system's
  libraries, read-only; ``/sandbox``, the working folder, a tmpfs of ``limits.disk_mib``; a loopback-only network
  that is down; no capabilities and no way to gain any; the environment replaced by a handful of variables. When
  the program ends, or at the wall-time limit, every process it started is killed (the PID namespace ends with it).
- resource limits in every mode: CPU seconds, address space, processes, largest file, open files, output, wall time.
- ``isolation="none"``: the limits, a process group killed at the end, a scrubbed environment and a fresh folder,
  but the code has the user's rights (it can read and write what the user can, and use the network): refused unless
  ``allow_unisolated=True`` says so.

``isolation="auto"`` (the default) uses namespaces where they work and otherwise refuses, naming what is missing.
Executions may run from many threads at once; at most ``max_concurrency`` run at a time (:meth:`Sandbox.map` runs a
list of them through that pool). Every execution adds to :func:`usage` (counts and seconds), which the trainer logs per
step (``train/sandbox_runs``, ``train/sandbox_s``, ``train/sandbox_timeouts``).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: how code is kept from the host: ``auto`` (namespaces where available, else refused), ``namespaces``, ``none``
ISOLATIONS = ("auto", "namespaces", "none")
_LAUNCHER = str(Path(__file__).with_name("_launch.py"))
_SETUP_FAILED = 125
_SETUP_MARK = b"polopt-sandbox: "


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be had on this machine (the message says what is missing and what to do)."""


@dataclass(frozen=True)
class Limits:
    """What one execution may use. Seconds are wall time (``wall_s``: the whole tree is killed) and CPU time
    (``cpu_s``: per process, SIGXCPU then SIGKILL); ``memory_mib`` is each process's address space; ``processes``
    the processes and threads the code may run at once (namespaces only: without them the limit would count the
    user's every process); ``file_mib`` the largest file it may write, ``disk_mib`` the working folder's size
    (namespaces only), ``open_files`` its descriptors, ``output_kib`` stdout and stderr together (more: killed, the
    output cut)."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mib: int = 512
    processes: int = 16
    file_mib: int = 16
    disk_mib: int = 64
    open_files: int = 64
    output_kib: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox.limits.{name} must be a positive number, got {value!r}")


@dataclass
class ExecResult:
    """One execution: ``returncode`` (128 + the signal when killed; ``None`` when it never ran), its output (text,
    undecodable bytes replaced), ``timed_out`` (killed at ``limits.wall_s``), ``output_exceeded`` (killed at
    ``limits.output_kib``, output cut there), ``wall_s``, and ``error`` when the sandbox itself failed."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    output_exceeded: bool = False
    wall_s: float = 0.0
    error: str | None = None
    run_id: str = ""

    @property
    def ok(self) -> bool:
        """Exited with status 0, within its limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded and self.error is None

    def summary(self, tail: int = 2000) -> str:
        """What a tool message says of it: stdout, then the end of stderr and how it ended when it did not end
        well."""
        parts = [self.stdout[-tail:].rstrip("\n")] if self.stdout.strip("\n") else []
        if self.timed_out:
            parts.append(f"error: the code ran past its time limit ({self.wall_s:.0f} s) and was killed")
        elif self.output_exceeded:
            parts.append("error: the code wrote more output than allowed and was killed")
        elif self.error is not None:
            parts.append(f"error: {self.error}")
        elif self.returncode != 0:
            parts.append((self.stderr[-tail:].rstrip() + "\n" if self.stderr else "")
                         + f"error: exit status {self.returncode}")
        return "\n".join(parts)


@dataclass
class Usage:
    """Executions so far in this process (:func:`usage`): how many, their seconds summed, how many timed out."""

    runs: int = 0
    seconds: float = 0.0
    timeouts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, result: ExecResult) -> None:
        with self.lock:
            self.runs += 1
            self.seconds += result.wall_s
            self.timeouts += int(result.timed_out)

    def snapshot(self) -> tuple[int, float, int]:
        with self.lock:
            return self.runs, self.seconds, self.timeouts


_USAGE = Usage()


def usage() -> Usage:
    """This process's executions so far, every sandbox's together."""
    return _USAGE


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


def _default_binds(python: str) -> list[str]:
    """The host paths the code sees, read-only: the system's programs and libraries, and the interpreter's folders."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
             "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime"]
    real = os.path.realpath(python)
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                   str(Path(real).parent.parent), str(Path(python).parent.parent)}:
        paths.append(os.path.realpath(prefix))
        if os.path.realpath(prefix) != os.path.abspath(prefix):
            paths.append(os.path.abspath(prefix))
    kept: list[str] = []
    for p in sorted(set(paths) - {"/"}, key=len):  # a folder under one already shown needs nothing more
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept if not os.path.islink(k)):
            kept.append(p)
    return kept


_PROBES: dict[tuple[str, str], str | None] = {}
_PROBE_LOCK = threading.Lock()


class Sandbox:
    """Runs untrusted code (module docstring: what each isolation stops).

    Args:
        limits: what one execution may use (:class:`Limits`, or a mapping of its fields).
        isolation: ``auto`` | ``namespaces`` | ``none`` (:data:`ISOLATIONS`).
        allow_unisolated: with ``isolation="none"``, or ``auto`` where namespaces are unavailable: run the code
            anyway, with the user's rights (say so only for code you trust, or inside a VM or container).
        max_concurrency: executions at once at most (``None``: the CPUs this process may use).
        python: the interpreter :meth:`run_python` runs (default: this one; its folders read-only).
        packages: :meth:`run_python` imports the interpreter's installed packages (``site``; 30 ms more a run
            here); ``False``: the standard library only.
        binds: more host paths the code may read (read-only), e.g. a dataset's folder.
    """

    def __init__(self, limits: Limits | Mapping[str, Any] | None = None, isolation: str = "auto",
                 allow_unisolated: bool = False, max_concurrency: int | None = None, python: str | None = None,
                 packages: bool = False, binds: Sequence[str] = ()) -> None:
        if not isinstance(limits, Limits):
            limits = Limits(**{k: v for k, v in dict(limits or {}).items() if k != "_target_"})
        self.limits = limits
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox.isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ValueError(f"sandbox.max_concurrency must be an integer >= 1 or null, got {max_concurrency!r}")
        self.python = python or sys.executable
        if not (os.path.isabs(self.python) and os.access(self.python, os.X_OK)):
            raise ValueError(f"sandbox.python={self.python!r} is not an executable's absolute path")
        self.packages = bool(packages)
        self.binds = _default_binds(self.python) + [os.path.abspath(b) for b in binds]
        for b in binds:
            if not os.path.exists(b):
                raise ValueError(f"sandbox.binds: {b!r} does not exist")
            if os.path.realpath(b) == "/":
                raise ValueError("sandbox.binds: '/' would show the code the whole machine; name the folders it needs")
        self._user_binds = [os.path.abspath(b) for b in binds]
        self.max_concurrency = max_concurrency or available_cpus()
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self.isolation = self._choose(isolation, allow_unisolated)

    def __repr__(self) -> str:
        return f"Sandbox(isolation={self.isolation!r}, limits={self.limits}, max_concurrency={self.max_concurrency})"

    def __getstate__(self) -> dict[str, Any]:  # copied or pickled (a spawned process, a deep copy): a pool of its own
        return {k: v for k, v in self.__dict__.items() if k != "_slots"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._slots = threading.BoundedSemaphore(self.max_concurrency)

    # ------------------------------------------------------------------------------------------------------------
    def _choose(self, isolation: str, allow_unisolated: bool) -> str:
        if isolation == "none":
            if not allow_unisolated:
                raise SandboxUnavailable(
                    "sandbox.isolation=none runs code with your rights (it can read your files, write them and reach "
                    "the network); set sandbox.allow_unisolated=true to say you accept that")
            return "none"
        missing = self.isolation_missing()
        if missing is None:
            return "namespaces"
        named = [b for b in self._user_binds if b in missing]
        if named or self.python in missing:  # namespaces work; what the settings ask of them does not
            raise ValueError(f"the sandbox cannot start with {'sandbox.binds=' + str(named) if named else 'sandbox.python=' + repr(self.python)}: {missing}")
        refused = any(w in missing for w in ("unshare", "user namespace", "uid_map", "gid_map", "setgroups",
                                             "Linux's"))
        if isolation == "auto" and allow_unisolated and refused:
            import warnings

            warnings.warn(f"the sandbox runs code without isolation (sandbox.allow_unisolated=true): {missing}",
                          stacklevel=3)
            return "none"
        if not refused:  # the namespaces were granted; something after them failed: not a reason to run unisolated
            raise SandboxUnavailable(f"the sandbox could not start its first program: {missing}")
        raise SandboxUnavailable(
            f"cannot isolate untrusted code on this machine: {missing}. Enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, or kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu; "
            "in Docker, --security-opt seccomp=unconfined or a VM), or set sandbox.allow_unisolated=true to run it "
            "with your own rights, only for code you trust")

    def isolation_missing(self) -> str | None:
        """Why namespaces cannot isolate code here (``None``: they can): one probe per interpreter, remembered."""
        if not sys.platform.startswith("linux"):
            return f"namespaces are Linux's, and this is {sys.platform}"
        key = (self.python, json.dumps(self.binds))
        with _PROBE_LOCK:  # a success is remembered; a failure is probed again (it may have been passing)
            if key in _PROBES:
                return None
            # the probe's own limits (the defaults): a user's small ones must not pass for missing namespaces
            result = self._execute([self.python, "-I", "-S", "-c", "print('ok')"], {}, None, Limits(), True)
            if result.ok and result.stdout.strip() == "ok":
                _PROBES[key] = None
                return None
            return result.error or (result.stderr.strip() or f"exit status {result.returncode}")

    # ------------------------------------------------------------------------------------------------------------
    def run(self, argv: Sequence[str], files: Mapping[str, str | bytes] | None = None, stdin: str | bytes | None = None,
            limits: Limits | None = None, env: Mapping[str, str] | None = None) -> ExecResult:
        """``argv`` (an absolute program path first) run in a fresh working folder holding ``files`` (relative path
        -> content), ``stdin`` as its input; waits for a slot of the pool. ``env`` adds to the few variables it gets
        (``PATH``, ``HOME`` and ``TMPDIR`` = the working folder, ``LANG``, ``SANDBOX_RUN`` = its id)."""
        with self._slots:
            result = self._execute(list(argv), dict(files or {}), stdin, limits or self.limits,
                                   self.isolation == "namespaces", env)
        _USAGE.add(result)
        return result

    def run_python(self, code: str, files: Mapping[str, str | bytes] | None = None, stdin: str | bytes | None = None,
                   limits: Limits | None = None, packages: bool | None = None) -> ExecResult:
        """Python source run as ``main.py`` in the working folder (``python -E -s -B main.py``: its folder first on
        ``sys.path``, no environment variables of Python's; ``-S`` too, no installed packages, unless ``packages``,
        which defaults to the sandbox's)."""
        flags = ["-E", "-s", "-B"] + ([] if (self.packages if packages is None else packages) else ["-S"])
        return self.run([self.python, *flags, "main.py"], {**(files or {}), "main.py": code}, stdin, limits)

    def map(self, jobs: Iterable[Callable[[Sandbox], ExecResult]]) -> list[ExecResult]:
        """Each job (``lambda sandbox: sandbox.run_python(...)``) run, up to ``max_concurrency`` at once; the results
        in the jobs' order."""
        jobs = list(jobs)
        if len(jobs) <= 1:
            return [job(self) for job in jobs]
        with ThreadPoolExecutor(min(self.max_concurrency, len(jobs)), thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda job: job(self), jobs))

    # ------------------------------------------------------------------------------------------------------------
    def _execute(self, argv: list[str], files: dict[str, str | bytes], stdin: str | bytes | None, limits: Limits,
                 isolate: bool, env: Mapping[str, str] | None = None) -> ExecResult:
        run_id = uuid.uuid4().hex[:16]
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError(f"the sandbox runs a program by its absolute path, got {argv[:1]!r}")
        folder = tempfile.mkdtemp(prefix="polopt-sandbox-")
        start = time.monotonic()
        try:
            for name, content in files.items():
                path = Path(folder, name).resolve()
                if not path.is_relative_to(Path(folder).resolve()) or path == Path(folder).resolve():
                    raise ValueError(f"sandbox file {name!r} is outside the working folder")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content.encode() if isinstance(content, str) else content)
            work = "/sandbox" if isolate else folder
            variables = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
                         "SANDBOX_RUN": run_id, **(env or {})}
            spec = {"argv": argv, "env": variables, "files": folder, "limits": asdict(limits), "isolate": isolate,
                    "binds": self.binds, "parent": os.getpid()}
            spec_r, spec_w = os.pipe()
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", _LAUNCHER, str(spec_r)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, env={}, close_fds=True, pass_fds=(spec_r,),
                                        cwd=folder)
            finally:
                os.close(spec_r)
            try:  # after the start: a spec larger than a pipe's buffer would block a write before it
                with os.fdopen(spec_w, "wb") as f:
                    f.write(json.dumps(spec).encode())
            except BrokenPipeError:  # the launcher died first: its status says why
                pass
            try:
                out, err, timed_out, exceeded = _communicate(proc, stdin, limits)
            finally:
                _kill_group(proc)
            code = proc.returncode
            result = ExecResult(returncode=code if code >= 0 else 128 - code, timed_out=timed_out,
                                output_exceeded=exceeded, wall_s=time.monotonic() - start, run_id=run_id,
                                stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"))
            if code == _SETUP_FAILED and err.startswith(_SETUP_MARK):
                result.error = err[len(_SETUP_MARK):].decode("utf-8", "replace").strip()
            return result
        except OSError as exc:
            return ExecResult(returncode=None, error=f"the sandbox could not start: {exc}", run_id=run_id,
                              wall_s=time.monotonic() - start)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _communicate(proc: subprocess.Popen, stdin: str | bytes | None, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """The process's stdout and stderr, ``stdin`` written to it, until it ends, runs past ``limits.wall_s`` or writes
    more than ``limits.output_kib`` (then its group is killed): (stdout, stderr, timed out, output exceeded)."""
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    cap = int(limits.output_kib * 1024)
    deadline = time.monotonic() + limits.wall_s
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    total, timed_out, exceeded = 0, False, False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 0.5)):
                if key.fileobj is proc.stdin:
                    try:
                        sent = os.write(proc.stdin.fileno(), data[:65536])
                    except (BrokenPipeError, BlockingIOError) as exc:
                        sent = 0 if isinstance(exc, BlockingIOError) else len(data)
                    data = data[sent:]
                    if not data:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                chunks[key.fd].append(chunk[:max(cap - total, 0)])
                total += len(chunk)
                if total > cap:
                    exceeded = True
                    break
            if exceeded:
                break
            if proc.poll() is not None:
                # ended (its input unread, maybe): what its pipes still hold, no waiting on a process it left
                # holding them
                if any(k.fileobj is proc.stdin for k in sel.get_map().values()):
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                _drain(sel, chunks, cap - total)
                break
    if timed_out or exceeded:
        _kill_group(proc)
    proc.wait()
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd]), timed_out, exceeded


def _drain(sel: selectors.BaseSelector, chunks: dict[int, list[bytes]], room: int) -> None:
    for key, _ in sel.select(0):
        while room > 0:
            try:
                os.set_blocking(key.fd, False)
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks[key.fd].append(chunk[:room])
            room -= len(chunk)


def _kill_group(proc: subprocess.Popen) -> None:
    """The launcher's process group killed (with namespaces, its PID 1 follows it, and the namespace's processes
    with that), the launcher reaped, the pipes closed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass


def sandbox_from_config(config: Any) -> Sandbox:
    """A :class:`Sandbox` from a config mapping (``conf/sandbox``); ``None``: the defaults; anything else is taken as
    a sandbox already (a :class:`Sandbox`, or a client of a remote service with its ``run_python`` and ``map``)."""
    if config is not None and not isinstance(config, Mapping):
        return config
    config = dict(config or {})
    config.pop("_target_", None)
    return Sandbox(**config)

