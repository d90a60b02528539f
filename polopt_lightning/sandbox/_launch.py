"""The sandbox's launcher: run as ``python -I -S _launch.py FD`` by :mod:`polopt_lightning.sandbox`, never imported.

The spec comes as JSON on the descriptor FD (a pipe): ``argv``, ``env``, ``files`` (a folder whose contents become the working folder), ``limits``,
``isolate`` (bool), ``binds`` (host paths shown read-only), ``parent`` (the trainer's pid). Standalone on purpose: it
imports nothing from the package and only the standard library, so it starts fast and trusts nothing on ``sys.path``.

With ``isolate`` the launcher (L) forks C, which enters new user, mount, PID, network, IPC and UTS namespaces and
forks the namespace's first process (I, PID 1), which builds a root of its own (a tmpfs: the ``binds`` read-only, a minimal
``/dev``, a fresh ``/proc``, the working folder a size-limited tmpfs at ``/sandbox``), pivots into it and forks the
program (P): P sets its resource limits, loses every capability (empty bounding set, ``SECBIT_NOROOT`` locked, no new
privileges; under root, it also becomes an unprivileged user: the kernel exempts root from the process limit) and
execs ``argv``. When P ends, I ends with its status, and the kernel kills whatever is left in the PID namespace; if L
dies, C and I are killed (``PR_SET_PDEATHSIG``), and so is everything under them. A setup failure prints one
line starting with ``polopt-sandbox:`` on stderr and exits 125. Without ``isolate``, L forks P alone (limits only).
"""

import ctypes
import errno
import json
import os
import platform
import resource
import shutil
import signal
import sys

SETUP_FAILED = 125
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
# SECBIT_NOROOT, its lock, NO_SETUID_FIXUP, its lock, KEEP_CAPS_LOCKED: uid 0 gets no capabilities at exec
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")
DROP_TO, NOBODY = 1000, 65534  # under root: the program's uid in the namespace, and the unprivileged uid it maps to

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise SetupError(f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")


def mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source or fstype} on {target}")


def prctl(option, arg):
    check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def locked_flags(path):
    """The mount flags of ``path`` a remount inside a user namespace must keep (the kernel refuses to clear them)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            flags |= ms
    return flags


def bind(src, root, writable=False):
    """``src`` shown at the same path under ``root``, read-only unless ``writable``; a symbolic link is copied as one."""
    target = root + src
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(src):
        if not os.path.lexists(target):
            os.symlink(os.readlink(src), target)
        return
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    mount(src, target, None, MS_BIND)  # not recursive: a mount under it stays out (it would stay writable)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | locked_flags(src) | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def build_root(spec):
    """I's work: the new root, pivoted into; the working folder ``/sandbox`` filled with the spec's files."""
    limits = spec["limits"]
    # no user namespace inside this one (its root would have every capability there: mounts, netfilter, ...), and no
    # System V shared memory, message queues or semaphores (memory no process limit counts): this namespace's sysctls
    for path, value in (("user/max_user_namespaces", "0"), ("kernel/shmmni", "0"), ("kernel/shmall", "0"),
                        ("kernel/msgmni", "0"), ("kernel/sem", "0 0 0 0")):
        write("/proc/sys/" + path, value)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = os.path.join(spec["files"], ".root")
    os.mkdir(root, 0o700)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    if any(b.startswith("/tmp/") for b in spec["binds"]):  # (an interpreter in a virtual environment under /tmp)
        # /tmp a writable tmpfs of its own, the folders shown under it mounted on it, rather than the working folder
        os.mkdir(root + "/tmp")
        mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={int(limits['disk_mib'])}m")
    for src in spec["binds"]:
        if os.path.lexists(src):
            bind(src, root)
    os.makedirs(root + "/dev", exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        bind("/dev/" + name, root, writable=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    mount(None, root + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/proc", exist_ok=True)
    try:  # a fresh /proc shows the namespace's processes only; where the kernel refuses (a container's masked
        # /proc), there is no /proc at all
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        pass
    work = root + "/sandbox"
    os.makedirs(work)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={int(limits['disk_mib'])}m")
    for name in os.listdir(spec["files"]):
        if name == ".root":
            continue
        src = os.path.join(spec["files"], name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(work, name))
    if spec.get("drop_to") is not None:  # the program runs as this uid of the namespace: its folder is its own
        for folder, _, names in os.walk(work):
            for name in [folder] + [os.path.join(folder, n) for n in names]:
                os.lchown(name, spec["drop_to"], spec["drop_to"])
    if not os.path.lexists(root + "/tmp"):  # /tmp is the working folder, unless a folder is shown under it
        os.symlink("sandbox", root + "/tmp")
    os.chdir(root)
    machine = platform.machine()
    if machine not in SYS_PIVOT_ROOT:
        raise SetupError(f"pivot_root: no system call number known for {machine}")
    check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    libc.sethostname(b"sandbox", 7)
    os.chdir("/sandbox")


def set_limits(limits, isolated, own_user):
    mib = 1 << 20
    pairs = [(resource.RLIMIT_CPU, max(1, int(limits["cpu_s"] + 0.999))),
             (resource.RLIMIT_AS, int(limits["memory_mib"]) * mib),
             (resource.RLIMIT_FSIZE, int(limits["file_mib"]) * mib),
             (resource.RLIMIT_NOFILE, int(limits["open_files"])),
             (resource.RLIMIT_CORE, 0)]
    if isolated:  # counted per user of the namespace: without a user of its own, C and PID 1 count too
        pairs.append((resource.RLIMIT_NPROC, int(limits["processes"]) + (0 if own_user else 2)))
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def drop_privileges(uid):
    """No capabilities now or after exec, none to gain (setuid files, file capabilities); with ``uid``, that user of
    the namespace (mapped to an unprivileged user outside: the kernel exempts root from the process limit)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL or cap == 0:
        raise SetupError(f"dropping capability {cap} from the bounding set: {os.strerror(ctypes.get_errno())}")
    prctl(PR_SET_SECUREBITS, SECUREBITS)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def exec_program(spec, isolated):
    """P: limits, no capabilities, then the program (never returns)."""
    try:
        if not isolated:
            os.chdir(spec["files"])
        set_limits(spec["limits"], isolated, spec.get("drop_to") is not None)
        if isolated:
            drop_privileges(spec.get("drop_to"))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; the program gets the defaults
            signal.signal(sig, signal.SIG_DFL)
        os.closerange(3, 1 << 16)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - reported, then the child ends
        fail(exc)


def fail(exc):
    try:
        sys.stderr.write(f"polopt-sandbox: {exc}\n")
        sys.stderr.flush()
    finally:
        os._exit(SETUP_FAILED)


def wait_for(pid, reap_all=False):
    """``pid``'s exit status as a shell's (128 + signal when killed); as PID 1, every orphan is reaped meanwhile."""
    while True:
        try:
            got, status = os.wait() if reap_all else os.waitpid(pid, 0)
        except InterruptedError:
            continue
        if got == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main():
    with os.fdopen(int(sys.argv[1]), "rb") as f:  # a pipe, not argv: /proc/<pid>/cmdline shows argv to the code
        spec = json.loads(f.read())
    isolated = bool(spec["isolate"])
    if sys.platform.startswith("linux"):  # elsewhere (no isolation there) the trainer kills the process group
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != spec["parent"]:  # the trainer died before the line above
            os._exit(SETUP_FAILED)
    if not isolated:
        pid = os.fork()
        if pid == 0:
            exec_program(spec, False)
        os._exit(wait_for(pid))
    uid, gid = os.geteuid(), os.getegid()
    # root maps the namespace's root to itself (to build the root) and spec["drop_to"] to "nobody", which the program
    # runs as; any other user maps its own uid to the namespace's root (the kernel allows no more), and keeps it
    privileged = uid == 0
    spec["drop_to"] = DROP_TO if privileged else None
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    me = os.getpid()
    child = os.fork()
    if child == 0:  # C: enters the namespaces; its first child is their PID 1
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != me:
                os._exit(SETUP_FAILED)
            check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                               | CLONE_NEWUTS), "unshare (user, mount, PID, network namespaces)")
            if privileged:  # the launcher writes the maps: it keeps root's capabilities outside
                os.write(ready_w, b"1")
                if os.read(go_r, 1) != b"1":
                    os._exit(SETUP_FAILED)
            else:
                write("/proc/self/setgroups", "deny")
                write("/proc/self/uid_map", f"0 {uid} 1")
                write("/proc/self/gid_map", f"0 {gid} 1")
        except (SetupError, OSError) as exc:
            fail(exc)
        namespace_init(spec)
    if privileged:
        try:
            if os.read(ready_r, 1) != b"1":
                os._exit(wait_for(child))
            write(f"/proc/{child}/uid_map", f"0 0 1\n{DROP_TO} {NOBODY} 1")
            write(f"/proc/{child}/gid_map", f"0 0 1\n{DROP_TO} {NOBODY} 1")
            os.write(go_w, b"1")
        except OSError as exc:
            os.kill(child, signal.SIGKILL)
            fail(SetupError(f"writing the user namespace's maps: {exc}"))
    os._exit(wait_for(child))


def namespace_init(spec):
    """C's work: fork the namespace's PID 1, which builds the root and runs the program, and end with its status."""
    me = os.getpid()
    init = os.fork()
    if init == 0:  # PID 1 of the namespace
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() not in (me, 0):
                os._exit(SETUP_FAILED)
            build_root(spec)
        except BaseException as exc:  # noqa: BLE001
            fail(exc)
        program = os.fork()
        if program == 0:
            exec_program(spec, True)
        os._exit(wait_for(program, reap_all=True))
    os._exit(wait_for(init))


if __name__ == "__main__":
    main()
