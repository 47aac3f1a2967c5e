"""The scheduler stage actor: plans step N+1 while step N runs. Sockets: PULLs bound for tokenizer, worker
and loader messages (one `events` mailbox, so all state changes in one handler); PUSHes to worker (plans),
tokenizer (failures, op replies, adapter updates) and loader (what `AdapterLifecycle` asks of it)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from proto.client import StageHealth
from proto.loader import (
    AdapterFailed,
    AdapterStaged,
    LoaderHealth,
    LoaderStarted,
    LoaderToScheduler,
    SchedulerToLoader,
)
from proto.pipeline import (
    AbortRequest,
    AdapterListing,
    HealthProbe,
    HealthStatus,
    ListAdaptersOp,
    LoadAdapterOp,
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
    SlotsReady,
    StepResult,
    WarmupProgress,
    WorkerStarted,
    WorkerToScheduler,
)
from runtime.base.actor import Actor
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.names import adapter_name_problem
from stages.scheduler.adapter_lifecycle import AdapterLifecycle, copy_failed
from stages.scheduler.adapter_ops import AdapterOps
from stages.scheduler.adapter_waits import AdapterDeadlines, overdue_requests
from stages.scheduler.adapters import AdapterRegistry, AdapterState
from stages.scheduler.config import SchedulerConfig, plan_limit
from stages.scheduler.gateway_metrics import add_gateway_metrics
from stages.scheduler.host_table import HostTable
from stages.scheduler.metrics import SchedulerMetrics
from stages.scheduler.planner import Planner, PlannerConfig
from stages.scheduler.warm_start import StartupWarmer

# Adapters of the waiting queue staged ahead of their pool load (and loader writes in flight), when
# --max-loras-per-batch does not say how many one step can use.
STAGE_AHEAD = 64


class SchedulerActor(Actor[SchedulerConfig]):
    stage = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.planner: Planner | None = None  # built once the worker says what its KV cache and pool hold
        self.warmup: WarmupProgress | None = None  # the worker's kernel warm-up, until WorkerStarted
        self.early: list[TokenizedRequest] = []
        self.in_flight: dict[int, BatchPlan] = {}
        self.pending_clears: list[int] = []
        self.idle = asyncio.Event()
        self.idle.set()
        self.peers_up = asyncio.Event()  # the loader and the worker have both announced themselves
        self.events = self.mailbox("events")
        self.to_worker = self.mailbox("plans", 4)
        self.to_tokenizer = self.mailbox("to_tokenizer")
        self.to_loader = self.mailbox("to_loader")
        self.adapters = AdapterRegistry(dict(config.adapters))
        self.loader_health: LoaderHealth | None = None  # the loader's last word on stuck reads
        self.series = SchedulerMetrics(
            self.metrics,
            planner=lambda: self.planner,
            early_requests=lambda: len(self.early),
            tier_counts=lambda: self.ops.tier_counts(self.planner),
            waiting_tiers=lambda: self.ops.waiting_tiers(self.planner),
            hold_counts=lambda: self.ops.hold_counts(),
        )
        self.host_table = HostTable(config.host_cache_bytes, config.max_cpu_loras)
        self.lifecycle = AdapterLifecycle(
            self.adapters,
            self.host_table,
            config.max_block_bytes,
            self.to_loader,
            self._fail,
            self.series,
            stage_ahead=config.policy.max_loras_per_batch or STAGE_AHEAD,
            warmer=StartupWarmer(config.adapters),
        )
        self.ops = AdapterOps(self.adapters, self.lifecycle, self.to_tokenizer, self._fail)
        self.series.host_gauges(self.metrics, self.host_table, self.ops.host_blocks)
        add_gateway_metrics(
            self.metrics,
            planner=lambda: self.planner,
            early_adapters=lambda: [r.adapter for r in self.early],
            max_lora=lambda: self.planner.cfg.max_loras_per_batch if self.planner else 0,
        )

    async def setup(self) -> None:
        ep = self.config.endpoints
        events, to_loader = self.events, self.to_loader
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
        self.add_sender("loader", to_loader, loader.send)
        self.add_loop("adapter_deadlines", self._tick_deadlines)

    async def until_ready(self) -> None:
        """Ready once the loader and the worker have announced themselves: health is ok from then on."""
        await self.peers_up.wait()

    def _is_idle(self) -> bool:
        return not (self.early or self.in_flight or (self.planner and self.planner.has_work))

    async def drain(self) -> None:
        """Keep stepping until every accepted request has finished and the worker is idle."""
        await self.idle.wait()
        await super().drain()

    async def handle(self, msg: Any) -> None:
        life, ops, planner = self.lifecycle, self.ops, self.planner
        match msg:
            case TokenizedRequest():
                await self.on_tokenized_request(msg)
            case AbortRequest(request_id=rid):
                if planner is not None:
                    planner.abort(rid)
                self.early = [r for r in self.early if r.request_id != rid]
            case StepResult():
                await self.on_step_result(msg)
            case SlotsReady():
                await life.settle_loads(msg.slots_ready, msg.slot_errors, planner)
            case WarmupProgress():
                self.warmup = msg
            case WorkerStarted():
                self.warmup = None
                await self.on_worker_started(msg)
            case LoaderStarted():
                self.loader_health = None
                await life.on_loader_started()
            case LoaderHealth():
                self.loader_health = msg
            case AdapterStaged():
                if (e := life.on_adapter_staged(msg)) is not None:
                    await ops.on_adapter_staged(e)
            case AdapterFailed():
                if (e := life.on_adapter_failed(msg)) is not None:
                    await ops.on_adapter_failed(e, msg, planner)
            case AdapterDeadlines():
                await self._fail_overdue()
            case LoadAdapterOp() | UnloadAdapterOp() if problem := adapter_name_problem(msg.name):
                await self.to_tokenizer.put(
                    OpFailed(op_id=msg.op_id, kind="invalid_request", message=problem)
                )
            case LoadAdapterOp():
                await ops.on_load_adapter_op(msg)
            case UnloadAdapterOp():
                await ops.on_unload_adapter_op(msg)
            case ListAdaptersOp(op_id=op_id):
                await self.to_tokenizer.put(AdapterListing(op_id=op_id, adapters=ops.listing(planner)))
            case HealthProbe(op_id=op_id):
                await self.to_tokenizer.put(HealthStatus(op_id=op_id, stages=self._health()))
        await self._settle()

    async def _settle(self) -> None:
        """After every event: finish unloads, send plans, and note whether the stage is idle."""
        if self.planner is not None and self.lifecycle.loader_up:
            self.peers_up.set()
        self.pending_clears.extend(await self.ops.finish_unloads(self.planner))
        await self._kick()
        if self._is_idle():
            self.idle.set()
        else:
            self.idle.clear()

    async def on_handler_failed(self, queue: str, msg: Any, exc: Exception) -> None:
        """No request waits on a message the handler failed on: the requests it names, or that wait on
        the adapter it names, fail with `stage_failed` (the loader's write is given up, so the adapter
        can be staged again)."""
        text = f"the scheduler failed on {type(msg).__name__}: {type(exc).__name__}: {exc}"
        planner = self.planner
        rids: list[str] = []
        match msg:
            case TokenizedRequest(request_id=rid):
                rids = [rid]
                self.early = [r for r in self.early if r.request_id != rid]
            case StepResult():
                rids = [f.request_id for f in msg.finished] + [e.request_id for e in msg.errors]
            case AdapterStaged() | AdapterFailed():
                # the write is given up (nothing changes when the answer was stale or already applied)
                self.lifecycle.on_adapter_failed(
                    AdapterFailed(name=msg.name, message=text, write_id=msg.write_id)
                )
                if planner is not None:
                    rids = [r.request_id for r in planner.waiting if r.adapter == msg.name]
                text = f"adapter {msg.name!r}: {text}"
        for rid in rids:
            if planner is not None:
                planner.abort(rid)
            await self._fail(rid, "stage_failed", text)
        await self._settle()

    async def _tick_deadlines(self) -> None:
        """Puts an AdapterDeadlines event into the one events mailbox, so that the adapter-wait timeout
        is checked by the handler that owns all scheduler state."""
        period = min(1.0, self.config.adapter_wait_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if self.planner is not None and self.planner.waiting:
                await self.events.put(AdapterDeadlines())

    async def _fail_overdue(self) -> None:
        planner = self.planner
        if planner is None:
            return
        timeout = self.config.adapter_wait_timeout_s
        for req, tier in overdue_requests(planner, self.adapters, timeout, self.lifecycle.clock()):
            planner.abort(req.request_id)
            text = (
                f"adapter {req.adapter!r} made no progress for {timeout:g}s: the request waited on the {tier}"
            )
            await self._fail(req.request_id, "adapter_timeout", text)

    # --- requests ---------------------------------------------------------------------------------------
    async def on_tokenized_request(self, req: TokenizedRequest) -> None:
        adapters = self.adapters
        if req.adapter is not None and not adapters.usable(req.adapter):
            e = adapters.get(req.adapter)
            if e is not None and e.state is AdapterState.FAILED:
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
        cfg = PlannerConfig.from_policy(
            c.policy,
            num_pages=msg.num_pages,
            page_size=msg.page_size,
            pool_rows=msg.lora_rows,
            pool_ids=msg.lora_ids,
            pool_row_bytes=msg.lora_row_bytes,
            max_lora_rank=msg.lora_max_rank,
            max_model_len=min(c.max_model_len, msg.max_model_len),
        )
        self.planner = Planner(
            cfg,
            adapter_rows=self.adapters.rows,
            adapter_ready=self.adapters.ready,
            load_bytes=self.lifecycle.load_bytes,
            adapter_generation=self.adapters.generation,
        )
        early, self.early = self.early, []
        for req in early:
            await self.on_tokenized_request(req)

    async def on_step_result(self, res: StepResult) -> None:
        self.in_flight.pop(res.step, None)
        if self.planner is None:
            return
        # a request whose adapter's copy failed in this step failed with the worker, not by itself
        not_copied = {se.adapter for se in res.slot_errors}
        adapter_of = {err.request_id: self.planner.adapter_of(err.request_id) for err in res.errors}
        self.planner.update(res)
        for err in res.errors:
            adapter = adapter_of[err.request_id]
            if adapter is not None and adapter in not_copied:
                await self._fail(err.request_id, "stage_failed", copy_failed(adapter, err.message))
            else:
                await self._fail(err.request_id, "server_error", err.message)
        await self.lifecycle.settle_loads(res.slots_ready, res.slot_errors, self.planner)

    async def _fail(self, request_id: str, kind: str, message: str) -> None:
        self.series.failed.labels(kind=kind).inc()
        await self.to_tokenizer.put(RequestFailed(request_id=request_id, kind=kind, message=message))

    # --- planning ---------------------------------------------------------------------------------------
    async def _kick(self) -> None:
        """Send plans until `plan_limit` are queued at the worker or nothing is left to run."""
        planner = self.planner
        if planner is None:
            await self.lifecycle.warm(None)  # the host pass runs while the worker starts
        while planner is not None and len(self.in_flight) < plan_limit(
            self.config, len(planner.waiting), len(planner.running)
        ):
            await self.lifecycle.stage_upcoming(planner)
            plan = self.series.schedule(planner)
            loads = [*plan.slot_loads, *await self.lifecycle.warm(planner)]
            if not (planner.running or plan.finished_request_ids or loads or self.pending_clears):
                return
            loads = [self.lifecycle.issue_load(load) for load in loads]
            plan = msgspec.structs.replace(plan, slot_loads=loads, slot_clears=self.pending_clears)
            self.pending_clears = []
            self.in_flight[plan.step] = plan
            self.series.count_plan(planner.running, planner.adapter_row_bytes)
            await self.to_worker.put(plan)

    def _health(self) -> list[StageHealth]:
        p = self.planner
        detail = f"{len(p.waiting)} waiting, {len(p.running)} running" if p else "waiting for the worker"
        if self.handler_failures:
            detail += f"; its handlers failed on {self.handler_failures} messages"
        copy_failures = self.lifecycle.copy_failures
        worker = "ok" if p and not copy_failures else "degraded"
        worker_detail = f"{len(self.in_flight)} plans queued"
        if copy_failures:
            worker_detail += f"; {copy_failures} adapter copies failed"
        w = self.warmup
        if w is not None:
            worker_detail = f"warming up: {w.done}/{w.total} kernel variants compiled or loaded"
        return [
            StageHealth(
                stage="scheduler", status="degraded" if self.handler_failures else "ok", detail=detail
            ),
            StageHealth(
                stage="worker",
                status=worker,
                detail=worker_detail,
                warmup_done=w.done if w else 0,
                warmup_total=w.total if w else 0,
            ),
            self._loader_health(),
        ]

    def _loader_health(self) -> StageHealth:
        h = self.loader_health
        if not self.lifecycle.loader_up:
            return StageHealth(stage="loader", status="down")
        if h is None or not (h.stuck_reads or h.handler_failures):
            return StageHealth(stage="loader", status="ok")
        status = "down" if h.stuck_reads >= h.read_threads else "degraded"
        detail = h.detail
        if h.handler_failures:
            detail = f"{detail}; " if detail else ""
            detail += f"its handlers failed on {h.handler_failures} messages"
        return StageHealth(stage="loader", status=status, detail=detail)
