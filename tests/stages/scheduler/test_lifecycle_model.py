"""A model-based randomized test of the adapter lifecycle: the real scheduler actor (its one handler, in
process) and the real adapter-loader (its handler and load loops, reading real adapter files into a
real shared-memory pool), wired by the test, with a stand-in only for the GPU worker's copy and forward
(`PoolWorker`, which checks the pool rows). Hypothesis drives random sequences of arrivals over many
mixed-rank adapters, aborts, load and unload ops, loader deaths, loader handler faults, failed reads (a
broken adapter), slow answers (a message held back while others pass) and the passage of time, on tiny
host caches and pools. After every step it checks that no host range or pool row is owned twice, that
no hold is negative, that every staged adapter has its block (the bytes a copy reads are the adapter's
own), and at the end that every request ended, done or with a typed error, within a bound, and every
gauge is back to zero. A failing sequence prints as replayable steps."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from proto.base import TokenIds
from proto.loader import LoaderStarted, StageAdapter
from proto.pipeline import (
    AbortRequest,
    LoadAdapterOp,
    OpDone,
    OpFailed,
    RequestFailed,
    TokenizedRequest,
    UnloadAdapterOp,
)
from proto.plan import BatchPlan, SlotsReady, WorkerStarted
from proto.sampling import SamplingParams
from runtime.base.endpoints import Endpoints
from runtime.base.faults import FaultInjection
from runtime.common.host_pool import block_tensor, create_pool, pool_bytes_for, unlink_pool
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from stages.loader.actor import LoaderActor
from stages.loader.adapter_reader import read_adapter
from stages.loader.config import LoaderConfig
from stages.scheduler.actor import SchedulerActor
from stages.scheduler.adapter_waits import AdapterDeadlines
from stages.scheduler.adapters import HostTier
from stages.scheduler.config import SchedulerConfig
from stages.scheduler.planner_config import PlannerPolicy
from tests.stages.scheduler.pool_worker import PoolWorker, check_pool

MAX_RANK = 16
DTYPE = torch.bfloat16
NAMES = 12  # adapter names (symlinks onto the four real adapters of ranks 1, 5, 8 and 12)
RUNTIME = ("late0", "late1")  # names only a load op registers
TIMEOUT_S = 60.0  # the adapter-wait timeout, on the test's clock
QUIESCE_ROUNDS = 400  # pump rounds after which every request must have ended
KINDS = ("adapter_load_failed", "stage_failed", "adapter_timeout", "unknown_adapter")  # typed ends
EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "1000"))  # about a minute on 2 cores
pytestmark = pytest.mark.timeout(300)


@dataclass
class World:
    model_dir: str
    layout: LoraLayout
    paths: dict[str, str]  # every name a request or a load op may use
    blocks: dict[str, torch.Tensor]  # the packed block each name must have in the host pool
    block_bytes: int


_WORLD: World | None = None


@pytest.fixture(scope="module", autouse=True)
def world(tiny_llama, llama_adapters, tmp_path_factory) -> World:
    global _WORLD
    cfg = ModelConfig.from_dir(tiny_llama)
    layout = LoraLayout.for_model(cfg, MAX_RANK)
    d = tmp_path_factory.mktemp("lifecycle_adapters")
    real = sorted(llama_adapters.items())
    paths: dict[str, str] = {}
    for i, name in enumerate([f"a{i}" for i in range(NAMES)] + list(RUNTIME)):
        (d / name).symlink_to(real[i % len(real)][1])
        paths[name] = str(d / name)
    broken = d / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    paths["broken"] = str(broken)
    blocks = {
        n: read_adapter(n, Path(p), cfg, layout, DTYPE).block for n, p in paths.items() if n != "broken"
    }
    _WORLD = World(str(tiny_llama), layout, paths, blocks, pool_bytes_for(layout, MAX_RANK, DTYPE, 1))
    return _WORLD


class System:
    """The scheduler and the loader in one event loop; the test delivers each message (the sockets)."""

    def __init__(self, w: World, host_blocks: int, pool_rows: int, pool_ids: int, run_dir: str) -> None:
        self.w = w
        self.now = 0.0
        self.pool = create_pool("lptest-model-", host_blocks * w.block_bytes)
        self.ep = Endpoints.in_run_dir(run_dir, client=f"ipc://{run_dir}/client.sock")
        startup = {n: w.paths[n] for n in ("a0", "a1", "a2", "broken")}
        self.sched = SchedulerActor(
            SchedulerConfig(
                endpoints=self.ep,
                host_cache_bytes=host_blocks * w.block_bytes,
                max_block_bytes=w.block_bytes,
                adapter_wait_timeout_s=TIMEOUT_S,
                max_model_len=64,
                policy=PlannerPolicy(
                    max_running_requests=6,
                    max_tokens_per_step=64,
                    pinned_adapters=("a3",),
                    overlap_min_mb=0.0,
                    prefetch_depth=2,
                ),
                adapters={**startup, **{f"a{i}": w.paths[f"a{i}"] for i in range(NAMES)}},
            )
        )
        self.sched.lifecycle.clock = lambda: self.now
        self.loader_cfg = LoaderConfig(
            endpoints=self.ep,
            model_dir=w.model_dir,
            dtype="bfloat16",
            max_lora_rank=MAX_RANK,
            host_pool_name=self.pool.name,
            host_pool_bytes=host_blocks * w.block_bytes,
            load_threads=2,
            trusted_paths=tuple(os.path.realpath(p) for p in w.paths.values()),
        )
        self.loader: LoaderActor | None = None
        self.loader_tasks: list[asyncio.Task] = []
        self.held: list[Any] = []  # loader answers held back (slow reads)
        self.worker = None  # PoolWorker once started
        self.pool_rows, self.pool_ids = pool_rows, pool_ids
        self.requests: dict[str, str | None] = {}  # open request id -> adapter
        self.adapter_of: dict[str, str | None] = {}  # every request id -> adapter
        self.ended: dict[str, str] = {}  # request id -> "done" | error kind
        self.ops: dict[int, str] = {}  # open op id -> name
        self.next_id = 0
        self.faulty: set[str] = set()  # adapters whose StageAdapter the loader's handler fails on

    # --- the stages ---------------------------------------------------------------------------------
    async def start_loader(self) -> None:
        self.loader = LoaderActor(self.loader_cfg)
        self.loader.open_pool()
        self.loader._faults = FaultInjection(tuple(("StageAdapter", f"'{n}'") for n in self.faulty))
        self.loader_tasks = [asyncio.create_task(self.loader._load_loop()) for _ in range(2)]
        await self.deliver_to_scheduler(LoaderStarted(pid=0))

    async def kill_loader(self) -> None:
        """The loader dies: its unanswered writes are lost. Its threads finish first (a dead process
        writes nothing more after it is gone), then its answers are dropped unread."""
        loader = self.loader
        async with asyncio.timeout(30):
            while loader.loading:
                await asyncio.sleep(0.001)
        for t in self.loader_tasks:
            t.cancel()
        await asyncio.gather(*self.loader_tasks, return_exceptions=True)
        loader.executor.shutdown(wait=True)
        loader.pool.close()
        self.held.clear()
        await self.start_loader()

    async def deliver_to_scheduler(self, msg: Any) -> None:
        await self.sched.dispatch("events", self.sched.handle, msg)
        await self.flush()

    async def flush(self) -> None:
        """Carry what the scheduler sent: writes to the loader, failures and op replies to the test."""
        s = self.sched
        while not s.to_loader.empty():
            msg = s.to_loader.get_nowait()
            assert isinstance(msg, StageAdapter)
            await self.loader.dispatch("scheduler_requests", self.loader.handle_scheduler, msg)
        while not s.to_tokenizer.empty():
            msg = s.to_tokenizer.get_nowait()
            match msg:
                case RequestFailed(request_id=rid, kind=kind):
                    assert rid in self.requests, f"{rid} failed twice or was never sent"
                    assert kind in (
                        "adapter_load_failed",
                        "stage_failed",
                        "adapter_timeout",
                        "unknown_adapter",
                    )
                    self.requests.pop(rid)
                    self.ended[rid] = kind
                case OpDone(op_id=op) | OpFailed(op_id=op):
                    self.ops.pop(op)

    async def loader_answers(self, hold: bool = False) -> None:
        """Wait for the loader's writes to finish, then deliver its answers (or hold the first back)."""
        loader = self.loader
        async with asyncio.timeout(30):
            while loader.loading and any(not t.done() for t in self.loader_tasks):
                if not loader.to_scheduler.empty():
                    break
                await asyncio.sleep(0.001)
        while not loader.to_scheduler.empty():
            msg = loader.to_scheduler.get_nowait()
            if hold and not self.held:
                self.held.append(msg)
                continue
            await self.deliver_to_scheduler(msg)

    async def release_held(self) -> None:
        while self.held:
            await self.deliver_to_scheduler(self.held.pop(0))

    async def step(self) -> None:
        """The worker runs the next plan: each copy's bytes are checked against the adapter's own."""
        s = self.sched
        if s.to_worker.empty():  # idle: the worker reports the copies that completed meanwhile
            ready, self.worker.pending = self.worker.pending, []
            if ready:
                await self.deliver_to_scheduler(SlotsReady(slots_ready=ready))
            return
        plan: BatchPlan = s.to_worker.get_nowait()
        for load in plan.slot_loads:
            got = block_tensor(self.pool, load.offset, load.rank, self.w.layout, DTYPE)
            assert torch.equal(got, self.w.blocks[load.adapter]), f"{load.adapter}: its block was overwritten"
        res = self.worker.run(plan)
        for f in res.finished:
            self.requests.pop(f.request_id, None)
            self.ended.setdefault(f.request_id, "done")
        await self.deliver_to_scheduler(res)

    # --- traffic ------------------------------------------------------------------------------------
    async def arrive(self, adapter: str | None, prompt: int, out: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = self.adapter_of[rid] = adapter
        sampling = SamplingParams(max_tokens=out, ignore_eos=True)
        msg = TokenizedRequest(
            request_id=rid, prompt_ids=TokenIds.of([1] * prompt), adapter=adapter, sampling=sampling
        )
        await self.deliver_to_scheduler(msg)

    async def abort(self, index: int) -> None:
        if self.requests:
            rid = sorted(self.requests)[index % len(self.requests)]
            self.requests.pop(rid)
            self.ended[rid] = "aborted"
            await self.deliver_to_scheduler(AbortRequest(request_id=rid))

    async def op(self, load: bool, name: str) -> None:
        self.next_id += 1
        self.ops[self.next_id] = name
        if load:
            msg = LoadAdapterOp(op_id=self.next_id, name=name, path=self.w.paths[name])
        else:
            msg = UnloadAdapterOp(op_id=self.next_id, name=name)
        await self.deliver_to_scheduler(msg)

    async def tick(self, seconds: float) -> None:
        self.now += seconds
        if self.sched.planner is not None:
            self.sched.planner.clock = lambda: self.now
        await self.deliver_to_scheduler(AdapterDeadlines())

    async def quiesce(self) -> None:
        """Run everything (answers released, time passing) until no request is open."""
        for _ in range(QUIESCE_ROUNDS):
            writes = self.sched.adapters.count(HostTier.WRITING)
            busy = self.sched.to_worker.qsize() or self.worker.pending or writes or self.held
            if not (self.requests or self.ops or busy or self.sched.lifecycle.warmer.active):
                break
            await self.release_held()
            await self.loader_answers()
            await self.step()
            await self.tick(1.0)

    # --- checks -------------------------------------------------------------------------------------
    def check(self) -> None:
        s, life = self.sched, self.sched.lifecycle
        table = s.host_table
        spans = sorted((r.offset, r.offset + r.size, n) for n, r in table.ranges.items())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            assert end <= start, f"host ranges of {a} and {b} overlap"
        assert not spans or spans[-1][1] <= table.capacity
        for e in s.adapters.entries.values():
            assert e.copies >= 0, f"{e.name}: negative holds"
            has_range = e.name in table
            assert has_range == (e.host is not HostTier.DISK), f"{e.name} is {e.host} with range {has_range}"
            if e.host is HostTier.HOST:
                assert (
                    e.staged.offset == table.get(e.name).offset and e.staged.nbytes <= table.get(e.name).size
                )
        assert sum(e.copies for e in s.adapters.entries.values()) == sum(map(len, life.pool_loads.values()))
        assert life.writes == s.adapters.count(HostTier.WRITING), "the writes counter drifted"
        validating = {n for n, e in s.adapters.entries.items() if e.state.value == "validating"}
        assert s.adapters.validating == validating, "the validating set drifted"
        for name in table.ranges:
            assert name in s.adapters.entries, f"a range for {name}, which is not registered"
        writing = {e.write_id for e in s.adapters.entries.values() if e.host is HostTier.WRITING}
        assert set(self.loader.loading) <= writing | {m.write_id for m in self.held}, "a write nobody owns"
        if s.planner is not None:
            check_pool(s.planner)

    def check_quiet(self) -> None:
        s = self.sched
        assert not self.requests, f"requests never ended: {sorted(self.requests)}"
        assert not self.ops, f"ops never answered: {self.ops}"
        p = s.planner
        assert not p.waiting and not p.running
        assert p.pages.num_free == p.cfg.num_pages, "KV pages leaked"
        assert all(r.refs == 0 for r in p.pool.residents.values()), "pool references leaked"
        assert s.adapters.copies() == 0 and not s.lifecycle.pool_loads, "copies leaked"
        assert s.adapters.count(HostTier.WRITING) == 0 and not self.loader.loading, "writes leaked"

    async def stop_loader(self) -> None:
        for t in self.loader_tasks:
            t.cancel()
        await asyncio.gather(*self.loader_tasks, return_exceptions=True)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.executor.shutdown(wait=True)
            self.loader.pool.close()
        unlink_pool(self.pool)


ADAPTERS = st.sampled_from([None, *[f"a{i}" for i in range(NAMES)]])


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.sys: System | None = None
        self._dir = None

    def run(self, coro) -> None:
        self.loop.run_until_complete(coro)

    @initialize(
        host_blocks=st.integers(1, 3), pool_rows=st.sampled_from([16, 24, 40]), pool_ids=st.integers(1, 3)
    )
    def start(self, host_blocks: int, pool_rows: int, pool_ids: int) -> None:
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="lptest-model-")
        self.sys = System(_WORLD, host_blocks, pool_rows, pool_ids, self._dir.name)

        async def boot() -> None:
            await self.sys.start_loader()
            await self.sys.loader_answers()
            await self.sys.deliver_to_scheduler(
                WorkerStarted(
                    num_pages=32,
                    page_size=16,
                    max_model_len=64,
                    lora_rows=pool_rows,
                    lora_ids=pool_ids,
                    lora_row_bytes=1,
                    lora_max_rank=MAX_RANK,
                )  # fmt: skip
            )
            self.sys.worker = PoolWorker(
                self.sys.sched.planner,
                _ranks(self.sys.sched),
                overlap=True,
                adapter_of=self.sys.adapter_of.get,
            )
            self.sys.sched.planner.clock = lambda: self.sys.now

        self.run(boot())

    @rule(adapter=ADAPTERS, prompt=st.integers(1, 40), out=st.integers(1, 12))
    def arrive(self, adapter, prompt, out) -> None:
        self.run(self.sys.arrive(adapter, prompt, out))

    @rule(adapter=st.sampled_from(["broken", *RUNTIME]))
    def arrive_unusual(self, adapter) -> None:
        self.run(self.sys.arrive(adapter, 4, 2))

    @rule(index=st.integers(0, 100))
    def abort(self, index) -> None:
        self.run(self.sys.abort(index))

    @rule(hold=st.booleans())
    def loader_answers(self, hold) -> None:
        self.run(self.sys.loader_answers(hold))

    @rule()
    def release_held(self) -> None:
        self.run(self.sys.release_held())

    @rule(steps=st.integers(1, 4))
    def worker_steps(self, steps) -> None:
        for _ in range(steps):
            self.run(self.sys.step())

    @rule(load=st.booleans(), name=st.sampled_from([*RUNTIME, "a4", "a5"]))
    def adapter_op(self, load, name) -> None:
        self.run(self.sys.op(load, name))

    @rule()
    def kill_loader(self) -> None:
        self.run(self.sys.kill_loader())

    @rule(name=st.sampled_from([f"a{i}" for i in range(NAMES)]))
    def loader_fault(self, name) -> None:
        self.sys.faulty.add(name)
        self.sys.loader._faults = FaultInjection(tuple(("StageAdapter", f"'{n}'") for n in self.sys.faulty))

    @rule(seconds=st.sampled_from([1.0, 10.0, TIMEOUT_S]))
    def time_passes(self, seconds) -> None:
        self.run(self.sys.tick(seconds))

    @invariant()
    def consistent(self) -> None:
        if self.sys is not None:
            self.sys.check()

    def teardown(self) -> None:
        if self.sys is None:
            return
        try:
            self.run(self.sys.quiesce())
            self.sys.check()
            self.sys.check_quiet()
        finally:
            self.run(self.sys.stop_loader())
            self.sys.close()
            self.loop.close()
            self._dir.cleanup()


def _ranks(sched: SchedulerActor) -> dict[str, int]:
    """PoolWorker's rank table: the planner's rows for each adapter, read when a load comes."""

    class Ranks(dict):
        def __missing__(self, name: str) -> int:
            return sched.adapters.rows(name)

    return Ranks()


Lifecycle.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLifecycle = Lifecycle.TestCase
