"""Adapter load/unload ops and adapter reports on the scheduler: registering an adapter once the loader
has validated it, unloading it once no request uses it, and the listing and per-tier counts. Owns no
sockets: it puts op replies and adapter updates onto the actor's `to_tokenizer` mailbox."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from proto.client import AdapterEntry as ListedAdapter
from proto.loader import AdapterFailed, AdapterStaged, DropAdapter
from proto.pipeline import AdapterUpdate, LoadAdapterOp, OpDone, OpFailed, UnloadAdapterOp
from runtime.base.actor import Mailbox
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.adapters import AdapterRegistry, AdapterState
from stages.scheduler.metrics import TIERS, WAITING_TIERS
from stages.scheduler.planner import Planner

Fail = Callable[[str, str, str], Awaitable[None]]


class AdapterOps:
    def __init__(
        self, adapters: AdapterRegistry, lifecycle: AdapterLifecycle, to_tokenizer: Mailbox[Any], fail: Fail
    ) -> None:
        self.adapters = adapters
        self.lifecycle = lifecycle
        self.to_tokenizer = to_tokenizer
        self.fail = fail

    async def on_adapter_staged(self, msg: AdapterStaged) -> None:
        """A load op's adapter validated: it is registered (before the lifecycle decides on the hold)."""
        e = self.adapters.get(msg.name)
        if e is None or e.state is not AdapterState.VALIDATING:
            return
        e.state = AdapterState.REGISTERED
        await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="registered"))
        for op_id in e.pending_ops:
            await self.to_tokenizer.put(OpDone(op_id=op_id))
        e.pending_ops = []

    async def on_adapter_failed(self, msg: AdapterFailed, planner: Planner | None) -> None:
        if msg.retryable:
            self.adapters.on_retry_later(msg.name)  # staged again once held blocks are released
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
        if planner is not None:
            for r in [r for r in planner.waiting if r.adapter == e.name]:
                planner.abort(r.request_id)
                await self.fail(r.request_id, "adapter_load_failed", msg.message)

    async def on_load_adapter_op(self, op: LoadAdapterOp) -> None:
        e = self.adapters.get(op.name)
        if e is not None and e.state is not AdapterState.FAILED:
            if e.path == op.path and e.state is AdapterState.UNLOADING:
                # loaded again before its unload finished (a router's cache evicting and reloading it):
                # the adapter never left, so it simply stays
                e.state = AdapterState.REGISTERED
                await self.to_tokenizer.put(AdapterUpdate(name=op.name, state="registered"))
                return await self.to_tokenizer.put(OpDone(op_id=op.op_id))
            if e.path == op.path and e.state in (AdapterState.REGISTERED, AdapterState.VALIDATING):
                if e.state is AdapterState.VALIDATING:
                    e.pending_ops.append(op.op_id)
                    return
                return await self.to_tokenizer.put(OpDone(op_id=op.op_id))
            text = f"adapter {op.name!r} is already loaded from {e.path}; unload it first"
            if e.state is AdapterState.UNLOADING:
                why = "is still being unloaded; load it again once it is gone"
                text = f"adapter {op.name!r} (from {e.path}) {why}"
            return await self.to_tokenizer.put(OpFailed(op_id=op.op_id, kind="invalid_request", message=text))
        self.adapters.add_validating(op.name, op.path, op.op_id)
        await self.lifecycle.stage(op.name)

    async def on_unload_adapter_op(self, op: UnloadAdapterOp) -> None:
        e = self.adapters.get(op.name)
        if e is None or e.state not in (AdapterState.REGISTERED, AdapterState.FAILED):
            text = f"adapter {op.name!r} is not loaded"
            return await self.to_tokenizer.put(OpFailed(op_id=op.op_id, kind="unknown_adapter", message=text))
        e.state = AdapterState.UNLOADING
        await self.to_tokenizer.put(AdapterUpdate(name=op.name, state="unloading"))
        await self.to_tokenizer.put(OpDone(op_id=op.op_id))

    async def finish_unloads(self, planner: Planner | None) -> list[int]:
        """Remove unloading adapters once no request uses them and no copy of them is in flight;
        returns the ids they held, to be cleared by the next plan. The DropAdapter also ends a hold."""
        clears = []
        for e in [e for e in self.adapters.entries.values() if e.state is AdapterState.UNLOADING]:
            if e.loads_in_flight or (planner is not None and planner.users_of(e.name)):
                continue
            if planner is not None:
                lora_id = planner.evict_adapter(e.name)
                if lora_id is not None:
                    clears.append(lora_id)
            await self.lifecycle.release_hold(e.name)  # before the drop: the loader frees it at once
            del self.adapters.entries[e.name]
            await self.lifecycle.to_loader.put(DropAdapter(name=e.name))
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))
        return clears

    # --- reports ------------------------------------------------------------------------------------
    def tier_counts(self, planner: Planner | None) -> dict[str, int]:
        """Registered adapters by their fastest tier: resident in the GPU pool, being copied into it,
        the host cache, or only on disk."""
        counts = dict.fromkeys(TIERS, 0)
        for e in self.adapters.entries.values():
            res = planner.pool.get(e.name) if planner else None
            if res is not None:
                counts["loading" if res.loading else "gpu"] += 1
            else:
                counts["host" if e.staged is not None else "disk"] += 1
        return counts

    def waiting_tiers(self, planner: Planner | None) -> dict[str, int]:
        """Waiting requests by where their adapter is: in the pool (settled or being copied), its block
        held in the host cache, asked of the loader, or neither yet (`disk`); `base`: no adapter."""
        counts = dict.fromkeys(WAITING_TIERS, 0)
        for r in planner.waiting if planner else ():
            res = planner.pool.get(r.adapter) if r.adapter is not None else None
            e = self.adapters.get(r.adapter) if r.adapter is not None else None
            if r.adapter is None:
                tier = "base"
            elif res is not None:
                tier = "loading" if res.loading else "gpu"
            elif e is not None and e.ready:
                tier = "host"
            else:
                tier = "asked" if e is not None and e.staging else "disk"
            counts[tier] += 1
        return counts

    def hold_counts(self) -> dict[str, int]:
        """Host blocks the scheduler holds with no pool load issued (`waiting`), holds in all, StageAdapters
        outstanding, and adapters refused for host room until a hold is released."""
        return {
            "waiting": self.adapters.held_waiting(),
            "held": sum(e.held for e in self.adapters.entries.values()),
            "asked": sum(e.staging for e in self.adapters.entries.values()),
            "refused": self.adapters.refused(),
        }

    def listing(self, planner: Planner | None) -> list[ListedAdapter]:
        out = []
        for e in self.adapters.entries.values():
            lora_id = planner.pool.id_of(e.name) if planner else None
            tier = (
                "gpu"
                if lora_id is not None
                else ("host" if e.staged else ("loading" if e.staging else "disk"))
            )
            state = {AdapterState.REGISTERED: "ready", AdapterState.VALIDATING: "loading"}.get(
                e.state, e.state.value
            )
            out.append(
                ListedAdapter(
                    name=e.name,
                    path=e.path,
                    tier=tier,
                    slot=lora_id,
                    state=state,
                    rank=e.staged.rank if e.staged else 0,
                    active_requests=planner.users_of(e.name) if planner else 0,
                )
            )
        return out
