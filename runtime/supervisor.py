"""The launcher's view of its stage processes: `StageProcess` spawns `python -m <module> CONFIG.json` in
its own session (told the launcher's pid, so that it dies with it: `runtime.base.parent_death`), or
adopts the worker's process started before the launcher (`runtime.base.prestart`), watches its exit and
escalates SIGTERM → SIGKILL; `RestartBudget` bounds restarts. Owns no sockets (the control
ROUTER is `runtime.control_channel`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from runtime.base.parent_death import PARENT_PID_ENV
from runtime.base.prestart import PrestartedWorker

log = logging.getLogger("lorapipe.launcher")
ROOT = Path(__file__).resolve().parents[1]  # so `python -m stages.x` imports from any working dir


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


class _Adopted:
    """A stage process spawned before the event loop ran (`runtime.base.prestart`), with the part of
    asyncio's Process the launcher uses: its pid, its exit code once reaped, and `wait()`. A thread
    blocked in its wait reaps it and wakes the loop."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()

        def reap() -> None:
            code = popen.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, self._exited, code)

        threading.Thread(target=reap, name=f"reap-{popen.pid}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)  # an awaiter cancelled leaves the others waiting


def _settle(fut: asyncio.Future[int], code: int) -> None:
    if not fut.done():
        fut.set_result(code)


class StageProcess:
    """One stage process at a time (a restart replaces it); `on_exit(stage, generation, pid, code)` is
    called once per process, from the event loop, when it exits."""

    def __init__(
        self,
        name: str,
        module: str,
        config_path: Path,
        on_exit: Callable[[StageProcess, int, int, int], None],
        output: TextIO | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`env`: variables set for this stage on top of the launcher's environment."""
        self.name = name
        self.env = dict(env or {})
        self.argv = [sys.executable, "-m", module, str(config_path)]
        self.on_exit = on_exit
        self.output = output
        self.proc: asyncio.subprocess.Process | None = None
        self.generation = 0  # bumped by every start(); tells a stale exit from the current process's
        self.ready = False  # the current process sent Ready
        self._watcher: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Spawn the stage, from the event loop's thread (asyncio and uvloop fork there): the stage's
        death signal fires when that thread exits, so it must outlive every stage it starts."""
        env = dict(os.environ) | self.env
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env[PARENT_PID_ENV] = str(os.getpid())  # a stage whose parent is not this one exits at once
        out = self.output if self.output is not None else sys.stderr  # stdout stays the launcher's
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            # Ctrl-C in a terminal reaches only the launcher; the launcher's death reaches the stage by
            # the death signal stage_main arms, not by a process group
            start_new_session=True,
        )
        self.generation += 1
        self.ready = False
        log.info("started stage %r (pid %d)", self.name, self.proc.pid)
        self._watcher = asyncio.ensure_future(self._watch(self.proc, self.generation))

    async def adopt(self, worker: PrestartedWorker, output: str | None) -> None:
        """Take `worker`, started before the launcher checked its arguments, as this stage's process:
        hand it this stage's config, environment and output file (None: stderr), then watch it as if
        `start` had spawned it. A worker already gone is reported by its exit, as any stage's."""
        self.proc = _Adopted(worker.proc)  # type: ignore[assignment]
        self.generation += 1
        self.ready = False
        worker.hand_over(Path(self.argv[-1]), self.env, output)
        log.info("started stage %r (pid %d, its imports begun at launch)", self.name, self.proc.pid)
        self._watcher = asyncio.ensure_future(self._watch(self.proc, self.generation))

    async def _watch(self, proc: asyncio.subprocess.Process, generation: int) -> None:
        code = await proc.wait()
        self.on_exit(self, generation, proc.pid, code)

    def signal(self, sig: int) -> None:
        """Signal the stage's whole process group (its own session), if it still runs."""
        if self.alive:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    async def wait_exit(self, timeout: float, hurry: asyncio.Event | None = None) -> bool:
        """True once the process exited; False after `timeout`, or at once when `hurry` is set."""
        if not self.alive:
            return True
        assert self.proc is not None
        waits = [asyncio.ensure_future(self.proc.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self.alive

    async def terminate(self, grace_s: float, hurry: asyncio.Event | None = None) -> None:
        """Escalate: SIGTERM, then SIGKILL after `grace_s`. Returns once the process is gone."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self.alive:
                return
            log.warning("stage %r (pid %s) still running; sending %s", self.name, self.pid, sig.name)
            self.signal(sig)
            if await self.wait_exit(wait, hurry if sig == signal.SIGTERM else None):
                return
        log.error("stage %r (pid %s) survived SIGKILL", self.name, self.pid)

    def kill_now(self) -> None:
        """Last resort on the launcher's way out: never leave a child behind."""
        self.signal(signal.SIGKILL)


class RestartBudget:
    """At most `max_restarts` within `window_s`; a crash loop backs off exponentially."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: list[float] = []

    def charge(self) -> float | None:
        """Seconds to wait before the next restart (0 for the first in a while); None: exhausted."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            return None
        delay = min(0.25 * 2 ** len(self._times), 4.0) if self._times else 0.0
        self._times.append(now)
        return delay
