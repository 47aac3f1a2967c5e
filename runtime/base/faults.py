"""Fault injection for the failure tests: `LORAPIPE_INJECT_FAULT=STAGE:MESSAGE:TEXT[,...]` makes that
stage's handler raise on each message of type MESSAGE whose repr contains TEXT (an adapter name, a
request id), exactly where a bug would. Unset (every real deployment), it costs one attribute test per
message."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ENV = "LORAPIPE_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """What an injected fault raises (a stand-in for any bug in a handler)."""


@dataclass(frozen=True)
class FaultInjection:
    rules: tuple[tuple[str, str], ...] = ()  # (message type name, text in its repr)

    @classmethod
    def from_env(cls, stage: str) -> FaultInjection:
        rules = []
        for spec in filter(None, os.environ.get(ENV, "").split(",")):
            parts = spec.split(":", 2)
            if len(parts) != 3:
                raise ValueError(f"{ENV}: {spec!r} is not STAGE:MESSAGE:TEXT")
            if parts[0] == stage:
                rules.append((parts[1], parts[2]))
        return cls(tuple(rules))

    def check(self, msg: Any) -> None:
        if not self.rules:
            return
        kind = type(msg).__name__
        for want, text in self.rules:
            if kind == want and text in repr(msg):
                raise InjectedFault(f"injected fault: {kind} containing {text!r}")
