"""The scheduler's registry of adapters: one record per adapter, with its lifecycle state, its host tier
(disk, a range being written, a packed block) and the holds on that block. Plain CPU code.

The scheduler is the one owner of adapter state. It places every host block (`host_table.py`), tells
the loader where to write it, and evicts only blocks no pool copy reads; the loader and the worker act
on its commands and keep no table of their own. The transitions, and who makes them:

    DISK ──stage (range reserved)──► WRITING ──AdapterStaged──► HOST ──evict (no copy in flight)──► DISK
                 ▲                      │ AdapterFailed, loader restart       │ pool load: copies += 1
                 └──────────────────────┘ (range freed)                       └ copy done: copies -= 1

All of them are made by `AdapterLifecycle`; the GPU tier (pool rows) is the planner's `PoolTable`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from proto.loader import AdapterStaged


class AdapterState(Enum):
    VALIDATING = "validating"  # registered by a load op that waits for its first staging
    REGISTERED = "registered"  # usable by requests
    UNLOADING = "unloading"  # an unload op came: removed once no request uses it
    FAILED = "failed"  # it cannot be loaded (`error` says why)


class HostTier(Enum):
    DISK = "disk"  # no host range
    WRITING = "writing"  # a range is reserved and the loader is writing it (StageAdapter `write_id`)
    HOST = "host"  # packed in its range: a pool load may copy it


@dataclass
class RegisteredAdapter:
    name: str
    path: str
    state: AdapterState = AdapterState.REGISTERED
    host: HostTier = HostTier.DISK
    staged: AdapterStaged | None = None  # the loader's answer, while `host` is HOST
    nbytes: int = 0  # its block's bytes once staged (0: unknown; a staging then reserves the largest)
    write_id: int = 0  # the outstanding StageAdapter's, while WRITING
    copies: int = 0  # pool loads in flight reading its block: it is not evicted meanwhile
    since: float = 0.0  # when its tier last changed (the adapter-wait timeout counts from here)
    error: str = ""
    pending_ops: list[int] = field(default_factory=list)  # LoadAdapterOp ids awaiting validation
    # which registration of this name it is: cached KV prefixes are keyed by it, so an adapter unloaded
    # and loaded again (perhaps with other weights) never reads the KV of the earlier one
    generation: int = 0

    @property
    def ready(self) -> bool:
        """A pool load can be issued now."""
        return self.host is HostTier.HOST

    @property
    def evictable(self) -> bool:
        return self.host is HostTier.HOST and self.copies == 0


class AdapterRegistry:
    def __init__(self, adapters: dict[str, str]):
        self._generations = itertools.count(1)
        self.entries: dict[str, RegisteredAdapter] = {
            n: RegisteredAdapter(n, p, generation=next(self._generations)) for n, p in adapters.items()
        }
        self.validating: set[str] = set()  # names whose state is VALIDATING (a load op waits on them)

    def get(self, name: str) -> RegisteredAdapter | None:
        return self.entries.get(name)

    def add_validating(self, name: str, path: str, op_id: int, now: float) -> None:
        self.entries[name] = RegisteredAdapter(
            name,
            path,
            AdapterState.VALIDATING,
            since=now,
            pending_ops=[op_id],
            generation=next(self._generations),
        )
        self.validating.add(name)

    def usable(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.state is AdapterState.REGISTERED

    def ready(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and e.ready

    def generation(self, name: str) -> int:
        e = self.entries.get(name)
        return e.generation if e is not None else 0

    def rows(self, name: str) -> int:
        """Rank rows a pool load of `name` takes (its largest rank; 0 until staged)."""
        e = self.entries.get(name)
        return e.staged.rank if e is not None and e.staged is not None else 0

    def count(self, tier: HostTier) -> int:
        return sum(1 for e in self.entries.values() if e.host is tier)

    def copies(self) -> int:
        return sum(e.copies for e in self.entries.values())
