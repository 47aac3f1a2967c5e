"""Runs a test module as a script in a child process, compiled rather than interpreted: this directory's
conftest makes kernels interpreted in the tests' own process, and an interpreted kernel cannot be
compiled for a `GPUTarget`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_compiled(
    script: str | os.PathLike, *args: str, timeout: float = 280, env: dict[str, str] | None = None
) -> list[str]:
    """The words `script` printed, run with `args` (and `env` added to this process's environment); fails
    with its stderr's tail if it exited non-zero."""
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    child["PYTHONPATH"] = os.pathsep.join([str(ROOT), child.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), *args], env=child, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.split()
