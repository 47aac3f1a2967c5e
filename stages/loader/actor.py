"""The adapter-loader stage actor. Sockets: PULL from the scheduler (bound), PUSH to the scheduler, and a
ROUTER to its part-writer processes (`writers.py`, with --loader-writers). Mailboxes: scheduler_requests
(StageAdapter: write this adapter at this range of the host pool) → loads (up to `load_threads` at once,
each planned from its header, then its parts read and packed straight into the range by the writer
processes, or by the thread pool without them) → to_scheduler (LoaderStarted, AdapterStaged/Failed,
LoaderHealth). The scheduler owns the host cache's table; the loader keeps only the writes in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from proto.loader import (
    AdapterFailed,
    AdapterStaged,
    LoaderHealth,
    LoaderStarted,
    LoaderToScheduler,
    SchedulerToLoader,
    StageAdapter,
)
from runtime.base.actor import Actor, StageFatal
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.host_pool import attach_pool, block_tensor, close_pool, dtype_name
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from stages.loader.adapter_config import AdapterError, LoaderFault
from stages.loader.adapter_plan import AdapterPlan, ReadLimits
from stages.loader.adapter_reader import max_file_bytes, plan_adapter
from stages.loader.block_writer import SegmentBuffer, prepare, write_part, zero_gaps
from stages.loader.config import LoaderConfig
from stages.loader.delta_bound import check_packed_deltas
from stages.loader.files import FileRefused, inside_root
from stages.loader.writers import PartWriters

SPARE_READ_THREADS = 4  # threads beyond load_threads, taking over from reads stuck in a hung file system

LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class LoaderActor(Actor[LoaderConfig]):
    stage = "loader"

    def __init__(self, config: LoaderConfig) -> None:
        super().__init__(config)
        self.loading: dict[int, StageAdapter] = {}  # write_id -> the write, until answered
        self.read_threads = config.load_threads + SPARE_READ_THREADS
        self.executor = ThreadPoolExecutor(self.read_threads, thread_name_prefix="loader")
        self.stuck: dict[str, float] = {}  # adapter name#read -> when its overdue read started
        self._reports: set[asyncio.Future[None]] = set()
        self.limits = ReadLimits(
            config.max_adapter_file_bytes, config.read_timeout_s, tasks=config.writers or config.load_threads
        )
        self.writers: PartWriters | None = None  # the part-writer processes (None: the threads write)
        self.writers_dir: str | None = None  # a private directory for their socket, when no run dir
        self.buffers: list[SegmentBuffer] = []  # read buffers of finished loads, for the next ones
        # made by setup() (a failure there is StageFatal, reported to the launcher)
        self.pool: Any = None  # the shared host pool (multiprocessing SharedMemory)
        self.model_cfg: ModelConfig | None = None
        self.dtype: torch.dtype | None = None
        self.layout: LoraLayout | None = None
        self.loads = self.mailbox("loads")
        self.to_scheduler = self.mailbox("to_scheduler")
        self._init_metrics()

    def _init_metrics(self) -> None:
        m = self.metrics
        self.m_loads = m.counter("lorapipe_adapter_loads", "Adapter loads from disk by result", ["result"])
        self.m_load_bytes = m.counter("lorapipe_adapter_load_bytes", "Packed bytes written to the host cache")
        self.m_load_seconds = m.histogram(
            "lorapipe_adapter_load_seconds", "Disk to host cache: read, check, pack, write", (), LOAD_BUCKETS
        )
        m.gauge("lorapipe_loader_writes_in_flight", "StageAdapters being read and packed").set_function(
            lambda: len(self.loading)
        )
        m.gauge(
            "lorapipe_loader_stuck_reads", "Reads past their deadline still holding a thread"
        ).set_function(lambda: len(self.stuck))

    def open_pool(self) -> None:
        """The model's layout and the shared host pool (StageFatal if either is unusable)."""
        cfg = self.config
        try:
            self.model_cfg = ModelConfig.from_dir(cfg.model_dir)
            self.dtype = parse_dtype(cfg.dtype, self.model_cfg.dtype)
            self.layout = LoraLayout.for_model(self.model_cfg, cfg.max_lora_rank)
            file_cap = min(
                cfg.max_adapter_file_bytes, max_file_bytes(self.layout)
            )  # no servable adapter is bigger
            self.limits = dataclasses.replace(self.limits, max_file_bytes=file_cap)
            self.pool = attach_pool(cfg.host_pool_name)
        except (OSError, ValueError) as exc:
            raise StageFatal(f"loader cannot start: {exc}") from exc
        if self.pool.size < cfg.host_pool_bytes:
            size, want = self.pool.size, cfg.host_pool_bytes
            raise StageFatal(f"host pool {cfg.host_pool_name} holds {size} bytes, the config says {want}")

    async def setup(self) -> None:
        cfg, ep = self.config, self.config.endpoints
        self.open_pool()
        if cfg.writers > 0:
            if not ep.run_dir:
                self.writers_dir = tempfile.mkdtemp(prefix="lorapipe-writers-")
            run_dir = ep.run_dir or self.writers_dir
            address = f"ipc://{run_dir}/loader-writers.sock"
            self.writers = PartWriters(cfg.writers, address, cfg.host_pool_name, self.log)
            try:
                await self.writers.start()
            except (OSError, RuntimeError) as exc:
                raise StageFatal(f"loader cannot start its writer processes: {exc}") from exc
        from_scheduler = self.socket(PullSocket(ep.scheduler_to_loader, SchedulerToLoader))
        to_scheduler = self.socket(PushSocket(ep.loader_to_scheduler, LoaderToScheduler))
        requests = self.mailbox("scheduler_requests")
        self.add_receiver("scheduler", from_scheduler, requests)
        self.add_handler("scheduler_requests", requests, self.handle_scheduler)
        for i in range(cfg.load_threads):
            self.add_loop(f"load:{i}", self._load_loop)
        self.add_sender("scheduler", self.to_scheduler, to_scheduler.send)
        await self.to_scheduler.put(LoaderStarted(pid=os.getpid()))  # first out, whatever the scheduler sent

    # --- scheduler requests ---------------------------------------------------------------------------
    async def handle_scheduler(self, msg: Any) -> None:
        match msg:
            case StageAdapter():
                await self.on_stage_adapter(msg)

    async def on_stage_adapter(self, msg: StageAdapter) -> None:
        if msg.write_id in self.loading:  # the scheduler numbers writes once each: a duplicate is its bug
            raise RuntimeError(f"write {msg.write_id} of adapter {msg.name!r} is already in flight")
        self.loading[msg.write_id] = msg
        await self.loads.put(msg)

    async def on_handler_failed(self, queue: str, msg: Any, exc: Exception) -> None:
        """A StageAdapter the handler failed on is answered, so the scheduler frees its range and fails
        or retries what waits on it; health says the stage is degraded."""
        if isinstance(msg, StageAdapter) and msg.write_id not in self.loading:
            text = f"the adapter-loader failed on adapter {msg.name!r}: {type(exc).__name__}: {exc}"
            failed = AdapterFailed(name=msg.name, message=text, write_id=msg.write_id, stage_fault=True)
            await self.to_scheduler.put(failed)
        await self._report_health()

    # --- loads: disk → packed block in the pool -------------------------------------------------------
    async def _load_loop(self) -> None:
        while True:
            job = await self.loads.get()
            try:
                await self._load(job)
            except Exception as exc:  # a bad adapter (or a bug in one load) must not stop the stage
                self.log.exception("load of adapter %r failed", job.name)
                if self.loading.get(job.write_id) is job:
                    text = f"the adapter-loader failed on adapter {job.name!r}: {type(exc).__name__}: {exc}"
                    failed = AdapterFailed(name=job.name, message=text, stage_fault=True)
                    await self._finish(job, failed)
            finally:
                self.loads.task_done()

    async def _load(self, job: StageAdapter) -> None:
        """Plan from the header (no tensor data read), then read and pack the file's chunks straight into
        the range on the thread pool, in parallel; every failure is answered (the range is the
        scheduler's to free)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if job.offset < 0 or job.offset + job.capacity > self.pool.size:
            text = f"adapter {job.name!r}: host range {job.offset}+{job.capacity} is outside the pool"
            return await self._finish(job, AdapterFailed(name=job.name, message=text, stage_fault=True))
        try:
            plan = await self._read_with_deadline(job)
        except AdapterError as exc:
            return await self._finish(job, _failed(job.name, exc))
        with plan:
            if plan.nbytes > job.capacity:
                text = f"adapter {job.name!r} needs {plan.nbytes} bytes; its host range holds {job.capacity}"
                return await self._finish(job, AdapterFailed(name=job.name, message=text))
            try:
                await self._write(plan, job.offset)
                view = block_tensor(self.pool, job.offset, plan.rank, self.layout, self.dtype)
                check = (job.name, self.layout, view, plan.ranks, plan.scalings, plan.peak)
                await loop.run_in_executor(self.executor, check_packed_deltas, *check)
                del view
            except AdapterError as exc:  # bad values or a failed read (or the loader's LoaderFault)
                return await self._finish(job, _failed(job.name, exc))
        load_time = time.perf_counter() - t0
        self.m_load_bytes.inc(plan.nbytes)
        self.m_load_seconds.observe(load_time)
        await self._finish(job, self._staged_msg(plan, job.offset, load_time))

    async def _finish(self, job: StageAdapter, answer: AdapterStaged | AdapterFailed) -> None:
        """Answer the StageAdapter (once: a write leaves `loading` here)."""
        del self.loading[job.write_id]
        answer = msgspec.structs.replace(answer, write_id=job.write_id)
        self.m_loads.labels(result="staged" if isinstance(answer, AdapterStaged) else "failed").inc()
        if isinstance(answer, AdapterFailed):
            self.log.warning("%s", answer.message)
        await self.to_scheduler.put(answer)

    async def _read_with_deadline(self, job: StageAdapter) -> AdapterPlan:
        """Plan in a thread; past `read_timeout_s` the load fails and its thread counts as stuck (a
        thread in a hung read cannot be stopped) until the read returns; health says so meanwhile."""
        loop = asyncio.get_running_loop()
        if len(self.stuck) >= self.read_threads - self.config.load_threads + 1:
            raise LoaderFault(job.name, f"the loader has {len(self.stuck)} reads stuck in the file system")
        fut = self.executor.submit(self._read, job, self._limits_now())
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(fut)), self.config.read_timeout_s
            )
        except TimeoutError:
            started = time.monotonic() - self.config.read_timeout_s
            key = f"{job.name}#{id(fut)}"
            self.stuck[key] = started
            fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._unstuck, key, f))
            await self._report_health()
            raise LoaderFault(
                job.name, f"reading it took longer than {self.config.read_timeout_s:g}s (a hung file system?)"
            ) from None

    def _unstuck(self, key: str, fut) -> None:
        if not fut.cancelled() and fut.exception() is None:
            fut.result().close()  # the plan came back after all: close its file
        if self.stuck.pop(key, None) is not None:
            task = asyncio.ensure_future(self._report_health())
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    async def _report_health(self) -> None:
        await self.to_scheduler.put(self._health_msg())

    def _health_msg(self) -> LoaderHealth:
        now = time.monotonic()
        detail = ", ".join(f"{k.split('#')[0]!r} for {now - t:.0f}s" for k, t in self.stuck.items())
        detail = f"reads stuck: {detail}" if detail else ""
        return LoaderHealth(
            stuck_reads=len(self.stuck),
            read_threads=self.read_threads,
            detail=detail[:500],
            handler_failures=self.handler_failures,
        )

    def _limits_now(self) -> ReadLimits:
        """With writers, a load alone is cut into a part per writer; loads at once share them, at least
        two parts each (fewer, larger parts cost the loader less Python per byte)."""
        if self.writers is None:
            return self.limits
        tasks = max(2, self.config.writers // max(1, len(self.loading)))
        return dataclasses.replace(self.limits, tasks=tasks)

    def _read(self, job: StageAdapter, limits: ReadLimits) -> AdapterPlan:
        cfg = self.config
        try:
            path = inside_root(job.path, cfg.adapter_root, cfg.trusted_paths)
        except FileRefused as exc:
            raise AdapterError(job.name, str(exc)) from None
        return plan_adapter(job.name, path, self.model_cfg, self.layout, self.dtype, limits)

    async def _write(self, plan: AdapterPlan, offset: int) -> None:
        """Per segment, its parts on the thread pool at once (the gap zeroing beside the first); returns
        when every task has ended (none may still write into the block when a failure frees it), raising
        the first failure. One read buffer per load in flight, reused."""
        if self.writers is not None:
            parts = [(s, i) for s, seg in enumerate(plan.segments) for i in range(len(seg.parts))]
            calls = [
                self.writers.write(plan, plan.path, offset, s, i, [] if k else plan.gaps)
                for k, (s, i) in enumerate(parts)
            ]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
            return
        view = block_tensor(self.pool, offset, plan.rank, self.layout, self.dtype)  # [L, rank, row]
        buf = self.buffers.pop() if self.buffers else SegmentBuffer()
        try:
            first: list[tuple] = [(zero_gaps, plan, view)]
            for s, seg in enumerate(plan.segments):
                prepare(plan, s, buf)
                parts = [(write_part, plan, s, i, buf, view) for i in range(len(seg.parts))]
                await self._run_all(first + parts)
                first = []
        finally:
            del view
            self.buffers.append(buf)

    async def _run_all(self, calls: list[tuple]) -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self.executor, *call) for call in calls]
        for result in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def _staged_msg(self, plan: AdapterPlan, offset: int, load_time: float) -> AdapterStaged:
        return AdapterStaged(
            name=plan.name,
            shm_name=self.pool.name,
            offset=offset,
            nbytes=plan.nbytes,
            rank=plan.rank,
            layer_nbytes=plan.rank * self.layout.row_elems * plan.dtype.itemsize,
            dtype=dtype_name(self.dtype),
            slice_ranks=plan.ranks.flatten().tolist(),  # [num_layers * NUM_SLICES], layer-major
            slice_scalings=plan.scalings.flatten().tolist(),
            load_time=load_time,
        )

    # --- lifecycle ------------------------------------------------------------------------------------
    def teardown(self) -> None:
        super().teardown()
        if self.writers is not None:
            self.writers.close()  # killed and waited for: none writes into the pool after this
        if self.writers_dir is not None:
            shutil.rmtree(self.writers_dir, ignore_errors=True)
        self.executor.shutdown(wait=False, cancel_futures=True)
        # a write still in flight (stopped without draining) has threads packing into the pool that
        # cannot be stopped: unmapping it under them would end the process with SIGSEGV
        if self.pool is not None and (self.loading or not close_pool(self.pool)):
            self.log.info("host pool still mapped by a write in flight or a view; the exit unmaps it")


def _failed(name: str, exc: AdapterError) -> AdapterFailed:
    return AdapterFailed(name=name, message=str(exc), stage_fault=isinstance(exc, LoaderFault))
