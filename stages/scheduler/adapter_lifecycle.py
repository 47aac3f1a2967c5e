"""The scheduler's side of the adapter lifecycle: staging host blocks with the loader, its answers, load
and unload ops, the pins held and the slot copies in flight. Owns no sockets: it puts onto the actor's
`to_loader` (stage/release/drop) and `to_tokenizer` (op replies, adapter updates) mailboxes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from proto.client import AdapterEntry as ListedAdapter
from proto.loader import AdapterFailed, AdapterStaged, DropAdapter, Evicted, ReleaseAdapter, StageAdapter
from proto.pipeline import AdapterUpdate, LoadAdapterOp, OpDone, OpFailed, UnloadAdapterOp
from proto.plan import SlotLoad, StepResult
from runtime.base.actor import Mailbox
from runtime.common.host_pool import slot_load_for
from stages.scheduler.adapters import AdapterEntry, AdapterRegistry
from stages.scheduler.config import SchedulerConfig
from stages.scheduler.metrics import TIERS, SchedulerMetrics
from stages.scheduler.planner import Planner

Fail = Callable[[str, str, str], Awaitable[None]]  # (request_id, kind, message): fail one request


class AdapterLifecycle:
    """Plain state owned by the scheduler actor, which routes every loader answer and adapter op here and
    sets `planner` once the worker has started."""

    def __init__(
        self,
        config: SchedulerConfig,
        to_loader: Mailbox[Any],
        to_tokenizer: Mailbox[Any],
        fail: Fail,
        series: SchedulerMetrics,
    ) -> None:
        self.config = config
        self.to_loader = to_loader
        self.to_tokenizer = to_tokenizer
        self.fail = fail
        self.series = series
        self.adapters = AdapterRegistry(dict(config.adapters))
        self.planner: Planner | None = None  # the actor's, once the worker says how many KV pages it has
        self.slot_loads: dict[int, tuple[str, int]] = {}  # slot -> (adapter, loader generation), copying
        self.loader_up = False
        self.restage: list[str] = []  # names a restarted loader must be asked for again
        self._host_looked: set[str] = set()  # adapters counted in host lookups since their last slot load

    def load_bytes(self, name: str) -> int:
        e = self.adapters.get(name)
        return e.staged.nbytes if e is not None and e.staged is not None else 0

    # --- slot copies --------------------------------------------------------------------------------
    async def after_step(self, res: StepResult) -> None:
        """Settle the slot copies a step result reports done or failed (the planner has seen it)."""
        await self.slots_ready(res.slots_ready)
        await self._restage()
        for se in res.slot_errors:
            _, gen = self.slot_loads.pop(se.slot, (se.adapter, -1))
            if self.adapters.load_done(se.adapter, gen):
                await self._release(se.adapter)
            for r in [r for r in [*self.planner.running, *self.planner.waiting] if r.adapter == se.adapter]:
                self.planner.abort(r.request_id)
                await self.fail(r.request_id, "adapter_load_failed", se.message)
            self.planner.evict_adapter(se.adapter)

    async def slots_ready(self, slots: list[int]) -> None:
        for slot in slots:
            if self.planner is not None:
                self.planner.slot_ready(slot)
            name, gen = self.slot_loads.pop(slot, (None, -1))
            if name is not None and self.adapters.load_done(name, gen):
                await self._release(name)

    async def _release(self, name: str) -> None:
        self.adapters.released()
        await self.to_loader.put(ReleaseAdapter(name=name))

    def issue_load(self, load: SlotLoad) -> SlotLoad:
        """The planner names slot and adapter; the host block's whereabouts come from the loader."""
        self.adapters.load_issued(load.adapter)
        self._host_looked.discard(load.adapter)
        self.slot_loads[load.slot] = (load.adapter, self.adapters.generation)
        self.series.slot_loads.inc()
        return slot_load_for(self.adapters.get(load.adapter).staged, load.slot, load.layered)

    def _stale_copies(self) -> bool:
        """Copies issued under a loader that restarted: their bytes may be reused by the new loader's
        placements, so nothing is staged until they are done."""
        return any(gen != self.adapters.generation for _, gen in self.slot_loads.values())

    # --- staging ------------------------------------------------------------------------------------
    async def stage_upcoming(self) -> None:
        """Ask the loader for the host blocks of adapters the waiting queue needs next, at most one
        slot's worth each: held blocks are pinned in the host cache, so this stays bounded."""
        if not self.loader_up or self._stale_copies():
            return
        for name in self.planner.adapters_needed():
            self._count_host_lookup(name)
            if self.adapters.pinned_waiting() >= self.config.max_loras_per_batch:
                return
            cap = self.config.max_cpu_loras
            if cap is not None and self.adapters.held() >= cap:
                return
            if self.adapters.needs_stage(name):
                await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))

    def _count_host_lookup(self, name: str) -> None:
        if name in self._host_looked or self.adapters.get(name) is None:
            return
        self._host_looked.add(name)
        e = self.adapters.get(name)
        self.series.host_lookups.labels(result="hit" if e.staged is not None else "miss").inc()

    async def on_loader_started(self) -> None:
        self.loader_up = True
        self.restage = self.adapters.on_loader_restart()
        await self._restage()

    async def _restage(self) -> None:
        """Ask a restarted loader again for what the old one never answered (once stale copies end)."""
        if self._stale_copies():
            return
        again, self.restage = self.restage, []
        for name in again:
            if self.adapters.needs_stage(name):
                await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))

    async def on_adapter_staged(self, msg: AdapterStaged) -> None:
        e = self.adapters.on_staged(msg)
        if e is None:
            return await self._release(msg.name)
        if e.state == "validating":
            e.state = "registered"
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="registered"))
            for op_id in e.pending_ops:
                await self.to_tokenizer.put(OpDone(op_id=op_id))
            e.pending_ops = []
        if self.planner is None or e.name not in self.planner.adapters_needed():
            if self.adapters.release_spare_pin(e.name):
                await self._release(e.name)

    async def on_adapter_failed(self, msg: AdapterFailed) -> None:
        if msg.retryable:
            self.adapters.on_retry_later(msg.name)  # staged again once pinned blocks are released
            return
        e = self.adapters.on_failed(msg.name, msg.message)
        if e is None:
            return
        for op_id in e.pending_ops:
            await self.to_tokenizer.put(
                OpFailed(op_id=op_id, kind="adapter_load_failed", message=msg.message)
            )
        if e.pending_ops:  # a load op: nothing was registered
            del self.adapters.entries[e.name]
        await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))
        if self.planner is not None:
            for r in [r for r in self.planner.waiting if r.adapter == e.name]:
                self.planner.abort(r.request_id)
                await self.fail(r.request_id, "adapter_load_failed", msg.message)

    def on_evicted(self, msg: Evicted) -> None:
        self.adapters.on_evicted(msg.name)

    # --- ops ----------------------------------------------------------------------------------------
    async def on_load_adapter_op(self, op: LoadAdapterOp) -> None:
        e = self.adapters.get(op.name)
        if e is not None and e.state != "failed":
            if e.path == op.path and e.state in ("registered", "validating"):
                if e.state == "validating":
                    e.pending_ops.append(op.op_id)
                    return
                return await self.to_tokenizer.put(OpDone(op_id=op.op_id))
            text = f"adapter {op.name!r} is already loaded from {e.path}; unload it first"
            return await self.to_tokenizer.put(OpFailed(op_id=op.op_id, kind="invalid_request", message=text))
        self.adapters.entries[op.name] = AdapterEntry(
            op.name, op.path, state="validating", pending_ops=[op.op_id]
        )
        if self.loader_up and self.adapters.needs_stage(op.name):
            await self.to_loader.put(StageAdapter(name=op.name, path=op.path))

    async def on_unload_adapter_op(self, op: UnloadAdapterOp) -> None:
        e = self.adapters.get(op.name)
        if e is None or e.state not in ("registered", "failed"):
            text = f"adapter {op.name!r} is not loaded"
            return await self.to_tokenizer.put(OpFailed(op_id=op.op_id, kind="unknown_adapter", message=text))
        e.state = "unloading"
        await self.to_tokenizer.put(AdapterUpdate(name=op.name, state="unloading"))
        await self.to_tokenizer.put(OpDone(op_id=op.op_id))

    async def finish_unloads(self) -> list[int]:
        """Remove unloading adapters once no request uses them and no copy of them is in flight;
        returns the slots they held, to be cleared by the next plan."""
        clears = []
        for e in [e for e in self.adapters.entries.values() if e.state == "unloading"]:
            if e.loads_in_flight or (self.planner is not None and self.planner.users_of(e.name)):
                continue
            if self.planner is not None:
                slot = self.planner.evict_adapter(e.name)
                if slot is not None:
                    clears.append(slot)
            del self.adapters.entries[e.name]
            await self.to_loader.put(DropAdapter(name=e.name))
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))
        return clears

    # --- reports ------------------------------------------------------------------------------------
    def tier_counts(self) -> dict[str, int]:
        """Registered adapters by their fastest tier: a settled GPU slot, a slot being copied into,
        the host cache, or only on disk."""
        counts = dict.fromkeys(TIERS, 0)
        for e in self.adapters.entries.values():
            slot = self.planner.slots.slot_of(e.name) if self.planner else None
            if slot is not None:
                counts["loading" if self.planner.slots.is_loading(slot) else "gpu"] += 1
            else:
                counts["host" if e.staged is not None else "disk"] += 1
        return counts

    def listing(self) -> list[ListedAdapter]:
        out = []
        for e in self.adapters.entries.values():
            slot = self.planner.slots.slot_of(e.name) if self.planner else None
            tier = (
                "gpu" if slot is not None else ("host" if e.staged else ("loading" if e.staging else "disk"))
            )
            state = {"registered": "ready", "validating": "loading"}.get(e.state, e.state)
            users = self.planner.users_of(e.name) if self.planner else 0
            rank = e.staged.rank if e.staged else 0
            out.append(
                ListedAdapter(
                    name=e.name,
                    path=e.path,
                    tier=tier,
                    slot=slot,
                    state=state,
                    rank=rank,
                    active_requests=users,
                )
            )
        return out
