"""Every move of an adapter between tiers (`adapters.py` draws them): host ranges placed in the host
table and written by the loader, blocks evicted, pool copies issued and completed, the loader's answers
and restarts, and start-up warming. Owns no sockets: it puts StageAdapter onto the actor's `to_loader`
mailbox. The planner is passed to each call that needs it (None until the worker has started)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from proto.loader import AdapterFailed, AdapterStaged, StageAdapter
from proto.plan import SlotError, SlotLoad
from runtime.base.actor import Mailbox
from runtime.common.host_pool import slot_load_for
from stages.scheduler.adapters import AdapterRegistry, AdapterState, HostTier, RegisteredAdapter
from stages.scheduler.host_table import HostTable
from stages.scheduler.metrics import SchedulerMetrics
from stages.scheduler.planner import Planner
from stages.scheduler.warm_start import StartupWarmer

log = logging.getLogger("scheduler")
Fail = Callable[[str, str, str], Awaitable[None]]  # (request_id, kind, message): fail one request
STAGEABLE = (AdapterState.REGISTERED, AdapterState.UNLOADING, AdapterState.VALIDATING)


def copy_failed(adapter: str, why: str) -> str:
    """The text a request gets when the worker failed to copy its adapter into the pool."""
    return f"the gpu-worker failed to copy adapter {adapter!r}: {why}"


class AdapterLifecycle:
    def __init__(
        self,
        adapters: AdapterRegistry,
        table: HostTable,
        max_block_bytes: int,
        to_loader: Mailbox[Any],
        fail: Fail,
        series: SchedulerMetrics,
        stage_ahead: int,
        warmer: StartupWarmer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_block_bytes`: the range a staging reserves while the adapter's rank is unknown;
        `stage_ahead`: adapters of the waiting queue staged ahead of their pool load, and writes in
        flight, at most; `warmer`: the start-up adapters to stage and copy before any request."""
        self.adapters = adapters
        self.table = table
        self.max_block_bytes = max_block_bytes
        self.to_loader = to_loader
        self.fail = fail
        self.series = series
        self.stage_ahead = stage_ahead
        self.clock = clock
        self.warmer = warmer if warmer is not None else StartupWarmer(())
        # pool id -> adapters whose copies into it are not reported yet, oldest first. A pipelined plan can
        # load an id again before the report of the copy a plan before it issued there (its adapter's
        # requests ended meanwhile); each report settles the oldest, so neither hold is dropped or
        # released before its own copy was reported.
        self.pool_loads: dict[int, list[str]] = {}
        self.loader_up = False
        self.copy_failures = 0  # pool copies the worker reported failed (its fault, not the adapter's)
        self.writes = 0  # adapters WRITING (kept by `_move`: the staging pass reads it every plan)
        self._write_ids = itertools.count(1)
        self._host_looked: set[str] = set()  # adapters counted in host lookups since their last pool load

    def load_bytes(self, name: str) -> int:
        e = self.adapters.get(name)
        return e.staged.nbytes if e is not None and e.staged is not None else 0

    # --- host tier transitions ----------------------------------------------------------------------
    def _move(self, e: RegisteredAdapter, tier: HostTier) -> None:
        self.writes += (tier is HostTier.WRITING) - (e.host is HostTier.WRITING)
        e.host = tier
        e.since = self.clock()
        if tier is not HostTier.HOST:
            e.staged = None

    async def _write(self, e: RegisteredAdapter, victims: Collection[str]) -> bool:
        """DISK → WRITING: reserve a range (evicting some of `victims`, or nothing if it cannot fit) and
        have the loader write it. False, with nothing changed, when there is no room."""
        placed = self.table.place(e.name, e.nbytes or self.max_block_bytes, victims)
        if placed is None:
            return False
        offset, evicted = placed
        for name in evicted:
            self._evicted(self.adapters.entries[name])
        e.write_id = next(self._write_ids)
        self._move(e, HostTier.WRITING)
        capacity = self.table.get(e.name).size
        await self.to_loader.put(StageAdapter(e.name, e.path, offset, capacity, e.write_id))
        return True

    def _evicted(self, e: RegisteredAdapter) -> None:
        """HOST → DISK: the table already gave its range away (it had no copy in flight)."""
        assert e.evictable, f"adapter {e.name!r} evicted while {e.host.value} with {e.copies} copies"
        self._move(e, HostTier.DISK)
        self.series.host_evictions.inc()
        self.warmer.on_evicted(e.name)

    def _drop_range(self, e: RegisteredAdapter) -> None:
        """Back to DISK, freeing the range (a write that failed or was lost, or an unload)."""
        self.table.free(e.name)
        self._move(e, HostTier.DISK)

    def _victims(self, needed: Collection[str], later: list[str] = ()) -> list[str]:
        """Blocks a staging may evict, in order: those no waiting request needs (least recently used
        first), then those needed only behind it in the queue (`later`, the furthest first). A block
        that a pool copy reads, or a range being written, is never among them."""
        entries = self.adapters.entries
        free = [n for n in self.table.lru() if n not in needed and entries[n].evictable]
        return free + [n for n in reversed(later) if entries[n].evictable]

    # --- pool loads ---------------------------------------------------------------------------------
    def issue_load(self, load: SlotLoad) -> SlotLoad:
        """The planner names id, rows and adapter; the block's range comes from the staged answer. The
        block is held (not evicted) until the copy is reported done."""
        e = self.adapters.entries[load.adapter]
        assert e.ready, f"pool load of {load.adapter!r} whose block is {e.host.value}"
        e.copies += 1
        e.since = self.clock()
        self.table.touch(e.name)
        self._host_looked.discard(load.adapter)
        self.pool_loads.setdefault(load.slot, []).append(load.adapter)
        self.series.slot_loads.inc()
        runs = list(zip(load.row_starts, load.row_counts, strict=True))
        return slot_load_for(e.staged, load.slot, runs, load.layered)

    def _copy_done(self, name: str) -> None:
        e = self.adapters.get(name)
        if e is not None and e.copies:
            e.copies -= 1
            e.since = self.clock()

    async def settle_loads(self, ready: list[int], errors: list[SlotError], planner: Planner | None) -> None:
        """Settle the pool loads a step result (or SlotsReady) reports done or failed. A failed copy is
        the worker's fault: its adapter's requests fail with `stage_failed` and its id is freed."""
        self.loads_ready(ready, planner)
        self.copy_failures += len(errors)
        for se in errors:
            if self._settle(se.slot, se.adapter) is not None:
                self._copy_done(se.adapter)
            if planner is None:
                continue
            text = copy_failed(se.adapter, se.message)
            for r in [r for r in [*planner.running, *planner.waiting] if r.adapter == se.adapter]:
                planner.abort(r.request_id)
                await self.fail(r.request_id, "stage_failed", text)
            planner.evict_adapter(se.adapter)

    def loads_ready(self, ids: list[int], planner: Planner | None) -> None:
        for lora_id in ids:
            if planner is not None:
                planner.lora_ready(lora_id)
            name = self._settle(lora_id)
            if name is not None:
                self._copy_done(name)

    def _settle(self, lora_id: int, adapter: str | None = None) -> str | None:
        """Take the oldest unreported copy into `lora_id` (of `adapter`, when named) off its list; returns
        its adapter, or None where there is none."""
        names = self.pool_loads.get(lora_id)
        if not names or (adapter is not None and adapter not in names):
            return None
        name = names.pop(0 if adapter is None else names.index(adapter))
        if not names:
            del self.pool_loads[lora_id]
        return name

    # --- staging ------------------------------------------------------------------------------------
    async def stage_upcoming(self, planner: Planner) -> None:
        """Stage the blocks of the adapters the waiting queue needs next, in queue order, up to
        `stage_ahead` of them and of writes in flight; a staging evicts only blocks no nearer request
        needs, and the first that finds no room ends the pass (the rest would need room too)."""
        if not self.loader_up:
            return
        await self._stage_validating(planner)
        needed = planner.adapters_needed()[: self.stage_ahead]
        wanted = set(needed)
        writes = self.writes
        for pos, name in enumerate(needed):
            e = self.adapters.get(name)
            if e is None:
                continue
            self._count_host_lookup(e)
            if e.host is not HostTier.DISK or e.state not in STAGEABLE:
                continue
            if writes >= self.stage_ahead:
                return
            if not await self._write(e, self._victims(wanted, needed[pos + 1 :])):
                return
            writes += 1

    async def _stage_validating(self, planner: Planner | None) -> None:
        """Load ops wait for their adapter's first staging: ask for it whenever there is room."""
        if not self.adapters.validating:
            return
        needed = set(planner.adapters_needed()) if planner is not None else set()
        for name in sorted(self.adapters.validating):
            e = self.adapters.entries[name]
            if e.host is HostTier.DISK and not await self._write(e, self._victims(needed)):
                return

    def _count_host_lookup(self, e: RegisteredAdapter) -> None:
        if e.name in self._host_looked:
            return
        self._host_looked.add(e.name)
        (self.series.host_hits if e.host is HostTier.HOST else self.series.host_misses).inc()

    async def stage(self, name: str) -> None:
        """Ask for one block now (a load op's validation), if there is room."""
        e = self.adapters.get(name)
        if self.loader_up and e is not None and e.host is HostTier.DISK:
            await self._write(e, self._victims(()))

    async def on_loader_started(self) -> None:
        """A (re)started loader answers no write the last one had in flight: their ranges are freed and
        staged again on demand. Blocks already packed stay valid (the pool outlives the loader)."""
        self.loader_up = True
        for e in self.adapters.entries.values():
            if e.host is HostTier.WRITING:
                self._drop_range(e)
                self.warmer.on_failed(e.name)
        await self._stage_validating(None)

    def _current(self, name: str, write_id: int) -> RegisteredAdapter | None:
        """The adapter whose outstanding write this answers; None for an answer to a write given up."""
        e = self.adapters.get(name)
        if e is None or e.host is not HostTier.WRITING or e.write_id != write_id:
            return None
        return e

    def on_adapter_staged(self, msg: AdapterStaged) -> RegisteredAdapter | None:
        """WRITING → HOST, the range trimmed to the block's own bytes; None for a stale answer."""
        e = self._current(msg.name, msg.write_id)
        if e is None:
            return None
        self.table.shrink(e.name, msg.nbytes)
        e.nbytes = msg.nbytes
        self._move(e, HostTier.HOST)
        e.staged = msg
        self.warmer.on_staged(msg)
        return e

    def on_adapter_failed(self, msg: AdapterFailed) -> RegisteredAdapter | None:
        """WRITING → DISK, the range freed; None for a stale answer."""
        e = self._current(msg.name, msg.write_id)
        if e is None:
            return None
        self._drop_range(e)
        self.warmer.on_failed(e.name)
        return e

    def remove(self, e: RegisteredAdapter) -> None:
        """An unloaded adapter leaves (no copy in flight, no write outstanding: the caller checked)."""
        assert e.copies == 0 and e.host is not HostTier.WRITING
        self.table.free(e.name)
        self.adapters.validating.discard(e.name)
        del self.adapters.entries[e.name]

    # --- start-up warming ---------------------------------------------------------------------------
    async def warm(self, planner: Planner | None) -> list[SlotLoad]:
        """Stage the start-up adapters into free host room (never evicting) and copy them into free pool
        rows, in the order given; returns the pool loads for the next plan (not issued yet). Nothing
        while requests wait: demand goes first, and evicts warmed blocks like any other."""
        w = self.warmer
        if not w.active or not self.loader_up or (planner is not None and planner.waiting):
            return []
        for name in w.to_stage(self.adapters):
            if not await self._write(self.adapters.entries[name], ()):
                w.host_full()
                break
            w.asked.add(name)
        loads = w.pool_step(self.adapters, planner) if planner is not None else []
        if not w.active:
            mib = w.host_warmed_bytes / 2**20
            log.info(
                "start-up adapters warmed: %d staged into the host cache (%.1f MiB), %d copied into the "
                "GPU adapter pool", w.host_warmed, mib, w.pool_warmed
            )  # fmt: skip
        return loads
