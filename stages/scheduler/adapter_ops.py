"""Adapter load/unload ops and adapter reports on the scheduler: registering an adapter once the loader
has validated it, unloading it once no request uses it, failing what waited on an adapter that cannot be
staged, and the listing and per-tier counts. Owns no sockets: it puts op replies and adapter updates
onto the actor's `to_tokenizer` mailbox."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from proto.client import AdapterEntry as ListedAdapter
from proto.loader import AdapterFailed
from proto.pipeline import AdapterUpdate, LoadAdapterOp, OpDone, OpFailed, UnloadAdapterOp
from runtime.base.actor import Mailbox
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.adapters import AdapterRegistry, AdapterState, HostTier, RegisteredAdapter
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

    async def on_adapter_staged(self, e: RegisteredAdapter) -> None:
        """A load op's adapter validated (its first staging): it is registered."""
        if e.state is not AdapterState.VALIDATING:
            return
        e.state = AdapterState.REGISTERED
        self.adapters.validating.discard(e.name)
        await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="registered"))
        for op_id in e.pending_ops:
            await self.to_tokenizer.put(OpDone(op_id=op_id))
        e.pending_ops = []

    async def on_adapter_failed(
        self, e: RegisteredAdapter, msg: AdapterFailed, planner: Planner | None
    ) -> None:
        """A write failed. The adapter's own fault (its files) makes it FAILED; the loader's (a handler
        error) fails only what waited on this write, and the adapter may be staged again later."""
        kind = "stage_failed" if msg.stage_fault else "adapter_load_failed"
        for op_id in e.pending_ops:
            await self.to_tokenizer.put(OpFailed(op_id=op_id, kind=kind, message=msg.message))
        validating = e.state is AdapterState.VALIDATING
        if validating:  # a load op: nothing was registered
            self.lifecycle.remove(e)
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))
        elif not msg.stage_fault:
            e.state, e.error = AdapterState.FAILED, msg.message
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))
        if planner is not None:
            for r in [r for r in planner.waiting if r.adapter == e.name]:
                planner.abort(r.request_id)
                await self.fail(r.request_id, kind, msg.message)

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
        self.adapters.add_validating(op.name, op.path, op.op_id, self.lifecycle.clock())
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
        """Remove unloading adapters once no request uses them, no copy reads their block and no write
        to it is outstanding; returns the ids they held, to be cleared by the next plan."""
        clears = []
        for e in [e for e in self.adapters.entries.values() if e.state is AdapterState.UNLOADING]:
            if e.copies or e.host is HostTier.WRITING or (planner is not None and planner.users_of(e.name)):
                continue
            if planner is not None:
                lora_id = planner.evict_adapter(e.name)
                if lora_id is not None:
                    clears.append(lora_id)
                planner.pages.drop_adapter(e.name)  # a later load of the name has a new generation too
            self.lifecycle.remove(e)
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
                counts["host" if e.ready else "disk"] += 1
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
                tier = "asked" if e is not None and e.host is HostTier.WRITING else "disk"
            counts[tier] += 1
        return counts

    def hold_counts(self) -> dict[str, int]:
        """Holds on host blocks: pool copies reading them, and writes the loader has not answered."""
        return {"copies": self.adapters.copies(), "writes": self.adapters.count(HostTier.WRITING)}

    def host_blocks(self, state: str) -> int:
        """Adapters in the host cache: packed (`resident`), of those being copied into the pool
        (`copying`), or ranges being written (`writing`)."""
        if state == "writing":
            return self.adapters.count(HostTier.WRITING)
        if state == "copying":
            return sum(1 for e in self.adapters.entries.values() if e.ready and e.copies)
        return self.adapters.count(HostTier.HOST)

    def listing(self, planner: Planner | None) -> list[ListedAdapter]:
        out = []
        for e in self.adapters.entries.values():
            lora_id = planner.pool.id_of(e.name) if planner else None
            tier = (
                "gpu"
                if lora_id is not None
                else ("host" if e.ready else ("loading" if e.host is HostTier.WRITING else "disk"))
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
