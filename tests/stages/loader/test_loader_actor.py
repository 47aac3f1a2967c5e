"""The adapter-loader stage over ipc://, with the test playing the scheduler: staged bytes equal the
reader's packed block, host-cache hits, LRU eviction that spares pinned blocks, bad adapters failing
beside good ones, drops, and a killed loader process restarting on the same pool."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

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
from runtime.base.endpoints import Endpoints
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.host_pool import attach_pool, block_tensor, create_pool, pool_bytes_for, unlink_pool
from runtime.common.lora_layout import LoraLayout
from stages.loader.actor import LoaderActor
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_reader import read_adapter
from stages.loader.config import LoaderConfig

ROOT = Path(__file__).resolve().parents[3]
MAX_RANK = 16
DTYPE = torch.bfloat16  # the tiny checkpoint is float32: staging also converts
pytestmark = pytest.mark.timeout(60)


def packed(model, adapters: dict[str, Path], name: str):
    return read_adapter(name, adapters[name], *model, DTYPE)


class Scheduler:
    """A pool, a LoaderConfig and the scheduler's two sockets; the loader runs in-process or not."""

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        layout: LoraLayout,
        max_cpu_loras: int | None,
        pool_bytes: int | None = None,
        **config: Any,
    ) -> None:
        """The pool holds `max_cpu_loras` max-rank blocks unless `pool_bytes` says otherwise."""
        assert pool_bytes or max_cpu_loras
        pool_bytes = pool_bytes or pool_bytes_for(layout, layout.max_rank, DTYPE, max_cpu_loras)
        self.pool = create_pool("lptest-", pool_bytes)
        self.ep = Endpoints.in_run_dir(run_dir, client=f"ipc://{run_dir}/client.sock")
        self.cfg = LoaderConfig(
            endpoints=self.ep,
            model_dir=str(model_dir),
            dtype="bfloat16",
            max_lora_rank=layout.max_rank,
            max_cpu_loras=max_cpu_loras,
            host_pool_name=self.pool.name,
            host_pool_bytes=pool_bytes,
            drain_timeout_s=5,
            **config,
        )
        self.layout = layout
        self.out = PushSocket(self.ep.scheduler_to_loader, SchedulerToLoader)
        self.inp = PullSocket(self.ep.loader_to_scheduler, LoaderToScheduler)

    async def send(self, *msgs: Any) -> None:
        for msg in msgs:
            await self.out.send(msg)

    async def recv(self, kind: type | None = None) -> Any:
        msg = await asyncio.wait_for(self.inp.recv(), 20)
        assert kind is None or isinstance(msg, kind), msg
        return msg

    async def stage(self, name: str, path: Path) -> Any:
        await self.send(StageAdapter(name=name, path=str(path)))
        return await self.recv()

    def block(self, staged: AdapterStaged) -> torch.Tensor:
        return block_tensor(self.pool, staged.offset, staged.rank, self.layout, DTYPE).clone()

    def close(self) -> None:
        self.out.close()
        self.inp.close()
        unlink_pool(self.pool)


def run_loader(run_dir, tiny_llama, model, body, max_cpu_loras: int | None = 4, **kw: Any) -> None:
    s = Scheduler(run_dir, tiny_llama, model[1], max_cpu_loras, **kw)

    async def main() -> None:
        actor = LoaderActor(s.cfg)
        task = asyncio.create_task(actor.run())
        try:
            await s.recv(LoaderStarted)
            await body(s, actor)
            assert not task.done(), "the loader stopped"
        finally:
            actor.request_drain()
            actor.request_drain()
            assert await asyncio.wait_for(task, 20) == 0

    try:
        asyncio.run(main())
    finally:
        s.close()


def metric(actor: LoaderActor, name: str, **labels: str) -> float | None:
    return actor.metrics.registry.get_sample_value(name, {"stage": "loader", **labels})


def test_staged_block_equals_the_readers_and_a_second_stage_hits(run_dir, tiny_llama, model, llama_adapters):
    async def body(s: Scheduler, actor: LoaderActor) -> None:
        want = packed(model, llama_adapters, "full8")
        staged = await s.stage("full8", llama_adapters["full8"])
        assert isinstance(staged, AdapterStaged) and not staged.cache_hit and staged.load_time > 0
        assert (staged.name, staged.shm_name, staged.rank) == ("full8", s.pool.name, 8)
        assert staged.dtype == "bfloat16"
        assert staged.nbytes == want.nbytes and staged.layer_nbytes * model[0].num_layers == want.nbytes
        assert staged.offset % 4096 == 0
        assert torch.equal(s.block(staged), want.block)  # bit for bit
        assert staged.slice_ranks == want.ranks.flatten().tolist()
        assert staged.slice_scalings == want.scalings.flatten().tolist()

        hit = await s.stage("full8", llama_adapters["full8"])
        assert hit == msgspec.structs.replace(staged, cache_hit=True, load_time=0.0)
        # two StageAdapters for one name while it loads: one read from disk, two answers
        await s.send(*[StageAdapter(name="qv5", path=str(llama_adapters["qv5"]))] * 2)
        a, b = await s.recv(AdapterStaged), await s.recv(AdapterStaged)
        assert a.offset == b.offset and a.offset != staged.offset
        assert torch.equal(s.block(a), packed(model, llama_adapters, "qv5").block)

        assert metric(actor, "lorapipe_adapter_loads_total", result="staged") == 2
        assert metric(actor, "lorapipe_host_cache_hits_total") == 1 + (a.cache_hit or b.cache_hit)
        assert metric(actor, "lorapipe_adapter_load_bytes_total") == want.nbytes + a.nbytes
        assert metric(actor, "lorapipe_adapter_load_seconds_count") == 2
        assert metric(actor, "lorapipe_host_cache_adapters", state="resident") == 2
        assert metric(actor, "lorapipe_host_cache_adapters", state="pinned") == 2
        assert metric(actor, "lorapipe_host_cache_bytes_used") == want.nbytes + a.nbytes

    run_loader(run_dir, tiny_llama, model, body)


def test_lru_eviction_spares_pinned_blocks(run_dir, tiny_llama, model, llama_adapters):
    paths = llama_adapters

    async def body(s: Scheduler, actor: LoaderActor) -> None:
        a = await s.stage("full8", paths["full8"])
        await s.stage("qv5", paths["qv5"])
        full = await s.stage("mlp1", paths["mlp1"])  # both cached blocks are pinned: nothing to evict
        assert isinstance(full, AdapterFailed) and "every cached adapter is in use" in full.message
        assert full.retryable
        await s.send(ReleaseAdapter(name="full8"), ReleaseAdapter(name="qv5"))
        assert (await s.stage("full8", paths["full8"])).cache_hit  # full8 is now the most recent
        await s.send(ReleaseAdapter(name="full8"))

        assert await s.stage("mlp1", paths["mlp1"]) == Evicted(name="qv5")  # least recently used
        mlp1 = await s.recv(AdapterStaged)
        assert await s.stage("rs12", paths["rs12"]) == Evicted(name="full8")  # mlp1 is pinned
        rs12 = await s.recv(AdapterStaged)
        assert not rs12.cache_hit and a.offset == 0
        assert mlp1.offset + mlp1.nbytes <= rs12.offset or rs12.offset + rs12.nbytes <= mlp1.offset
        assert torch.equal(s.block(mlp1), packed(model, paths, "mlp1").block)  # not overwritten
        assert torch.equal(s.block(rs12), packed(model, paths, "rs12").block)
        assert isinstance(await s.stage("full8", paths["full8"]), AdapterFailed)  # evicted; both pinned
        assert metric(actor, "lorapipe_host_cache_evictions_total") == 2
        assert metric(actor, "lorapipe_adapter_loads_total", result="failed") == 2

    run_loader(run_dir, tiny_llama, model, body, max_cpu_loras=2)


def test_a_corrupt_adapter_fails_with_the_readers_message_beside_a_good_one(
    run_dir, tiny_llama, model, llama_adapters, tmp_path
):
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["full8"], bad)
    data = (bad / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError) as reader:
        read_adapter("bad", bad, *model, DTYPE)

    async def body(s: Scheduler, actor: LoaderActor) -> None:
        await s.send(StageAdapter(name="bad", path=str(bad)), StageAdapter(name="empty", path=str(tmp_path)))
        await s.send(StageAdapter(name="qv5", path=str(llama_adapters["qv5"])))
        replies = {m.name: m for m in [await s.recv() for _ in range(3)]}
        assert replies["bad"] == AdapterFailed(name="bad", message=str(reader.value), retryable=False)
        assert isinstance(replies["empty"], AdapterFailed) and "no adapter_config" in replies["empty"].message
        assert isinstance(replies["qv5"], AdapterStaged)
        assert torch.equal(s.block(replies["qv5"]), packed(model, llama_adapters, "qv5").block)
        assert await s.stage("bad", bad) == replies["bad"]  # a failure is not cached: read again
        assert metric(actor, "lorapipe_adapter_loads_total", result="failed") == 3
        assert metric(actor, "lorapipe_host_cache_adapters", state="resident") == 1

    run_loader(run_dir, tiny_llama, model, body)


def test_drop_frees_the_block_and_waits_for_pinned_ones(run_dir, tiny_llama, model, llama_adapters):
    path = str(llama_adapters["mlp1"])
    gate = threading.Event()  # holds the qv5 read until its DropAdapter was handled

    async def body(s: Scheduler, actor: LoaderActor) -> None:
        read = actor._read
        actor._read = lambda job, limits: (job.name != "qv5" or gate.wait(20)) and read(job, limits)
        first = await s.stage("mlp1", path)
        # dropped while pinned: a StageAdapter meanwhile waits for the release, then reads it afresh
        await s.send(DropAdapter(name="mlp1"), StageAdapter(name="mlp1", path=path))
        await s.send(ReleaseAdapter(name="mlp1"))
        again = await s.recv(AdapterStaged)
        assert not again.cache_hit and again.offset == first.offset
        await s.send(ReleaseAdapter(name="mlp1"), DropAdapter(name="mlp1"))
        assert not (await s.stage("mlp1", path)).cache_hit
        # dropped while loading: the load is answered as failed and its block freed
        await s.send(StageAdapter(name="qv5", path=str(llama_adapters["qv5"])), DropAdapter(name="qv5"))
        assert (await s.stage("mlp1", path)).cache_hit  # answered after the DropAdapter was handled
        gate.set()
        gone = await s.recv(AdapterFailed)
        assert gone.name == "qv5" and "unloaded" in gone.message
        assert metric(actor, "lorapipe_host_cache_adapters", state="resident") == 1
        assert metric(actor, "lorapipe_host_cache_misses_total") == 4

    try:
        run_loader(run_dir, tiny_llama, model, body)
    finally:
        gate.set()


def test_a_killed_loader_restarts_on_the_same_pool(run_dir, tiny_llama, model, llama_adapters):
    s = Scheduler(run_dir, tiny_llama, model[1], max_cpu_loras=2)
    cfg_path = run_dir / "loader.json"
    cfg_path.write_bytes(msgspec.json.encode(s.cfg))
    want = packed(model, llama_adapters, "rs12")
    procs: list[subprocess.Popen] = []

    def spawn() -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-m", "stages.loader", str(cfg_path)], cwd=ROOT))
        return procs[-1]

    async def main() -> None:
        first = spawn()
        assert (await s.recv(LoaderStarted)).pid == first.pid
        staged = await s.stage("rs12", llama_adapters["rs12"])
        assert isinstance(staged, AdapterStaged)
        first.kill()
        first.wait(timeout=10)
        attached = attach_pool(s.pool.name)  # the pool and its bytes survive the loader
        assert torch.equal(block_tensor(attached, staged.offset, 12, s.layout, DTYPE), want.block)
        attached.close()

        second = spawn()
        assert (await s.recv(LoaderStarted)).pid == second.pid
        restaged = await s.stage("rs12", llama_adapters["rs12"])  # an empty cache: read again
        assert isinstance(restaged, AdapterStaged) and not restaged.cache_hit
        assert restaged.shm_name == s.pool.name and torch.equal(s.block(restaged), want.block)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
        attach_pool(s.pool.name).close()  # a clean exit leaves it too

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)
        s.close()
