"""The gpu-worker stage actor. Sockets: PULL bound for batch plans; PUSHes to the scheduler (step
results, WorkerStarted) and the tokenizer (token batches). Steps run in one worker thread, so plans keep
arriving (and queue in the bounded `plans` mailbox) while it computes; the step loop (`step_loop.py`)
launches the next queued plan before it reads the previous step's tokens (`--overlap-schedule`).
Slot copies run on a load stream; a copy no step has needed yet is reported with `SlotsReady` when idle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq

from proto.pipeline import WorkerToTokenizer
from proto.plan import (
    SchedulerToWorker,
    SlotLoad,
    SlotsReady,
    WarmupProgress,
    WorkerStarted,
    WorkerToScheduler,
)
from runtime.base.actor import Actor
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.host_pool import (
    attach_pool,
    close_pool,
    packed_from_pool,
    register_pinned,
    unregister_pinned,
)
from stages.worker import startup
from stages.worker.config import WorkerConfig
from stages.worker.executor import StepExecutor
from stages.worker.lora.pool import runs_of
from stages.worker.runner import ModelRunner
from stages.worker.slot_loads import LoadHandle
from stages.worker.startup import Phases, process_age, seconds_line, started_after
from stages.worker.step_loop import StepLoop, StepOutcome
from stages.worker.step_profiler import StepProfiler
from stages.worker.tp.rank_zero import RankZero


class WorkerActor(Actor[WorkerConfig]):
    stage = "worker"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        self.steps: StepLoop | None = None
        self.copy_seconds = 0.0  # host-to-device copy time, all loads
        self.overlapped_seconds = 0.0  # of which no step's compute waited for
        # made by setup(), on the event loop: weights load there in the step thread, after start-up
        # has begun, so that readiness, parent-death watch and drain already run meanwhile
        self.runner: ModelRunner | None = None
        self.executor: StepExecutor | None = None
        self.host_pool: Any = None  # the shared host pool (multiprocessing SharedMemory), mapped once
        self.cuda = False
        self.load_stream: torch.cuda.Stream | None = None
        self.rank_zero: RankZero | None = None
        self.to_scheduler = self.mailbox("to_scheduler")
        self.to_tokenizer = self.mailbox("to_tokenizer")
        # the start-up's parts after the model runner, to the WorkerStarted on the wire (the line at ready)
        self.after_runner = Phases()
        self.announced = asyncio.Event()  # WorkerStarted was sent: the scheduler can plan from now on
        self._startup: tuple[float | None, float | None, float, float] | None = None
        self._init_metrics()

    def _init_metrics(self) -> None:
        m = self.metrics
        self.m_step = m.histogram(
            "lorapipe_step_seconds",
            "Launch to results of one step: forward and sampling (overlapped: beside the next launch)",
            (),
            [2**i / 1e4 for i in range(14)],
        )
        self.m_batch = m.histogram("lorapipe_batch_size", "Requests per step", (), [2**i for i in range(10)])
        self.m_tokens = m.counter("lorapipe_step_tokens", "Tokens computed (prefill + decode)")
        self.m_loads = m.counter("lorapipe_slot_copies", "Adapter copies into the GPU pool", ["result"])
        self.m_load_s = m.histogram(
            "lorapipe_slot_copy_seconds", "Host-to-device adapter copy (issue to done)"
        )
        self.m_copy_bytes = m.counter("lorapipe_slot_copy_bytes", "Bytes copied host-to-device into slots")
        m.gauge(
            "lorapipe_load_compute_overlap_ratio",
            "Fraction of host-to-device copy time no step's compute waited for",
        ).set_function(lambda: self.overlapped_seconds / self.copy_seconds if self.copy_seconds else 0.0)
        phases = m.gauge(
            "lorapipe_step_phase_seconds",
            "Host seconds of all steps by phase: plan, forward issued, sampling (waits for the GPU), results",
            ["phase"],
        )
        for phase in ("plan", "forward", "sample", "results"):
            phases.labels(phase=phase).set_function(lambda phase=phase: self._phase_seconds(phase))
        m.gauge("lorapipe_decode_graph_replays", "Decode steps replayed as CUDA graphs").set_function(
            self._graph_replays
        )
        m.gauge(
            "lorapipe_step_graph_replays", "Steps with prefill tokens replayed as CUDA graphs"
        ).set_function(self._step_graph_replays)
        m.gauge(
            "lorapipe_gated_step_graph_replays",
            "Of them, steps that waited layer by layer for adapter copies in flight (overlapped loading)",
        ).set_function(self._gated_step_replays)
        m.gauge("lorapipe_adapters_resident", "Adapters resident in the GPU adapter pool").set_function(
            lambda: self.runner.pool.resident() if self.runner is not None else 0
        )

    def _phase_seconds(self, phase: str) -> float:
        return self.executor.phase_seconds[phase] if self.executor is not None else 0.0

    def _graph_replays(self) -> int:
        graphs = self.runner.graphs if self.runner is not None else None
        return graphs.replays if graphs is not None else 0

    def _step_graph_replays(self) -> int:
        graphs = self.runner.step_graphs if self.runner is not None else None
        return graphs.replays if graphs is not None else 0

    def _gated_step_replays(self) -> int:
        graphs = self.runner.step_graphs if self.runner is not None else None
        return graphs.gated_runs if graphs is not None else 0

    async def setup(self) -> None:
        cfg, ep = self.config, self.config.endpoints
        loop = asyncio.get_running_loop()
        # tensor parallel: this process is rank 0 and starts the others from the step thread
        self.rank_zero = RankZero(cfg) if cfg.tensor_parallel_size > 1 else None
        # Connected before the runner builds: the warm-up's progress goes to the scheduler's health meanwhile.
        scheduler = self.socket(PushSocket(ep.worker_to_scheduler, WorkerToScheduler, bind=False))

        def progress(done: int, total: int) -> None:  # on the step thread
            loop.call_soon_threadsafe(self._send_progress, scheduler, WarmupProgress(done=done, total=total))

        before = process_age()  # the interpreter, the imports and the actor's own start
        launched = started_after(self.parent_pid)  # on the launcher's clock
        runner_start = time.perf_counter()
        if self.rank_zero is not None:
            start = self.rank_zero.start
        else:
            start = lambda: ModelRunner(cfg.runner, on_warmup=progress)  # noqa: E731
        # The host cache is page-locked beside the runner's build (the driver touches and locks every
        # page of it: seconds for a few GiB); no copy out of it starts before both are done.
        self.host_pool = attach_pool(cfg.host_pool_name)
        pinning = None
        if torch.device(cfg.runner.device).type == "cuda":
            pinning = loop.run_in_executor(None, self._pin_host_pool)
        self.runner = await loop.run_in_executor(self.thread, start)
        runner_s = time.perf_counter() - runner_start
        mark = time.perf_counter()
        if pinning is not None:
            await pinning
        after = self.after_runner
        after.add("host cache pinning", time.perf_counter() - mark)  # what the runner did not hide
        graphs, steps = self.runner.graphs, self.runner.step_graphs
        if graphs is not None:
            self.log.info(
                "captured %d decode CUDA graphs in %.1f s", len(graphs.graphs), graphs.capture_seconds
            )
        if steps is not None:
            self.log.info(
                "captured %d %s step CUDA graphs (%d layer-gated; token buckets %s) in %.1f s",
                steps.num_graphs,
                "piecewise" if steps.piecewise else "full",
                steps.num_gated,
                ",".join(map(str, steps.buckets)),
                steps.capture_seconds,
            )
        if graphs is not None or steps is not None:
            self.log.info("CUDA graph memory pool: %.0f MiB", self.runner.graph_memory_bytes / 2**20)
        self.cuda = self.runner.device.type == "cuda"
        mark = time.perf_counter()
        if self.cuda:
            self.load_stream = torch.cuda.Stream(self.runner.device)
        self.executor = StepExecutor(
            self.runner,
            self._issue_load,
            cfg.max_model_len,
            seed=cfg.seed,
            overlap_loading=cfg.overlap_loading,
            on_load_done=self._load_done,
        )
        # structured output's tokenizer (about a second for a 128k vocabulary) builds in the background
        # now, so the first request with a grammar does not hold its step for it
        self.executor.guided.prepare()
        after.add("executor", time.perf_counter() - mark)
        mark = time.perf_counter()
        if self.rank_zero is not None:
            self.executor = await loop.run_in_executor(self.thread, self.rank_zero.wrap, self.executor)
            self.add_loop("ranks", self.rank_zero.watch)
        plans = self.mailbox("plans", 4)
        self.add_receiver(
            "scheduler", self.socket(PullSocket(ep.scheduler_to_worker, SchedulerToWorker)), plans
        )
        tokenizer = self.socket(PushSocket(ep.worker_to_tokenizer, WorkerToTokenizer, bind=False))
        profiler = None
        if cfg.profile_dir is not None and cfg.profile_steps is not None:
            profiler = StepProfiler(cfg.profile_dir, *cfg.profile_steps, self.log)
        self.steps = StepLoop(
            self.executor, self.thread, plans, self._send_step, cfg.overlap_schedule, self.log, profiler
        )
        self.add_loop("steps", self.steps.run)
        self.add_sender("scheduler", self.to_scheduler, lambda msg: self._to_scheduler(scheduler, msg))
        self.add_sender("tokenizer", self.to_tokenizer, tokenizer.send)
        self.add_loop("slot_poll", self._poll_idle_loads)
        pool = self.runner.pool
        started = WorkerStarted(
            num_pages=self.runner.num_pages,
            page_size=self.runner.cfg.page_size,
            max_model_len=cfg.max_model_len,
            lora_rows=pool.total_rows,
            lora_ids=pool.num_ids,
            lora_row_bytes=pool.row_nbytes,
            lora_max_rank=pool.layout.max_rank,
        )
        after.add("rest of setup", time.perf_counter() - mark)
        self._startup = (before, launched, runner_s, time.perf_counter())
        await self.to_scheduler.put(started)

    async def _to_scheduler(self, scheduler: PushSocket, msg: Any) -> None:
        await scheduler.send(msg)
        if isinstance(msg, WorkerStarted):
            self._log_startup()
            self.announced.set()

    async def until_ready(self) -> None:
        """Ready once WorkerStarted is on its way: the scheduler plans (and health says ok) from then on."""
        await self.announced.wait()

    def _log_startup(self) -> None:
        """One line, once WorkerStarted is sent: where every second of the worker's start-up went, from
        its process's start to that message (docs/deploy.md, "Compile cache"). The parts follow each
        other, so they add up to the process's age then; "after launch" is on the launcher's clock."""
        assert self._startup is not None
        before, launched, runner_s, setup_end = self._startup
        phases = getattr(self.runner, "phases", None)  # rank zero of a TP group: its own runner's
        runner = dict(phases.seconds) if phases is not None else {}
        runner["rest of the runner"] = max(0.0, runner_s - sum(runner.values()))
        after = {**self.after_runner.seconds, "announce": time.perf_counter() - setup_end}
        warm = getattr(self.runner, "warmup", None)
        parts = f" ({seconds_line(warm.parts)})" if warm and warm.parts else ""
        late = Counter(getattr(self.runner, "capture_compiled", ()))
        age = process_age()
        self.log.info(
            "start-up: process started %s after launch, %s before the model runner (%.2f s of it waiting "
            "for its config); %s; after the runner: %s; WorkerStarted sent %s after launch; warm-up "
            "parts%s; %d kernels compiled during graph capture%s",
            "?" if launched is None else f"{launched:.2f} s",
            "?" if before is None else f"{before:.2f} s",
            startup.config_wait_s,
            seconds_line(runner.items(), 2),
            seconds_line(after.items(), 2),
            "?" if launched is None or age is None else f"{launched + age:.2f} s",
            parts or " -",
            late.total(),
            f" ({', '.join(f'{n} x{c}' for n, c in late.most_common())})" if late else "",
        )

    def _send_progress(self, scheduler: PushSocket, msg: WarmupProgress) -> None:
        """Best effort: a probe that misses one progress message sees the next."""
        with contextlib.suppress(zmq.Again):
            scheduler.send_nowait(msg)

    async def _send_step(self, outcome: StepOutcome) -> None:
        """One step's tokens, then its result (the step loop sends them in plan order)."""
        result, tokens, step = outcome.result, outcome.tokens, outcome.step
        if result.num_tokens and step is not None:
            self.m_step.observe(time.perf_counter() - step.started)  # launch to results, overlap included
            self.m_batch.observe(len(step.scheduled) or 1)
            self.m_tokens.inc(result.num_tokens)
        if tokens is not None and tokens.items:
            await self.to_tokenizer.put(tokens)
        await self.to_scheduler.put(result)

    async def _poll_idle_loads(self) -> None:
        """While no step runs, report copies that completed (the scheduler may be waiting on them)."""
        loop = asyncio.get_running_loop()
        while True:
            # Wake often only while idle: a running step polls its own loads when it ends, and every
            # wake-up here takes the GIL from the step thread.
            pending = self.executor is not None and bool(self.executor.pending) and not self._stepping()
            await asyncio.sleep(0.0005 if pending else 0.005)
            if pending and not self._stepping():
                ready = await loop.run_in_executor(self.thread, self.executor.poll_loads)
                if ready:
                    await self.to_scheduler.put(SlotsReady(slots_ready=ready))

    def _stepping(self) -> bool:
        return self.steps is not None and self.steps.busy

    def _issue_load(self, load: SlotLoad) -> LoadHandle:
        """A pool load from a plan (a fault injected here fails as a copy would: a SlotError)."""
        self._faults.check(load)
        return self._load_slot(load)

    def _load_slot(self, load: SlotLoad) -> LoadHandle:
        """Issue a staged block's copy into its pool rows. On CUDA it runs on the load stream after every
        earlier step (they may still read the adapter that held those rows) and records an event; the
        executor makes compute wait on it only in a step that uses the adapter id. The host block stays
        held until the scheduler hears the id is ready, which is after the event completed."""
        start = time.perf_counter()
        try:
            packed = packed_from_pool(self.host_pool, load, self.runner.host_layout, self.runner.dtype)
            runs = runs_of(load.row_starts, load.row_counts)
            if self.cuda:
                compute = torch.cuda.current_stream(self.runner.device)
                self.load_stream.wait_stream(compute)
                begin = torch.cuda.Event(enable_timing=True)
                begin.record(self.load_stream)
                layers = self.runner.load_adapter(
                    load.slot, packed, runs, stream=self.load_stream, layer_events=load.layered
                )
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.load_stream)
                return LoadHandle(
                    load.slot, load.nbytes, start, event=done, start_event=begin, layer_events=layers
                )
            self.runner.load_adapter(load.slot, packed, runs)
        except Exception:
            self.m_loads.labels(result="failed").inc()
            raise
        return LoadHandle(load.slot, load.nbytes, start, copy_seconds=time.perf_counter() - start)

    def _load_done(self, h: LoadHandle) -> None:
        """Metrics of a completed copy (called in the step thread)."""
        seconds = h.seconds()
        self.m_loads.labels(result="ok").inc()
        self.m_load_s.observe(seconds)
        self.m_copy_bytes.inc(h.nbytes)
        self.copy_seconds += seconds
        if not h.waited and h.event is not None:  # ran on the load stream while steps computed
            self.overlapped_seconds += seconds

    def _pin_host_pool(self) -> None:
        start = time.perf_counter()
        if register_pinned(self.host_pool):
            mib = self.host_pool.size / 2**20
            self.log.info("host cache pinned (%.0f MiB) in %.1f s", mib, time.perf_counter() - start)

    async def drain(self) -> None:
        await super().drain()
        if self.rank_zero is not None:
            await asyncio.get_running_loop().run_in_executor(self.thread, self.rank_zero.close)
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)
            unregister_pinned(self.host_pool)
        close_pool(self.host_pool)
        self.thread.shutdown(wait=True)
        if self.steps is not None:
            self.steps.close()
        if self.executor is not None:
            self.executor.guided.close()
