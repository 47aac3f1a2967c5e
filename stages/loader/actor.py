"""The adapter-loader stage actor. Sockets: PULL from the scheduler (bound), PUSH to the scheduler, and a
ROUTER to its part-writer processes (`writers.py`, with --loader-writers). Mailboxes: scheduler_requests
(StageAdapter/ReleaseAdapter/DropAdapter) → loads (misses: up to `load_threads` at once, each planned from
its header, then its parts read and packed straight into the reserved pool block by the writer processes,
or by the thread pool without them) → to_scheduler (LoaderStarted, AdapterStaged/Failed, Evicted)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from proto.loader import (
    AdapterFailed,
    AdapterStaged,
    DropAdapter,
    Evicted,
    LoaderHealth,
    LoaderStarted,
    LoaderToScheduler,
    ReleaseAdapter,
    SchedulerToLoader,
    StageAdapter,
)
from runtime.base.actor import Actor, StageFatal
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.host_pool import attach_pool, block_tensor, close_pool, dtype_name
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import AdapterPlan, ReadLimits
from stages.loader.adapter_reader import max_file_bytes, plan_adapter
from stages.loader.block_writer import SegmentBuffer, prepare, write_part, zero_gaps
from stages.loader.config import LoaderConfig
from stages.loader.delta_bound import check_packed_deltas
from stages.loader.files import FileRefused, inside_root
from stages.loader.host_cache import HostCache, HostCacheFull
from stages.loader.writers import PartWriters

SPARE_READ_THREADS = 4  # threads beyond load_threads, taking over from reads stuck in a hung file system

LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class _Load:
    """One read of one adapter from disk; StageAdapters for the same name meanwhile join it."""

    name: str
    path: str
    waiters: int = 1  # StageAdapters it answers (each answer pins the block once)
    released: int = 0  # ReleaseAdapters that came before the answer (their pins are already given back)
    dropped: bool = False  # DropAdapter came meanwhile: free the block once written, answer failed


class LoaderActor(Actor[LoaderConfig]):
    stage = "loader"

    def __init__(self, config: LoaderConfig) -> None:
        super().__init__(config)
        self.cache = HostCache(config.host_pool_bytes, config.max_cpu_loras)
        self.staged: dict[str, AdapterStaged] = {}  # blocks fully written (what a cache hit answers)
        self.loading: dict[str, _Load] = {}
        self.doomed: set[str] = set()  # dropped while pinned: freed on the last ReleaseAdapter
        self.restage: dict[str, list[str]] = {}  # StageAdapter paths waiting for a dropped name to go
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
        m, cache = self.metrics, self.cache
        self.m_loads = m.counter("lorapipe_adapter_loads", "Adapter loads from disk by result", ["result"])
        self.m_load_bytes = m.counter("lorapipe_adapter_load_bytes", "Packed bytes written to the host cache")
        self.m_load_seconds = m.histogram(
            "lorapipe_adapter_load_seconds", "Disk to host cache: read, check, pack, write", (), LOAD_BUCKETS
        )
        self.m_hits = m.counter("lorapipe_host_cache_hits", "StageAdapter answered from the host cache")
        self.m_misses = m.counter("lorapipe_host_cache_misses", "StageAdapter that needed a load from disk")
        self.m_evictions = m.counter("lorapipe_host_cache_evictions", "Blocks evicted (LRU) to make room")
        resident = m.gauge("lorapipe_host_cache_adapters", "Adapters in the host cache", ["state"])
        resident.labels(state="resident").set_function(lambda: len(cache.blocks))
        resident.labels(state="pinned").set_function(lambda: sum(b.pins > 0 for b in cache.blocks.values()))
        resident.labels(state="loading").set_function(lambda: len(self.loading))
        used = m.gauge("lorapipe_host_cache_bytes_used", "Bytes of packed blocks in the host cache")
        used.set_function(lambda: cache.used_bytes)
        m.gauge("lorapipe_host_cache_capacity_bytes", "Size of the host-cache pool").set(cache.capacity)
        largest = m.gauge("lorapipe_host_cache_largest_free_bytes", "Largest block placed without evicting")
        largest.set_function(cache.largest_free)
        m.gauge(
            "lorapipe_loader_stuck_reads", "Reads past their deadline still holding a thread"
        ).set_function(lambda: len(self.stuck))

    async def setup(self) -> None:
        cfg, ep = self.config, self.config.endpoints
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
            case ReleaseAdapter(name=name):
                await self.on_release_adapter(name)
            case DropAdapter(name=name):
                await self.on_drop_adapter(name)

    async def on_stage_adapter(self, msg: StageAdapter) -> None:
        name = msg.name
        job = self.loading.get(name)
        if (job is not None and job.dropped) or name in self.doomed:
            self.restage.setdefault(name, []).append(msg.path)  # after the old block is gone
        elif job is not None:
            job.waiters += 1
        elif name in self.staged:
            self.cache.get(name)  # most recently used
            self.cache.pin(name)
            self.m_hits.inc()
            staged = msgspec.structs.replace(self.staged[name], load_time=0.0, cache_hit=True)
            await self.to_scheduler.put(staged)
        else:
            await self._start_load(name, msg.path, waiters=1)

    async def on_release_adapter(self, name: str) -> None:
        job = self.loading.get(name)
        if job is not None:  # released before its answer: that answer pins one time less
            job.released += 1
            return
        self.cache.unpin(name)
        block = self.cache.blocks.get(name)
        if name in self.doomed and (block is None or block.pins == 0):
            self.doomed.discard(name)
            await self._free(name)

    async def on_drop_adapter(self, name: str) -> None:
        waiting = self.restage.pop(name, [])  # StageAdapters between two DropAdapters: answered failed
        job = self.loading.get(name)
        block = self.cache.blocks.get(name)
        if job is not None:
            job.dropped = True
        elif block is not None and block.pins > 0:
            self.staged.pop(name, None)
            self.doomed.add(name)  # the worker may be copying from it right now
        else:
            self.staged.pop(name, None)
            self.cache.drop(name)
        gone = AdapterFailed(name=name, message=f"adapter {name!r} was unloaded")
        for _ in waiting:
            await self.to_scheduler.put(gone)

    async def _free(self, name: str) -> None:
        """Drop `name`'s block, then stage it again if StageAdapters came after the DropAdapter."""
        self.cache.drop(name)
        self.staged.pop(name, None)
        paths = self.restage.pop(name, [])
        if paths:
            await self._start_load(name, paths[-1], waiters=len(paths))

    async def _start_load(self, name: str, path: str, waiters: int) -> None:
        self.m_misses.inc(waiters)
        job = _Load(name, path, waiters)
        self.loading[name] = job
        await self.loads.put(job)

    # --- loads: disk → packed block in the pool -------------------------------------------------------
    async def _load_loop(self) -> None:
        while True:
            job = await self.loads.get()
            try:
                await self._load(job)
            except Exception as exc:  # a bad adapter (or a bug in one load) must not stop the stage
                self.log.exception("load of adapter %r failed", job.name)
                if self.loading.get(job.name) is job:
                    message = f"adapter {job.name!r}: {type(exc).__name__}: {exc}"
                    await self._finish(job, AdapterFailed(name=job.name, message=message))
            finally:
                self.loads.task_done()

    async def _load(self, job: _Load) -> None:
        """Plan from the header (no tensor data read), reserve the block, then read and pack the file's
        chunks straight into it on the thread pool, in parallel; any failure frees the block."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            plan = await self._read_with_deadline(job)
        except AdapterError as exc:
            return await self._finish(job, AdapterFailed(name=job.name, message=str(exc)))
        with plan:
            try:
                block, evicted = self.cache.reserve(job.name, plan.nbytes)
            except HostCacheFull as exc:  # retryable: room comes back once pinned blocks are released
                failed = AdapterFailed(name=job.name, message=str(exc), retryable=exc.retryable)
                return await self._finish(job, failed)
            self.cache.pin(job.name)  # the write's own pin: never evicted while half written
            for victim in evicted:
                self.staged.pop(victim, None)
            self.m_evictions.inc(len(evicted))
            for victim in evicted:
                await self.to_scheduler.put(Evicted(name=victim))
            try:
                await self._write(plan, block.offset)
                view = block_tensor(self.pool, block.offset, plan.rank, self.layout, self.dtype)
                check = (job.name, self.layout, view, plan.ranks, plan.scalings, plan.peak)
                await loop.run_in_executor(self.executor, check_packed_deltas, *check)
                del view
            except BaseException as exc:
                self.cache.drop(job.name)
                if isinstance(exc, AdapterError):  # bad values or a failed read: the adapter's fault
                    return await self._finish(job, AdapterFailed(name=job.name, message=str(exc)))
                raise
        load_time = time.perf_counter() - t0
        self.m_load_bytes.inc(plan.nbytes)
        self.m_load_seconds.observe(load_time)
        self.cache.unpin(job.name)  # the write's pin; _finish pins once per answer, with no await between
        await self._finish(job, self._staged_msg(plan, block.offset, load_time))

    async def _finish(self, job: _Load, answer: AdapterStaged | AdapterFailed) -> None:
        """Answer every StageAdapter the load served; a load dropped meanwhile frees its block instead."""
        del self.loading[job.name]
        self.m_loads.labels(result="staged" if isinstance(answer, AdapterStaged) else "failed").inc()
        if isinstance(answer, AdapterFailed):
            self.log.warning("%s", answer.message)
        if job.dropped:
            answer = AdapterFailed(name=job.name, message=f"adapter {job.name!r} was unloaded while loading")
            await self._free(job.name)
        elif isinstance(answer, AdapterStaged):
            self.staged[job.name] = answer
            for _ in range(max(0, job.waiters - job.released)):
                self.cache.pin(job.name)
        for _ in range(job.waiters):
            await self.to_scheduler.put(answer)

    async def _read_with_deadline(self, job: _Load) -> AdapterPlan:
        """Plan in a thread; past `read_timeout_s` the load fails and its thread counts as stuck (a
        thread in a hung read cannot be stopped) until the read returns; health says so meanwhile."""
        loop = asyncio.get_running_loop()
        if len(self.stuck) >= self.read_threads - self.config.load_threads + 1:
            raise AdapterError(job.name, f"the loader has {len(self.stuck)} reads stuck in the file system")
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
            raise AdapterError(
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
        return LoaderHealth(stuck_reads=len(self.stuck), read_threads=self.read_threads, detail=detail[:500])

    def _limits_now(self) -> ReadLimits:
        """With writers, a load alone is cut into a part per writer; loads at once share them, at least
        two parts each (fewer, larger parts cost the loader less Python per byte)."""
        if self.writers is None:
            return self.limits
        tasks = max(2, self.config.writers // max(1, len(self.loading)))
        return dataclasses.replace(self.limits, tasks=tasks)

    def _read(self, job: _Load, limits: ReadLimits) -> AdapterPlan:
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
            cache_hit=False,
        )

    # --- lifecycle ------------------------------------------------------------------------------------
    def teardown(self) -> None:
        super().teardown()
        if self.writers is not None:
            self.writers.close()  # killed and waited for: none writes into the pool after this
        if self.writers_dir is not None:
            shutil.rmtree(self.writers_dir, ignore_errors=True)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None and not close_pool(self.pool):
            self.log.info("host pool still mapped by a running copy; the exit unmaps it")
