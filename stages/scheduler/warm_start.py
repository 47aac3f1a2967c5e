"""Start-up warming: the adapters registered with `--adapter` are staged into the host cache, in the order
given, as soon as the loader is up, and copied into free rows of the GPU adapter pool once the worker has
started, so that the first burst after "ready" finds them where a second burst would. It only fills free
room (it never evicts a host block or a pool resident), takes no hold beyond the copies it issues, and
does nothing while requests wait; what it warmed is evicted by demand like anything else, so it never
keeps the first requests' adapters out. Plain CPU code: it decides, AdapterLifecycle moves."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from proto.loader import AdapterStaged
from proto.plan import SlotLoad
from stages.scheduler.adapters import AdapterRegistry, AdapterState, HostTier
from stages.scheduler.planner import Planner


class StartupWarmer:
    """`window`: warm stagings outstanding at once."""

    def __init__(self, names: Iterable[str], window: int = 8) -> None:
        self.host: deque[str] = deque(names)  # to stage into the host cache, in the order given
        self.pool: deque[str] = deque()  # in the host cache now, to copy into the pool, in order
        self.window = max(1, window)
        self.asked: set[str] = set()  # a warm StageAdapter is outstanding
        self.host_warmed = 0
        self.host_warmed_bytes = 0
        self.pool_warmed = 0

    @property
    def active(self) -> bool:
        return bool(self.host or self.asked or self.pool)

    def to_stage(self, adapters: AdapterRegistry) -> list[str]:
        """Names to write now (the caller stops at the first with no room, then calls `host_full`);
        adapters already staged (for a request) go straight to the pool pass."""
        out: list[str] = []
        while self.host and len(self.asked) + len(out) < self.window:
            name = self.host.popleft()
            e = adapters.get(name)
            if e is None or e.state is not AdapterState.REGISTERED:
                continue
            if e.host is HostTier.HOST:
                self.pool.append(name)
            elif e.host is HostTier.DISK:
                out.append(name)
        return out

    def host_full(self) -> None:
        """No free host room is left: the rest stay on disk until requests need them."""
        self.host.clear()

    def on_staged(self, msg: AdapterStaged) -> None:
        if msg.name in self.asked:
            self.asked.discard(msg.name)
            self.host_warmed += 1
            self.host_warmed_bytes += msg.nbytes
            self.pool.append(msg.name)

    def on_evicted(self, name: str) -> None:
        if name in self.pool:
            self.pool.remove(name)

    def on_failed(self, name: str) -> None:
        self.asked.discard(name)

    def pool_step(self, adapters: AdapterRegistry, planner: Planner) -> list[SlotLoad]:
        """Pool loads of staged warm adapters into free rows and ids, in order, until one does not fit."""
        loads: list[SlotLoad] = []
        while self.pool:
            name = self.pool[0]
            e = adapters.get(name)
            if e is None or not e.ready or planner.pool.get(name) is not None:
                self.pool.popleft()
                continue
            if not planner.residency.warm(name, loads):
                self.pool.clear()  # the pool is full: the rest stay in the host cache
                break
            self.pool.popleft()
            self.pool_warmed += 1
        return loads
