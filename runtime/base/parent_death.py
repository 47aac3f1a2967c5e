"""Dying with one's parent (Linux; elsewhere no-ops): `arm` has the kernel signal this process when its
parent dies (PR_SET_PDEATHSIG), and `start_watchdog` starts a tiny child that SIGKILLs this process a
grace period after its parent died, for a process that handles that signal but may be too hung (stopped,
blocked in C) to act on it. Run as a script, this file is that watchdog: standard library only."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

PARENT_PID_ENV = "LORAPIPE_PARENT_PID"  # set by a spawner to its own pid: the parent its child expects
PR_SET_PDEATHSIG = 1
LINUX = sys.platform.startswith("linux")
POLL_S = 0.25  # how the watchdog waits where the kernel has no pidfd_open (before Linux 5.3)


def spawner_pid() -> int | None:
    """The pid the spawner named in PARENT_PID_ENV (None if none), taken out of the environment so
    that this process's own children never inherit it."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def arm(sig: int, parent: int) -> bool:
    """Have the kernel send `sig` to this process when the thread that spawned it exits (so the spawner
    must spawn from a thread that lives as long as it), and again as each thread of the parent it is
    handed to exits: a handler tells the parent's death by `os.getppid()` changing. False when `parent`
    is no longer this process's parent (it died before the signal was armed): the caller should exit."""
    if LINUX:
        libc = ctypes.CDLL(None, use_errno=True)
        args = [ctypes.c_ulong(a) for a in (sig, 0, 0, 0)]  # prctl is variadic: whole words
        if libc.prctl(PR_SET_PDEATHSIG, *args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {sig}): {os.strerror(err)}")
    return os.getppid() == parent


def start_watchdog(parent: int, grace_s: float) -> subprocess.Popen[bytes] | None:
    """Start this process's watchdog (None off Linux, or with no parent to watch): once `parent` is gone
    it gives this process `grace_s` to exit, then SIGKILLs it (its whole process group, when it leads
    one). It dies with this process (SIGKILL as its death signal), so call this from the main thread."""
    if not LINUX or parent <= 1:
        return None
    argv = [
        sys.executable,
        "-I",
        "-S",
        os.path.abspath(__file__),
        str(os.getpid()),
        str(parent),
        str(grace_s),
    ]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _wait_orphaned(target: int, parent: int) -> None:
    """Return once `parent` is no longer `target`'s parent."""
    try:
        fd = os.pidfd_open(parent)
    except OSError:  # gone already (ESRCH), or a kernel without pidfds: poll
        fd = -1
    if fd >= 0 and _parent_of(target) == parent:  # so the pidfd is of that parent, alive once opened
        select.select([fd], [], [])  # readable when it exits
    while _parent_of(target) == parent:
        time.sleep(POLL_S)


def _watch(target: int, parent: int, grace_s: float) -> None:
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # meant for the target's process group, which we are in
    if not arm(signal.SIGKILL, target):
        return  # the target is gone already
    _wait_orphaned(target, parent)
    time.sleep(grace_s)  # the target exiting by itself in the meantime kills us (our death signal)
    print(
        f"lorapipe watchdog: pid {target} outlived its parent {parent} by {grace_s:g}s; killing it",
        file=sys.stderr,
        flush=True,
    )
    try:
        if os.getpgid(target) == target:
            os.killpg(target, signal.SIGKILL)  # its children too (and this watchdog)
        else:
            os.kill(target, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
