"""The worker's process started before `lorapipe serve` checks its arguments (runtime/base/prestart.py):
the device it is told, that one never handed over is killed and reaped (also when the command line is
refused: no process outlives `lorapipe serve`), and that one whose launcher went away exits by itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.base.actor import EXIT_PARENT_DIED
from runtime.base.prestart import PRESTARTED, PrestartedWorker, device_hint

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_hint_follows_the_command_line():
    assert device_hint(["--model", "m", "--device", "cpu"]) == "cpu"
    assert device_hint(["--device=cpu", "--model", "m"]) == "cpu"
    assert device_hint(["--model", "m", "--device", "cuda"]) == "cuda"
    assert device_hint(["--model", "m"]) == "cuda"  # the default where a GPU is: cuda
    assert device_hint(["--model", "m", "--device"]) == ""  # argparse refuses it later
    assert device_hint([]) == "cuda"


def test_a_worker_never_handed_over_is_killed_and_reaped():
    worker = PrestartedWorker("cpu")
    worker.kill()
    assert worker.proc.returncode == -9 and not worker.adopted
    assert not Path(f"/proc/{worker.pid}").exists()  # reaped: not even a zombie left


def test_a_worker_whose_launcher_is_gone_exits_by_itself():
    """End-of-file on its stdin (the launcher's end of the pipe closed, as when it dies) ends it once its
    imports are done, with the code of a stage whose parent died and no traceback."""
    worker = PrestartedWorker("cpu")
    assert worker.proc.stdin is not None
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=120) == EXIT_PARENT_DIED


def _prestarted_children_of(pid: int) -> list[int]:
    """Live processes started as a prestarted worker by the process `pid` (its pid in their environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if PRESTARTED.encode() in cmd and f"LORAPIPE_PARENT_PID={pid}".encode() in env:
            found.append(int(proc.name))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_a_refused_command_line_leaves_no_worker_behind(tmp_path):
    """The worker starts before the arguments are read; `lorapipe serve` refusing them (exit 2) kills it
    first. One left behind would still be importing torch when the command has returned."""
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "serve",
        "--model",
        str(tmp_path / "no-model"),
        "--device",
        "cpu",
    ]
    with open(tmp_path / "stderr", "w") as err:  # a file: a pipe would wait for the worker's end too
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=err)
        assert proc.wait(timeout=60) == 2
    assert "no-model" in (tmp_path / "stderr").read_text()
    assert _prestarted_children_of(proc.pid) == []
