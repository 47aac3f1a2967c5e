"""How long each part of the worker's start-up took, for one log line at ready: where a cold start's
seconds go (the interpreter and imports, the weights, the warm-up's plan and compiles, graph capture)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# Seconds a worker started before its launcher checked the arguments (runtime/base/prestart.py) waited,
# its imports done, for its config: set by `python -m stages.worker --prestarted`, 0 otherwise.
config_wait_s = 0.0


class Phases:
    """Wall seconds of named start-up phases, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., T], *args, **kwargs) -> T:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Seconds of a phase timed by the caller (they add to the phase's earlier ones)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def line(self, digits: int = 1) -> str:
        return seconds_line(self.seconds.items(), digits)


def seconds_line(parts: Iterable[tuple[str, float]], digits: int = 1) -> str:
    """Named wall seconds as the start-up log lines give them: "name 1.2 s, other 0.3 s"."""
    return ", ".join(f"{name} {s:.{digits}f} s" for name, s in parts)


def process_age(pid: int | str = "self") -> float | None:
    """Seconds since process `pid` (default: this one) started (Linux: /proc), interpreter start-up and
    imports included; None where /proc does not tell (no /proc, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    # field 22 of stat (the 20th after the command's closing parenthesis): start time in clock ticks
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def started_after(parent: int) -> float | None:
    """When this process started on `parent`'s clock (seconds after `parent` started): the stages' start-up
    lines and the launcher's count from the same moment, its launch. None where /proc does not tell."""
    own, theirs = process_age(), process_age(parent)
    return None if own is None or theirs is None else theirs - own
