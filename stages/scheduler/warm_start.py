"""Start-up warming: the adapters registered with `--adapter` are staged into the host cache, in the order
given, as soon as the loader is up, and copied into free rows of the GPU adapter pool once the worker has
started, so that the first burst after "ready" finds them where a second burst would. It never evicts (no
host block, no pool resident), takes no hold and no rows while requests wait and gives back the holds
of copies it has not issued when one arrives (demand goes first), and stops a tier at the first sign
that it is full. Plain CPU code: it decides, AdapterLifecycle sends."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from proto.loader import AdapterStaged
from proto.plan import SlotLoad
from stages.scheduler.adapters import AdapterRegistry, AdapterState
from stages.scheduler.planner import Planner


class StartupWarmer:
    """`host_bytes`: the host cache's capacity (0: unknown, only an eviction stops the host pass);
    `max_blocks`: the optional cap on adapters in the host cache; `window`: warm stagings at once."""

    def __init__(
        self,
        adapters: AdapterRegistry,
        names: Iterable[str],
        host_bytes: int = 0,
        max_blocks: int | None = None,
        window: int = 8,
    ) -> None:
        self.adapters = adapters
        self.host: deque[str] = deque(names)  # to stage into the host cache, in the order given
        self.pool: deque[str] = deque()  # in the host cache now, to copy into the pool, in order
        self.host_bytes = host_bytes
        self.max_blocks = max_blocks
        self.window = max(1, window)
        self.asked: set[str] = set()  # host pass: a StageAdapter is outstanding
        self.holding: dict[str, None] = {}  # pool pass, in order: held (or asked) for a pool load to come
        self.largest = 0  # the largest block staged so far (the estimate for the next one)
        self.host_warmed = 0
        self.host_warmed_bytes = 0
        self.pool_warmed = 0

    @property
    def active(self) -> bool:
        return bool(self.host or self.asked or self.pool or self.holding)

    def wants(self, name: str) -> bool:
        """Keep `name`'s hold: a warm pool load of it is coming."""
        return name in self.holding

    # --- host pass ------------------------------------------------------------------------------------
    def to_stage(self, planner: Planner | None) -> list[str]:
        """Names to ask the loader for now (each marked outstanding in the registry)."""
        if planner is not None and planner.waiting:
            return []
        out: list[str] = []
        while self.host and len(self.asked) < self.window:
            if self._host_full(extra=len(self.asked) + 1):
                self.host.clear()
                break
            name = self.host.popleft()
            e = self.adapters.get(name)
            if e is None or e.state is not AdapterState.REGISTERED:
                continue
            if e.staged is not None:  # already in the host cache (staged for a request)
                self.pool.append(name)
            elif self.adapters.needs_stage(name):
                self.asked.add(name)
                out.append(name)
        return out

    def _host_full(self, extra: int) -> bool:
        if self.max_blocks is not None and self.host_warmed + extra > self.max_blocks:
            return True
        return bool(self.host_bytes) and self.host_warmed_bytes + extra * self.largest > self.host_bytes

    def on_staged(self, msg: AdapterStaged) -> None:
        if msg.name in self.asked:
            self.asked.discard(msg.name)
            self.host_warmed += 1
            self.host_warmed_bytes += msg.nbytes
            self.largest = max(self.largest, msg.nbytes)
            self.pool.append(msg.name)

    def on_evicted(self, name: str) -> None:
        """A block left the host cache: while the host pass runs, that means the cache is full."""
        if self.host or self.asked:
            self.host.clear()
        if name in self.pool:
            self.pool.remove(name)

    def on_failed(self, name: str, retryable: bool) -> None:
        """The loader refused `name` (retryable: no room now): the host pass stops there."""
        self.asked.discard(name)
        self.holding.pop(name, None)
        if retryable:
            self.host.clear()

    def stop(self) -> None:
        """The loader restarted (its cache is empty): warming ends."""
        self.host.clear()
        self.pool.clear()
        self.asked.clear()
        self.holding.clear()

    # --- pool pass ------------------------------------------------------------------------------------
    def yield_to_demand(self) -> list[str]:
        """A request waits: the pool pass gives up the holds it took for copies not issued yet (the
        request may need their room in the host cache, and their count in the cap of holds); the
        adapters stay cached, where demand finds them. Returns their names, to release."""
        dropped = list(self.holding)
        self.holding.clear()
        return dropped

    def pool_step(self, planner: Planner | None, loads: list[SlotLoad]) -> tuple[list[str], list[str]]:
        """Issue warm pool loads of the held names into `loads`; returns (names to ask the loader to hold
        now, names whose hold is no longer wanted). Only into free rows and ids, in order, until one does
        not fit; nothing while requests wait."""
        if planner is None or planner.waiting:
            return [], []
        table = planner.pool
        free_rows = table.rows.num_free - sum(self.adapters.rows(n) for n in self.holding)
        free_ids = table.free_ids - len(self.holding)
        ask: list[str] = []
        while self.pool and len(self.holding) < self.window:
            name = self.pool[0]
            e = self.adapters.get(name)
            if e is None or e.state is not AdapterState.REGISTERED or e.staged is None or table.get(name):
                self.pool.popleft()
                continue
            if e.staged.rank > free_rows or free_ids < 1:
                self.pool.clear()  # the pool is full: the rest stay in the host cache
                break
            self.pool.popleft()
            free_rows -= e.staged.rank
            free_ids -= 1
            if e.ready or self.adapters.needs_stage(name):  # held already, or asked for now
                self.holding[name] = None
                if not e.ready:
                    ask.append(name)
        dropped: list[str] = []
        for name in list(self.holding):
            e = self.adapters.get(name)
            if e is None or not e.ready:
                continue  # the loader has not answered yet
            del self.holding[name]
            if planner.residency.warm(name, loads):
                self.pool_warmed += 1
            else:
                dropped.append(name)
        return ask, dropped
