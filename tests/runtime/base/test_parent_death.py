"""`runtime.base.parent_death` in real processes: a middle process plays the launcher and spawns a child
that arms the death signal (and its watchdog); the test SIGKILLs the middle. A stopped child, which can
run no handler, is still gone within a deadline; a running one gets its signal first; a watchdog dies
with its child; a stage whose launcher went before the signal was armed exits at once."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.base.actor import EXIT_PARENT_DIED
from runtime.base.parent_death import PARENT_PID_ENV
from tests.integration.hostile import live_descendants, wait_until

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file is tests/runtime/base/)
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

# argv: the death signal, the expected parent, the watchdog's grace (negative: no watchdog)
CHILD = """
import os, signal, sys, time
from runtime.base.parent_death import arm, start_watchdog

sig, parent, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def graceful(*_):  # what an actor does on its death signal, if it is running at all
    print("graceful", flush=True)
    os._exit(0)

if sig != signal.SIGKILL:
    signal.signal(sig, graceful)
assert arm(sig, parent)
dog = start_watchdog(parent, grace) if grace >= 0 else None
print(os.getpid(), dog.pid if dog else 0, flush=True)
while True:
    time.sleep(60)
"""
# argv: the child's script, its death signal, its watchdog's grace; lives on after the child
MIDDLE = """
import os, subprocess, sys, time
script, sig, grace = sys.argv[1:]
subprocess.Popen([sys.executable, "-c", script, sig, str(os.getpid()), grace])
time.sleep(3600)
"""


def watching(pid: int) -> bool:
    """Whether `pid` holds a pidfd (the watchdog opens its parent's once its own death signal is armed)."""
    try:
        return any(os.readlink(fd) == "anon_inode:[pidfd]" for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


class Family:
    """The middle process (the child's parent) and the child it spawned, read from the child's line."""

    def __init__(self, sig: int, grace_s: float = -1.0) -> None:
        argv = [sys.executable, "-c", MIDDLE, CHILD, str(int(sig)), str(grace_s)]
        self.middle = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        child, dog = self.line().split()
        self.child, self.watchdog = int(child), int(dog)
        if self.watchdog:  # past its own arming, blocked on the parent's pidfd
            wait_until(lambda: watching(self.watchdog), "the watchdog to watch the parent", 20)

    def line(self, timeout: float = 20.0) -> str:
        assert self.middle.stdout is not None
        ready, _, _ = select.select([self.middle.stdout], [], [], timeout)
        assert ready, f"no line from the child in {timeout}s"
        return self.middle.stdout.readline().strip()

    def pids(self) -> list[int]:
        return [p for p in (self.child, self.watchdog) if p]

    def kill_middle(self) -> float:
        self.middle.kill()
        self.middle.wait()
        return time.monotonic()

    def close(self) -> None:
        """Never leave one behind, even when the test failed (SIGKILL reaches a stopped process)."""
        if self.middle.poll() is None:
            self.kill_middle()
        for line in live_descendants(self.pids()):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        assert self.middle.stdout is not None
        self.middle.stdout.close()


def test_a_stopped_child_is_killed_with_its_parent():
    family = Family(signal.SIGKILL)
    try:
        os.kill(family.child, signal.SIGSTOP)  # it can poll nothing now
        family.kill_middle()
        wait_until(lambda: not live_descendants([family.child]), "the child to die with its parent", 10)
    finally:
        family.close()


def test_the_watchdog_kills_a_stopped_child_after_its_grace():
    """The child handles its death signal (as an actor does), so only its watchdog can end it stopped."""
    family = Family(signal.SIGHUP, grace_s=0.5)
    try:
        os.kill(family.child, signal.SIGSTOP)
        died = family.kill_middle()
        wait_until(lambda: not live_descendants(family.pids()), "the watchdog to kill the child", 15)
        assert time.monotonic() - died >= 0.5, "killed before its grace"
    finally:
        family.close()


def test_a_running_child_gets_its_signal_before_the_watchdog_acts():
    family = Family(signal.SIGHUP, grace_s=30.0)
    try:
        family.kill_middle()
        assert family.line() == "graceful"
        wait_until(lambda: not live_descendants(family.pids()), "the child and its watchdog to exit", 10)
    finally:
        family.close()


def test_the_watchdog_dies_with_its_child():
    family = Family(signal.SIGHUP, grace_s=0.0)
    try:
        assert live_descendants([family.watchdog])
        os.kill(family.child, signal.SIGKILL)
        wait_until(lambda: not live_descendants([family.watchdog]), "the watchdog to die with its child", 10)
        assert family.middle.poll() is None  # the child's parent lives: nothing for the watchdog to do
    finally:
        family.close()


def test_a_stage_whose_launcher_is_gone_before_it_arms_exits_at_once(tmp_path):
    """The launcher names itself in PARENT_PID_ENV; a stage whose parent is another process (the
    launcher died, the stage was reparented) exits before it reads its config."""
    env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid() + 1)})
    argv = [sys.executable, "-m", "tests.runtime.echo_actor", str(tmp_path / "no-such-config.json")]
    assert subprocess.run(argv, cwd=ROOT, env=env, timeout=30).returncode == EXIT_PARENT_DIED
