"""The scheduler stage actor. Sockets: PULLs bound for tokenizer, worker and loader messages (one
`events` mailbox, so all state changes in one handler); PUSHes to worker (plans), tokenizer (failures,
op replies, adapter updates) and loader (stage/release/drop). Plans step N+1 while step N runs."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from proto.client import AdapterEntry as ListedAdapter
from proto.client import StageHealth
from proto.loader import (
    AdapterFailed,
    AdapterStaged,
    DropAdapter,
    Evicted,
    LoaderStarted,
    LoaderToScheduler,
    ReleaseAdapter,
    SchedulerToLoader,
    StageAdapter,
)
from proto.pipeline import (
    AbortRequest,
    AdapterListing,
    AdapterUpdate,
    HealthProbe,
    HealthStatus,
    ListAdaptersOp,
    LoadAdapterOp,
    OpDone,
    OpFailed,
    RequestFailed,
    SchedulerToTokenizer,
    TokenizedRequest,
    TokenizerToScheduler,
    UnloadAdapterOp,
)
from proto.plan import (
    BatchPlan,
    SchedulerToWorker,
    SlotLoad,
    SlotsReady,
    StepResult,
    WorkerStarted,
    WorkerToScheduler,
)
from runtime.actor import Actor
from runtime.sockets import PullSocket, PushSocket
from stages.loader.host_pool import slot_load_for
from stages.scheduler.adapters import AdapterEntry, AdapterRegistry
from stages.scheduler.config import SchedulerConfig
from stages.scheduler.planner import Planner, PlannerConfig


class SchedulerActor(Actor[SchedulerConfig]):
    stage = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.adapters = AdapterRegistry(dict(config.adapters))
        self.planner: Planner | None = None  # built once the worker says how many KV pages it has
        self.early: list[TokenizedRequest] = []
        self.in_flight: dict[int, BatchPlan] = {}
        self.slot_loads: dict[int, tuple[str, int]] = {}  # slot -> (adapter, loader generation), copying
        self.pending_clears: list[int] = []
        self.loader_up = False
        self.restage: list[str] = []
        self._init_metrics()

    def _init_metrics(self) -> None:
        m = self.metrics
        m.gauge("lorapipe_waiting_requests", "Requests waiting for admission").set_function(
            lambda: len(self.planner.waiting) if self.planner else len(self.early)
        )
        m.gauge("lorapipe_running_requests", "Requests in the running batch").set_function(
            lambda: len(self.planner.running) if self.planner else 0
        )
        m.gauge("lorapipe_kv_pages_used", "KV pages allocated").set_function(
            lambda: self.planner.pages.num_used if self.planner else 0
        )
        m.gauge("lorapipe_kv_pages_free", "KV pages free").set_function(
            lambda: self.planner.pages.num_free if self.planner else 0
        )
        m.gauge("lorapipe_slot_refs", "Running requests referencing LoRA slots").set_function(
            lambda: sum(s.refs for s in self.planner.slots.slots) if self.planner else 0
        )
        self.m_plans = m.counter("lorapipe_plans", "Batch plans sent to the worker")
        self.m_slot_loads = m.counter("lorapipe_slot_loads", "Adapter copies into GPU slots issued")
        self.m_preemptions = m.counter("lorapipe_preemptions", "Requests preempted for KV pages")
        self.m_lookups = m.counter(
            "lorapipe_slot_lookups",
            "Admissions of adapter requests: adapter already in a slot or not",
            ["result"],
        )
        self.m_failed = m.counter("lorapipe_requests_failed", "Requests failed by the scheduler", ["kind"])
        tiers = m.gauge("lorapipe_adapters_by_tier", "Registered adapters by where they are", ["tier"])
        for tier in ("gpu", "loading", "host", "disk"):
            tiers.labels(tier=tier).set_function(lambda tier=tier: self._tier_counts()[tier])
        self.m_host_lookups = m.counter(
            "lorapipe_host_lookups",
            "Adapters needed for a slot: block already in the host cache (hit) or read from disk (miss)",
            ["result"],
        )
        self.m_adapter_wait = m.histogram(
            "lorapipe_adapter_wait_seconds",
            "Arrival to admission of requests that waited for their adapter to load",
            (),
            [2**i / 1e3 for i in range(16)],
        )
        self._host_looked: set[str] = set()  # adapters counted in host lookups since their last slot load

    async def setup(self) -> None:
        self.idle = asyncio.Event()
        self.idle.set()
        ep = self.config.endpoints
        events = self.mailbox("events")
        self.to_worker = self.mailbox("plans", 4)
        self.to_tokenizer = self.mailbox("to_tokenizer")
        self.to_loader = self.mailbox("to_loader")
        for name, addr, union in (
            ("tokenizer", ep.tokenizer_to_scheduler, TokenizerToScheduler),
            ("worker", ep.worker_to_scheduler, WorkerToScheduler),
            ("loader", ep.loader_to_scheduler, LoaderToScheduler),
        ):
            self.add_receiver(name, self.socket(PullSocket(addr, union)), events)
        worker = self.socket(PushSocket(ep.scheduler_to_worker, SchedulerToWorker, bind=False))
        tokenizer = self.socket(PushSocket(ep.scheduler_to_tokenizer, SchedulerToTokenizer, bind=False))
        loader = self.socket(PushSocket(ep.scheduler_to_loader, SchedulerToLoader, bind=False))
        self.add_handler("events", events, self.handle)
        self.add_sender("worker", self.to_worker, worker.send)
        self.add_sender("tokenizer", self.to_tokenizer, tokenizer.send)
        self.add_sender("loader", self.to_loader, loader.send)

    def _is_idle(self) -> bool:
        return not (self.early or self.in_flight or (self.planner and self.planner.has_work))

    async def drain(self) -> None:
        """Keep stepping until every accepted request has finished and the worker is idle."""
        await self.idle.wait()
        await super().drain()

    async def handle(self, msg: Any) -> None:
        match msg:
            case TokenizedRequest():
                await self.on_tokenized_request(msg)
            case AbortRequest(request_id=rid):
                if self.planner is not None:
                    self.planner.abort(rid)
                self.early = [r for r in self.early if r.request_id != rid]
            case StepResult():
                await self.on_step_result(msg)
            case SlotsReady():
                await self._slots_ready(msg.slots_ready)
            case WorkerStarted():
                await self.on_worker_started(msg)
            case LoaderStarted():
                await self.on_loader_started()
            case AdapterStaged():
                await self.on_adapter_staged(msg)
            case AdapterFailed():
                await self.on_adapter_failed(msg)
            case Evicted(name=name):
                self.adapters.on_evicted(name)
            case LoadAdapterOp():
                await self.on_load_adapter_op(msg)
            case UnloadAdapterOp():
                await self.on_unload_adapter_op(msg)
            case ListAdaptersOp(op_id=op_id):
                await self.to_tokenizer.put(AdapterListing(op_id=op_id, adapters=self._listing()))
            case HealthProbe(op_id=op_id):
                await self.to_tokenizer.put(HealthStatus(op_id=op_id, stages=self._health()))
        await self._finish_unloads()
        await self._kick()
        if self._is_idle():
            self.idle.set()
        else:
            self.idle.clear()

    # --- requests ---------------------------------------------------------------------------------------
    async def on_tokenized_request(self, req: TokenizedRequest) -> None:
        if req.adapter is not None and not self.adapters.usable(req.adapter):
            e = self.adapters.get(req.adapter)
            if e is not None and e.state == "failed":
                return await self._fail(req.request_id, "adapter_load_failed", e.error)
            return await self._fail(
                req.request_id, "unknown_adapter", f"adapter {req.adapter!r} is not loaded"
            )
        if self.planner is None:
            self.early.append(req)
            return
        try:
            self.planner.add(req.request_id, req.prompt_ids.tolist(), req.adapter, req.sampling)
        except ValueError as e:
            await self._fail(req.request_id, "invalid_request", str(e))

    async def on_worker_started(self, msg: WorkerStarted) -> None:
        c = self.config
        cfg = PlannerConfig(
            num_slots=c.max_loras_per_batch,
            num_pages=msg.num_pages,
            page_size=msg.page_size,
            max_running_requests=c.max_running_requests,
            max_tokens_per_step=c.max_tokens_per_step,
            max_model_len=min(c.max_model_len, msg.max_model_len),
            pinned_adapters=c.pinned_adapters,
            overlap_loading=c.overlap_loading,
            prefetch_depth=c.prefetch_depth,
            overlap_min_bytes=c.overlap_min_bytes,
        )
        self.planner = Planner(cfg, adapter_ready=self.adapters.ready, load_bytes=self._load_bytes)
        early, self.early = self.early, []
        for req in early:
            await self.on_tokenized_request(req)

    def _load_bytes(self, name: str) -> int:
        e = self.adapters.get(name)
        return e.staged.nbytes if e is not None and e.staged is not None else 0

    async def on_step_result(self, res: StepResult) -> None:
        self.in_flight.pop(res.step, None)
        if self.planner is None:
            return
        self.planner.update(res)
        for err in res.errors:
            await self._fail(err.request_id, "server_error", err.message)
        await self._slots_ready(res.slots_ready)
        await self._restage()
        for se in res.slot_errors:
            _, gen = self.slot_loads.pop(se.slot, (se.adapter, -1))
            if self.adapters.load_done(se.adapter, gen):
                await self._release(se.adapter)
            for r in [r for r in [*self.planner.running, *self.planner.waiting] if r.adapter == se.adapter]:
                self.planner.abort(r.request_id)
                await self._fail(r.request_id, "adapter_load_failed", se.message)
            self.planner.evict_adapter(se.adapter)

    async def _slots_ready(self, slots: list[int]) -> None:
        for slot in slots:
            if self.planner is not None:
                self.planner.slot_ready(slot)
            name, gen = self.slot_loads.pop(slot, (None, -1))
            if name is not None and self.adapters.load_done(name, gen):
                await self._release(name)

    async def _release(self, name: str) -> None:
        self.adapters.released()
        await self.to_loader.put(ReleaseAdapter(name=name))

    async def _fail(self, request_id: str, kind: str, message: str) -> None:
        self.m_failed.labels(kind=kind).inc()
        await self.to_tokenizer.put(RequestFailed(request_id=request_id, kind=kind, message=message))

    # --- planning ---------------------------------------------------------------------------------------
    async def _kick(self) -> None:
        """Send plans until `max_plans_in_flight` are queued at the worker or nothing is left to run."""
        planner = self.planner
        while planner is not None and len(self.in_flight) < self.config.max_plans_in_flight:
            await self._stage_upcoming()
            st = planner.stats
            before = (st.preemptions, st.slot_hits, st.slot_misses)
            plan = planner.schedule()
            self.m_preemptions.inc(st.preemptions - before[0])
            self.m_lookups.labels(result="hit").inc(st.slot_hits - before[1])
            self.m_lookups.labels(result="miss").inc(st.slot_misses - before[2])
            for waited in planner.adapter_waits:
                self.m_adapter_wait.observe(waited)
            planner.adapter_waits.clear()
            if not (planner.running or plan.finished_request_ids or plan.slot_loads or self.pending_clears):
                return
            loads = [self._slot_load(load) for load in plan.slot_loads]
            plan = msgspec.structs.replace(plan, slot_loads=loads, slot_clears=self.pending_clears)
            self.pending_clears = []
            self.in_flight[plan.step] = plan
            self.m_plans.inc()
            await self.to_worker.put(plan)

    def _slot_load(self, load: SlotLoad) -> SlotLoad:
        """The planner names slot and adapter; the host block's whereabouts come from the loader."""
        self.adapters.load_issued(load.adapter)
        self._host_looked.discard(load.adapter)
        self.slot_loads[load.slot] = (load.adapter, self.adapters.generation)
        self.m_slot_loads.inc()
        return slot_load_for(self.adapters.get(load.adapter).staged, load.slot)

    def _stale_copies(self) -> bool:
        """Copies issued under a loader that restarted: their bytes may be reused by the new loader's
        placements, so nothing is staged until they are done."""
        return any(gen != self.adapters.generation for _, gen in self.slot_loads.values())

    async def _stage_upcoming(self) -> None:
        """Ask the loader for the host blocks of adapters the waiting queue needs next, at most one
        slot's worth each: held blocks are pinned in the host cache, so this stays bounded."""
        if not self.loader_up or self._stale_copies():
            return
        for name in self.planner.adapters_needed():
            self._count_host_lookup(name)
            if self.adapters.pinned_waiting() >= self.config.max_loras_per_batch:
                return
            if self.adapters.held() >= self.config.max_cpu_loras:
                return
            if self.adapters.needs_stage(name):
                await self.to_loader.put(StageAdapter(name=name, path=self.adapters.get(name).path))

    def _count_host_lookup(self, name: str) -> None:
        if name in self._host_looked or self.adapters.get(name) is None:
            return
        self._host_looked.add(name)
        e = self.adapters.get(name)
        self.m_host_lookups.labels(result="hit" if e.staged is not None else "miss").inc()

    def _tier_counts(self) -> dict[str, int]:
        """Registered adapters by their fastest tier: a settled GPU slot, a slot being copied into,
        the host cache, or only on disk."""
        counts = dict.fromkeys(("gpu", "loading", "host", "disk"), 0)
        for e in self.adapters.entries.values():
            slot = self.planner.slots.slot_of(e.name) if self.planner else None
            if slot is not None:
                counts["loading" if self.planner.slots.is_loading(slot) else "gpu"] += 1
            else:
                counts["host" if e.staged is not None else "disk"] += 1
        return counts

    # --- adapters ---------------------------------------------------------------------------------------
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
                await self._fail(r.request_id, "adapter_load_failed", msg.message)

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

    async def _finish_unloads(self) -> None:
        """Remove unloading adapters once no request uses them and no copy of them is in flight."""
        for e in [e for e in self.adapters.entries.values() if e.state == "unloading"]:
            if e.loads_in_flight or (self.planner is not None and self.planner.users_of(e.name)):
                continue
            if self.planner is not None:
                slot = self.planner.evict_adapter(e.name)
                if slot is not None:
                    self.pending_clears.append(slot)
            del self.adapters.entries[e.name]
            await self.to_loader.put(DropAdapter(name=e.name))
            await self.to_tokenizer.put(AdapterUpdate(name=e.name, state="removed"))

    def _listing(self) -> list[ListedAdapter]:
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

    def _health(self) -> list[StageHealth]:
        p = self.planner
        detail = f"{len(p.waiting)} waiting, {len(p.running)} running" if p else "waiting for the worker"
        return [
            StageHealth(stage="scheduler", status="ok", detail=detail),
            StageHealth(
                stage="worker", status="ok" if p else "degraded", detail=f"{len(self.in_flight)} plans queued"
            ),
            StageHealth(stage="loader", status="ok" if self.loader_up else "down"),
        ]
