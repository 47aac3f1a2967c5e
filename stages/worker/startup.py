"""How long each part of the worker's start-up took, for one log line at ready: where a cold start's
seconds go (the interpreter and imports, the weights, the warm-up's plan and compiles, graph capture)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


class Phases:
    """Wall seconds of named start-up phases, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., T], *args, **kwargs) -> T:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def line(self) -> str:
        return seconds_line(self.seconds.items())


def seconds_line(parts: Iterable[tuple[str, float]]) -> str:
    """Named wall seconds as the start-up log line gives them: "name 1.2 s, other 0.3 s"."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in parts)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), interpreter start-up and imports included;
    None where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    # field 22 of stat (the 20th after the command's closing parenthesis): start time in clock ticks
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
