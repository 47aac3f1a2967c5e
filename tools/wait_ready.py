"""Waits until a `lorapipe serve` answers health checks and prints the seconds since `--since` (a Unix
time, e.g. when the server was launched): the time-to-ready of start-up benchmarks.
    python -m tools.wait_ready tcp://127.0.0.1:7450 --since "$(date +%s.%N)" --pid $SERVER"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from runtime.client import Client, LorapipeError


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Between probes: a start-up benchmark's time to ready is late by up to this much (its timeline's part
# "health seen ok by the client after the scheduler's Ready", benchmarks/cold_start_report.py).
POLL_S = 0.02


def wait_ready(endpoint: str, deadline_s: float, pid: int | None = None, poll_s: float = POLL_S) -> bool:
    """True once the server's health reply says ok; False on the deadline or when `pid` has exited."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pid is not None and not alive(pid):
            return False
        try:
            with Client(endpoint, timeout=2.0, connect_timeout=1.0) as client:
                if client.health().ok:
                    return True
        except LorapipeError:
            pass
        time.sleep(poll_s)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.wait_ready", description=__doc__)
    p.add_argument("endpoint", help="the server's client endpoint")
    p.add_argument("--since", type=float, default=None, help="Unix time to count from (default: now)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S", help="give up after S seconds")
    p.add_argument("--pid", type=int, default=None, help="stop waiting when this process exits")
    ns = p.parse_args(argv)
    since = time.time() if ns.since is None else ns.since
    if not wait_ready(ns.endpoint, ns.timeout, ns.pid):
        print(f"{ns.endpoint} not ready (server exited or {ns.timeout:g} s passed)", file=sys.stderr)
        return 1
    print(f"{time.time() - since:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
