"""The scheduler's registry of adapters: each one's path, lifecycle state (an enum), where its host block
is, and the scheduler's hold on that block. Plain CPU code.

The scheduler is the one owner of holds: it sends StageAdapter only for a block it does not hold (the
answer, AdapterStaged, means the loader now keeps that block for it) and ReleaseAdapter exactly once
per hold, when no pool load of it is in flight and no waiting request still needs it loaded. The loader
keeps one "held" flag per block, set and cleared by those two messages; it counts nothing. A pool load
may only be issued for a held block (the loader never evicts one, so the worker's copy cannot race a
reuse of those bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from proto.loader import AdapterStaged


class AdapterState(Enum):
    VALIDATING = "validating"  # registered by a load op that waits for its first staging
    REGISTERED = "registered"  # usable by requests
    UNLOADING = "unloading"  # an unload op came: removed once no request uses it
    FAILED = "failed"  # it cannot be loaded (`error` says why)


@dataclass
class RegisteredAdapter:
    name: str
    path: str
    state: AdapterState = AdapterState.REGISTERED
    staged: AdapterStaged | None = None  # where the host block is; None when not in the host cache
    held: bool = False  # the loader keeps the block for us (AdapterStaged answered, not released since)
    staging: bool = False  # a StageAdapter is outstanding
    loads_in_flight: int = 0  # pool loads issued whose copy is not reported done
    error: str = ""
    pending_ops: list[int] = field(default_factory=list)  # LoadAdapterOp ids awaiting validation

    @property
    def ready(self) -> bool:
        """A pool load can be issued now."""
        return self.staged is not None and self.held


class AdapterRegistry:
    def __init__(self, adapters: dict[str, str]):
        self.entries: dict[str, RegisteredAdapter] = {n: RegisteredAdapter(n, p) for n, p in adapters.items()}
        self._blocked: set[str] = set()  # refused for lack of host room: ask again after a release
        self.generation = 0  # bumped at every LoaderStarted: holds of an older loader are void

    def get(self, name: str) -> RegisteredAdapter | None:
        return self.entries.get(name)

    def add_validating(self, name: str, path: str, op_id: int) -> None:
        self.entries[name] = RegisteredAdapter(name, path, AdapterState.VALIDATING, pending_ops=[op_id])

    def usable(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.state is AdapterState.REGISTERED

    def ready(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.ready

    def rows(self, name: str) -> int:
        """Rank rows a pool load of `name` takes (its largest rank; 0 until staged)."""
        e = self.entries.get(name)
        return e.staged.rank if e is not None and e.staged is not None else 0

    def needs_stage(self, name: str) -> bool:
        """True when a StageAdapter should be sent now (and marks it outstanding)."""
        e = self.entries.get(name)
        if e is None or e.staging or e.held or e.state is AdapterState.FAILED or name in self._blocked:
            return False
        e.staging = True
        return True

    def on_staged(self, msg: AdapterStaged) -> RegisteredAdapter | None:
        """The loader holds the block for us now; None (and nothing held) for an unknown name."""
        e = self.entries.get(msg.name)
        if e is None:
            return None
        e.staging, e.staged, e.held = False, msg, True
        return e

    def on_failed(self, name: str, message: str) -> RegisteredAdapter | None:
        e = self.entries.get(name)
        if e is None:
            return None
        e.staging = False
        e.state, e.error = AdapterState.FAILED, message
        return e

    def on_evicted(self, name: str) -> None:
        e = self.entries.get(name)
        if e is not None and not e.held:
            e.staged = None

    def on_loader_restart(self) -> list[str]:
        """The host cache is empty again: forget every block and hold; returns the names that had a
        StageAdapter outstanding (to be sent again)."""
        self.generation += 1
        again = []
        for e in self.entries.values():
            if e.staging or e.state is AdapterState.VALIDATING:
                again.append(e.name)
            e.staged, e.held, e.staging = None, False, False
        return again

    def load_issued(self, name: str) -> None:
        self.entries[name].loads_in_flight += 1

    def load_done(self, name: str) -> None:
        e = self.entries.get(name)
        if e is not None and e.loads_in_flight:
            e.loads_in_flight -= 1

    def release(self, name: str, needed: bool) -> bool:
        """Give the hold back if nothing needs it (no copy in flight, not `needed` by a waiting request
        that must load it). True: send ReleaseAdapter (a restarted loader voided every hold already)."""
        e = self.entries.get(name)
        if e is None or not e.held or e.loads_in_flight or needed:
            return False
        e.held = False
        self._blocked.clear()  # adapters refused for room may be asked for again
        return True

    def held_waiting(self) -> int:
        """Blocks held or asked for whose pool load has not been issued (bounded prefetch)."""
        return sum(1 for e in self.entries.values() if (e.held or e.staging) and not e.loads_in_flight)

    def held(self) -> int:
        """Host-cache blocks held or asked for: must stay below the host cache's capacity."""
        return sum(1 for e in self.entries.values() if e.held or e.staging)

    def refused(self) -> int:
        """Adapters the loader refused for lack of host room, not asked for again until a release."""
        return len(self._blocked)

    def on_retry_later(self, name: str) -> None:
        """The loader had no room for `name` now: ask again once a held or outstanding block is given
        back. With none left nothing would ever wake a blocked name, so every block is lifted then."""
        e = self.entries.get(name)
        if e is not None:
            e.staging = False
            if any(x.held or x.staging for x in self.entries.values()):
                self._blocked.add(name)
            else:
                self._blocked.clear()
