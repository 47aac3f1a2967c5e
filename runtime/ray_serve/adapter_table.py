"""A replica's view of the adapters its server holds: which Ray's multiplexer wants (one AdapterLease
each), how many requests use each, and which unloads are due. Ray evicts by LRU without knowing about
requests in flight, so an evicted adapter is unloaded only once its last request ended, and one asked
for again before that is kept. Runs on the replica's event loop; imports no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("lorapipe.ray_serve")


class AdapterLease:
    """What the multiplexed loader returns for one adapter. Ray calls `__del__` (in a worker thread)
    when it evicts the adapter; the garbage collector may call it again later. Either way the table
    hears of it once, on its own loop."""

    def __init__(self, table: AdapterTable, name: str) -> None:
        self.table = table
        self.name = name
        self._released = False

    def __del__(self) -> None:
        if self._released:
            return
        self._released = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server goes with the replica
            self.table.loop.call_soon_threadsafe(self.table.evict, self)


@dataclass
class _Entry:
    lease: AdapterLease | None  # None: evicted by Ray, unload due when `refs` reaches 0
    refs: int = 0  # requests in flight on this adapter
    unloading: asyncio.Task[None] | None = field(default=None)


class AdapterTable:
    """`admit(name)` (from the multiplexed loader) loads unless the server still holds it;
    `acquire`/`release` bracket each request; `evict(lease)` marks Ray's eviction. `loads` and `unloads`
    count server operations."""

    def __init__(
        self,
        load: Callable[[str], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._load = load
        self._unload = unload
        self.loop = loop
        self.entries: dict[str, _Entry] = {}
        self.loads = 0
        self.unloads = 0

    async def admit(self, name: str) -> AdapterLease:
        e = self.entries.get(name)
        if e is not None and e.unloading is not None:
            await asyncio.shield(e.unloading)  # let the unload finish, then load afresh
            e = self.entries.get(name)
        if e is not None:  # evicted, but requests still run on it: the server never let go
            e.lease = AdapterLease(self, name)
            return e.lease
        await self._load(name)  # raises: nothing recorded, Ray does not cache the adapter
        self.loads += 1
        lease = AdapterLease(self, name)
        self.entries[name] = _Entry(lease)
        return lease

    def acquire(self, name: str) -> None:
        """A request starts on `name` (call right after the multiplexed loader returned, no await between)."""
        self.entries[name].refs += 1

    def release(self, name: str) -> None:
        e = self.entries[name]
        e.refs -= 1
        if e.refs == 0 and e.lease is None:
            self._start_unload(name, e)

    def evict(self, lease: AdapterLease) -> None:
        e = self.entries.get(lease.name)
        if e is None or e.lease is not lease:  # an old lease of an adapter admitted again since
            return
        e.lease = None
        if e.refs == 0:
            self._start_unload(lease.name, e)

    def held(self) -> list[str]:
        """Adapters Ray counts as loaded here (evicted ones still draining excluded)."""
        return [name for name, e in self.entries.items() if e.lease is not None]

    def _start_unload(self, name: str, e: _Entry) -> None:
        e.unloading = self.loop.create_task(self._run_unload(name, e))

    async def _run_unload(self, name: str, e: _Entry) -> None:
        try:
            await self._unload(name)
            self.unloads += 1
        except Exception as exc:  # the server is gone or never had it: nothing is left to free
            log.warning("unloading adapter %r failed: %s", name, exc)
        finally:
            if self.entries.get(name) is e:
                del self.entries[name]
