"""The scheduler's side of adapter movement: staging host blocks with the loader, its answers, the holds
the registry keeps, and the pool loads in flight. Owns no sockets: it puts StageAdapter/ReleaseAdapter
onto the actor's `to_loader` mailbox. The planner is passed to each call that needs it (None until the
worker has started)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from proto.loader import AdapterFailed, AdapterStaged, Evicted, ReleaseAdapter, StageAdapter
from proto.plan import SlotLoad, StepResult
from runtime.base.actor import Mailbox
from runtime.common.host_pool import slot_load_for
from stages.scheduler.adapters import AdapterRegistry
from stages.scheduler.metrics import SchedulerMetrics
from stages.scheduler.planner import Planner
from stages.scheduler.warm_start import StartupWarmer

log = logging.getLogger("scheduler")
Fail = Callable[[str, str, str], Awaitable[None]]  # (request_id, kind, message): fail one request


class AdapterLifecycle:
    def __init__(
        self,
        adapters: AdapterRegistry,
        to_loader: Mailbox[Any],
        fail: Fail,
        series: SchedulerMetrics,
        max_held: int | None,
        max_held_waiting: int,
        warmer: StartupWarmer | None = None,
    ) -> None:
        """`max_held`: host blocks held or asked for at most (None: no cap, the host cache's bytes bound it);
        `max_held_waiting`: of those, held for loads not issued yet (how far staging runs ahead);
        `warmer`: stages the start-up adapters into the host cache and the pool before any request (by
        default one with none to warm)."""
        self.adapters = adapters
        self.to_loader = to_loader
        self.fail = fail
        self.series = series
        self.max_held = max_held
        self.max_held_waiting = max_held_waiting
        self.pool_loads: dict[int, tuple[str, int]] = {}  # id -> (adapter, loader generation), copying
        self.loader_up = False
        self.restage: list[str] = []  # names a restarted loader must be asked for again
        self._host_looked: set[str] = set()  # adapters counted in host lookups since their last pool load
        self.warmer = warmer if warmer is not None else StartupWarmer(adapters, ())

    def load_bytes(self, name: str) -> int:
        e = self.adapters.get(name)
        return e.staged.nbytes if e is not None and e.staged is not None else 0

    # --- pool loads ---------------------------------------------------------------------------------
    def issue_load(self, load: SlotLoad) -> SlotLoad:
        """The planner names id, rows and adapter; the host block's whereabouts come from the loader."""
        self.adapters.load_issued(load.adapter)
        self._host_looked.discard(load.adapter)
        self.pool_loads[load.slot] = (load.adapter, self.adapters.generation)
        self.series.slot_loads.inc()
        runs = list(zip(load.row_starts, load.row_counts, strict=True))
        return slot_load_for(self.adapters.get(load.adapter).staged, load.slot, runs, load.layered)

    async def after_step(self, res: StepResult, planner: Planner) -> None:
        """Settle the pool loads a step result reports done or failed (the planner has seen it)."""
        await self.loads_ready(res.slots_ready, planner)
        for se in res.slot_errors:
            self.pool_loads.pop(se.slot, None)
            self.adapters.load_done(se.adapter)
            for r in [r for r in [*planner.running, *planner.waiting] if r.adapter == se.adapter]:
                planner.abort(r.request_id)
                await self.fail(r.request_id, "adapter_load_failed", se.message)
            planner.evict_adapter(se.adapter)
            await self._maybe_release(se.adapter, planner)

    async def loads_ready(self, ids: list[int], planner: Planner | None) -> None:
        for lora_id in ids:
            if planner is not None:
                planner.lora_ready(lora_id)
            name, _ = self.pool_loads.pop(lora_id, (None, -1))
            if name is not None:
                self.adapters.load_done(name)
                await self._maybe_release(name, planner)
        await self._restage()

    async def _maybe_release(self, name: str, planner: Planner | None) -> None:
        needed = planner is not None and name in planner.adapters_needed()
        needed = needed or self.warmer.wants(name)
        if self.adapters.release(name, needed):
            await self.to_loader.put(ReleaseAdapter(name=name))

    async def release_hold(self, name: str) -> None:
        if self.adapters.release(name, needed=False):
            await self.to_loader.put(ReleaseAdapter(name=name))

    async def release_unneeded(self, planner: Planner | None) -> None:
        """Give back holds no waiting request needs any more (e.g. its requests were aborted)."""
        needed = set(planner.adapters_needed()) if planner is not None else set()
        for e in list(self.adapters.entries.values()):
            if e.held and e.name not in needed and not e.pending_ops:
                await self.release_hold(e.name)

    def _stale_copies(self) -> bool:
        """Copies issued under a loader that restarted: their bytes may be reused by the new loader's
        placements, so nothing is staged until they are done."""
        return any(gen != self.adapters.generation for _, gen in self.pool_loads.values())

    # --- staging ------------------------------------------------------------------------------------
    async def stage_upcoming(self, planner: Planner) -> None:
        """Ask the loader for the host blocks of adapters the waiting queue needs next, in queue order;
        held blocks are never evicted, so this stays bounded."""
        if not self.loader_up or self._stale_copies():
            return
        if planner.waiting:  # demand goes first: warm holds must not keep its adapters out
            for name in self.warmer.yield_to_demand():
                await self._maybe_release(name, planner)
        full = self._staging_full()  # counted over every registered adapter: once, and after each ask
        for name in planner.adapters_needed():
            self._count_host_lookup(name)
            if full:
                return
            if self.adapters.needs_stage(name):
                await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))
                full = self._staging_full()

    def _staging_full(self) -> bool:
        """Whether the holds (or asks) for loads not issued yet, or all holds, are at their caps."""
        if self.adapters.held_waiting() >= self.max_held_waiting:
            return True
        return self.max_held is not None and self.adapters.held() >= self.max_held

    def _count_host_lookup(self, name: str) -> None:
        e = self.adapters.get(name)
        if name in self._host_looked or e is None:
            return
        self._host_looked.add(name)
        self.series.host_lookups.labels(result="hit" if e.staged is not None else "miss").inc()

    async def stage(self, name: str) -> None:
        """Ask for one block now (a load op's validation), if the loader is up and it is not held."""
        if self.loader_up and self.adapters.needs_stage(name):
            await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))

    async def on_loader_started(self) -> None:
        self.loader_up = True
        self.restage = self.adapters.on_loader_restart()
        if self.adapters.generation > 1:
            self.warmer.stop()  # a restarted loader: its cache is empty, demand refills it
        await self._restage()

    async def _restage(self) -> None:
        """Ask a restarted loader again for what the old one never answered (once stale copies end)."""
        if self._stale_copies():
            return
        again, self.restage = self.restage, []
        for name in again:
            await self.stage(name)

    async def on_adapter_staged(self, msg: AdapterStaged, planner: Planner | None) -> None:
        """Hold the block while a waiting request needs it loaded or a load op waits to validate;
        otherwise give it back at once."""
        self.warmer.on_staged(msg)
        e = self.adapters.on_staged(msg)
        if e is None:
            return await self.to_loader.put(ReleaseAdapter(name=msg.name))
        if not e.pending_ops:
            await self._maybe_release(e.name, planner)

    def on_evicted(self, msg: Evicted) -> None:
        self.adapters.on_evicted(msg.name)
        self.warmer.on_evicted(msg.name)

    def on_adapter_failed(self, msg: AdapterFailed) -> None:
        self.warmer.on_failed(msg.name, msg.retryable)

    # --- start-up warming ---------------------------------------------------------------------------
    async def warm(self, planner: Planner | None) -> list[SlotLoad]:
        """Ask the loader for the blocks the warmer wants staged or held, give back holds it no longer
        wants, and return its pool loads for the next plan (not issued yet)."""
        w = self.warmer
        if not w.active or not self.loader_up or self._stale_copies():
            return []
        loads: list[SlotLoad] = []
        hold, dropped = w.pool_step(planner, loads)
        for name in [*w.to_stage(planner), *hold]:
            await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))
        for name in dropped:
            await self._maybe_release(name, planner)
        if not w.active:
            mib = w.host_warmed_bytes / 2**20
            log.info(
                "start-up adapters warmed: %d staged into the host cache (%.1f MiB), %d copied into the "
                "GPU adapter pool", w.host_warmed, mib, w.pool_warmed
            )  # fmt: skip
        return loads
