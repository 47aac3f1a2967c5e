"""The gpu-worker's process, started by `lorapipe serve` before it imports and checks its arguments: the
worker's interpreter and imports (torch's take seconds) then run beside the launcher's own start instead
of after it. The process waits, its imports done, for one JSON line on its stdin: its config file, the
environment the launcher gives a stage and where its output goes (`stages/worker/__main__.py`). The
launcher adopts it as the worker stage (`runtime.supervisor.StageProcess.adopt`); one never adopted is
killed and reaped (`kill`), and one whose launcher is gone reads end-of-file and exits. Standard library
only: the CLI starts it first thing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime.base.parent_death import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]  # so `python -m stages.worker` imports from any working dir
PRESTARTED = "--prestarted"  # the worker's first argument: wait for the config on stdin


def device_hint(argv: Sequence[str]) -> str:
    """The --device a `serve` command line names ("cuda" where it names none: the default on a machine
    with a GPU); the worker makes that device's CUDA context while it imports."""
    words = list(argv)
    for a, b in zip(words, [*words[1:], ""], strict=False):  # the last word pairs with ""
        if a.startswith("--device="):
            return a.partition("=")[2]
        if a == "--device":
            return b
    return "cuda"


class PrestartedWorker:
    """`python -m stages.worker --prestarted DEVICE`, in its own session (as every stage), told this
    process's pid (it dies with it, as every stage)."""

    def __init__(self, device: str, module: str = "stages.worker") -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env[PARENT_PID_ENV] = str(os.getpid())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, PRESTARTED, device],
            stdin=subprocess.PIPE,
            stdout=2,  # stdout is the launcher's own (its banner): a stage writes to stderr
            env=env,
            start_new_session=True,  # as StageProcess: signals reach its group, not the terminal's
        )
        self.adopted = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hand_over(self, config: Path, env: Mapping[str, str], output: str | None) -> bool:
        """Send the worker its config path, its stage environment and its output file (None: keep the
        launcher's stderr), and close its stdin. False when it is gone already (its exit says why)."""
        line = json.dumps({"config": str(config), "env": dict(env), "output": output}) + "\n"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode())  # one short line: the pipe's buffer holds it
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            return False
        self.adopted = True
        return True

    def kill(self) -> None:
        """Kill its whole session and reap it (it was never handed over, or the launcher gives up)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        self.proc.wait()


def read_hand_over(stream) -> dict | None:
    """The launcher's line (`PrestartedWorker.hand_over`); None at end-of-file (the launcher is gone, or
    gave up on this start)."""
    line = stream.readline()
    return json.loads(line) if line.strip() else None
