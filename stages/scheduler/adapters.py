"""The scheduler's view of every registered adapter: its path, lifecycle state, whether its block is
staged in the host cache and how many loader pins the scheduler holds on it. Plain CPU code.

A slot load may only be issued for a block the scheduler holds a pin on (the loader never evicts a
pinned block, so the worker's copy can't race a reuse of those bytes); each pin is handed back with
ReleaseAdapter once the worker reports the copy done."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.loader import AdapterStaged


@dataclass
class AdapterEntry:
    name: str
    path: str
    state: str = "registered"  # "validating" (load op pending) | "registered" | "unloading" | "failed"
    staged: AdapterStaged | None = None  # where the host block is; None when not in the host cache
    pins: int = 0  # StageAdapter answers held (each released with one ReleaseAdapter)
    loads_in_flight: int = 0  # slot loads issued whose copy is not reported done
    staging: bool = False  # a StageAdapter is outstanding
    error: str = ""  # why it failed (state "failed")
    pending_ops: list[int] = field(default_factory=list)  # LoadAdapterOp ids awaiting validation

    @property
    def ready(self) -> bool:
        """A slot load can be issued now (a held pin not yet spent on a load in flight)."""
        return self.staged is not None and self.pins > self.loads_in_flight


class AdapterRegistry:
    def __init__(self, adapters: dict[str, str]):
        self.entries: dict[str, AdapterEntry] = {n: AdapterEntry(n, p) for n, p in adapters.items()}
        self._blocked: set[str] = set()  # refused for lack of host room: ask again after a release
        self.generation = 0  # bumped at every LoaderStarted: pins of an older loader are void

    def get(self, name: str) -> AdapterEntry | None:
        return self.entries.get(name)

    def usable(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.state == "registered"

    def ready(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.ready

    def needs_stage(self, name: str) -> bool:
        """True when a StageAdapter should be sent now (and marks it outstanding)."""
        e = self.entries.get(name)
        if e is None or e.staging or e.ready or e.state == "failed" or name in self._blocked:
            return False
        e.staging = True
        return True

    def on_staged(self, msg: AdapterStaged) -> AdapterEntry | None:
        e = self.entries.get(msg.name)
        if e is None:
            return None
        e.staging = False
        e.staged = msg
        e.pins += 1
        return e

    def on_failed(self, name: str, message: str) -> AdapterEntry | None:
        e = self.entries.get(name)
        if e is None:
            return None
        e.staging = False
        e.state, e.error = "failed", message
        return e

    def on_evicted(self, name: str) -> None:
        e = self.entries.get(name)
        if e is not None and e.pins == 0:
            e.staged = None

    def on_loader_restart(self) -> list[str]:
        """The host cache is empty again: forget every block and pin; returns the names that had a
        StageAdapter outstanding (to be sent again)."""
        self.generation += 1
        again = []
        for e in self.entries.values():
            if e.staging or e.state == "validating":
                again.append(e.name)
            e.staged, e.pins, e.staging = None, 0, False
        return again

    def load_issued(self, name: str) -> None:
        self.entries[name].loads_in_flight += 1

    def load_done(self, name: str, generation: int) -> bool:
        """The worker copied the block: spend the pin. True when a ReleaseAdapter must be sent (not
        for a load issued under a loader that has since restarted: the new one holds no such pin)."""
        e = self.entries.get(name)
        if e is None or e.loads_in_flight == 0:
            return False
        e.loads_in_flight -= 1
        if generation != self.generation:
            return False
        e.pins -= 1
        return True

    def release_spare_pin(self, name: str) -> bool:
        """Give back a pin no load needs (e.g. after validating a load op). True: send ReleaseAdapter."""
        e = self.entries.get(name)
        if e is None or e.pins <= e.loads_in_flight:
            return False
        e.pins -= 1
        return True

    def pinned_waiting(self) -> int:
        """Adapters staged and held for a slot load that has not been issued yet (bounded prefetch)."""
        return sum(1 for e in self.entries.values() if e.ready or e.staging)

    def held(self) -> int:
        """Host-cache blocks the scheduler keeps pinned or has asked for: must stay below capacity."""
        return sum(1 for e in self.entries.values() if e.pins or e.staging)

    def on_retry_later(self, name: str) -> None:
        e = self.entries.get(name)
        if e is not None:
            e.staging = False
            self._blocked.add(name)

    def released(self) -> None:
        """A pin went back to the loader: adapters refused for room may be asked for again."""
        self._blocked.clear()
