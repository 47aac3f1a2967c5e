"""The adapter-loader stage over ipc://, with the test playing the scheduler (its own HostTable places
every range, as the scheduler's does): staged bytes equal the reader's packed block at the range the
loader was told, bad adapters fail beside good ones, a range outside the pool and a failing handler are
answered as the loader's own faults while it serves on, and a killed loader restarting on the same pool
leaves the blocks written before intact and never answers the writes it lost."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
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
from runtime.base import faults
from runtime.base.endpoints import Endpoints
from runtime.base.sockets import PullSocket, PushSocket
from runtime.common.host_pool import (
    ALIGN,
    attach_pool,
    block_tensor,
    create_pool,
    pool_bytes_for,
    unlink_pool,
)
from runtime.common.lora_layout import LoraLayout
from stages.loader.actor import LoaderActor
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_reader import read_adapter
from stages.loader.config import LoaderConfig
from stages.scheduler.host_table import HostTable, aligned

ROOT = Path(__file__).resolve().parents[3]
MAX_RANK = 16
DTYPE = torch.bfloat16  # the tiny checkpoint is float32: staging also converts
SENTINEL = 0xA5  # pool bytes no write may touch
pytestmark = pytest.mark.timeout(60)


def packed(model, adapters: dict[str, Path], name: str):
    return read_adapter(name, adapters[name], *model, DTYPE)


class Scheduler:
    """A pool, a LoaderConfig, the scheduler's two sockets and its host table; the loader runs in-process
    or not. Like the scheduler, it reserves a max-rank block for a staging of unknown rank (the rank is
    known only once the adapter is read), numbers writes, trims a staged range to the answer's bytes,
    frees the range of a failed write, and on LoaderStarted frees the ranges of the writes in flight (the
    restarted loader will not answer them). Every answer must answer a write in flight, once."""

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        layout: LoraLayout,
        blocks: int | None = 4,
        pool_bytes: int | None = None,
        **config: Any,
    ) -> None:
        """The pool holds `blocks` max-rank blocks unless `pool_bytes` says otherwise."""
        self.max_block = pool_bytes_for(layout, layout.max_rank, DTYPE, 1)  # aligned
        assert pool_bytes or blocks
        pool_bytes = pool_bytes or blocks * self.max_block
        self.pool = create_pool("lptest-", pool_bytes)
        self.table = HostTable(pool_bytes)
        self.write_ids = itertools.count(1)
        self.writing: dict[int, StageAdapter] = {}  # write_id -> its StageAdapter, until answered
        self.unplaced: set[int] = set()  # write_ids of ranges the table did not place
        self.ep = Endpoints.in_run_dir(run_dir, client=f"ipc://{run_dir}/client.sock")
        self.cfg = LoaderConfig(
            endpoints=self.ep,
            model_dir=str(model_dir),
            dtype="bfloat16",
            max_lora_rank=layout.max_rank,
            host_pool_name=self.pool.name,
            host_pool_bytes=pool_bytes,
            drain_timeout_s=5,
            **config,
        )
        self.layout = layout
        self.out = PushSocket(self.ep.scheduler_to_loader, SchedulerToLoader)
        self.inp = PullSocket(self.ep.loader_to_scheduler, LoaderToScheduler)

    def request(self, name: str, path: Path | str, nbytes: int | None = None) -> StageAdapter:
        """A StageAdapter for a range the table places: `nbytes` when the block's size is known, else a
        max-rank block's."""
        placed = self.table.place(name, nbytes or self.max_block)
        assert placed is not None, f"the test's pool has no room for {name!r}"
        offset, _ = placed
        capacity = self.table.get(name).size
        msg = StageAdapter(name, str(path), offset, capacity, next(self.write_ids))
        self.writing[msg.write_id] = msg
        return msg

    def unplaced_request(self, name: str, path: Path | str, offset: int, capacity: int) -> StageAdapter:
        """A StageAdapter for a range the table did not place (as a scheduler bug would send)."""
        msg = StageAdapter(name, str(path), offset, capacity, next(self.write_ids))
        self.writing[msg.write_id] = msg
        self.unplaced.add(msg.write_id)
        return msg

    async def send(self, *msgs: Any) -> None:
        for msg in msgs:
            await self.out.send(msg)

    async def recv(self, kind: type | None = None) -> Any:
        msg = await asyncio.wait_for(self.inp.recv(), 20)
        assert kind is None or isinstance(msg, kind), msg
        if isinstance(msg, AdapterStaged | AdapterFailed):
            sent = self.writing.pop(msg.write_id, None)
            assert sent is not None and sent.name == msg.name, f"{msg} answers no write in flight"
            placed = msg.write_id not in self.unplaced
            if isinstance(msg, AdapterStaged):
                assert msg.offset == sent.offset and msg.nbytes <= sent.capacity, (msg, sent)
                if placed:
                    self.table.shrink(msg.name, msg.nbytes)
            elif placed:
                self.table.free(msg.name)
        elif isinstance(msg, LoaderStarted):  # the writes in flight are lost: their ranges are free
            for sent in self.writing.values():
                if sent.write_id not in self.unplaced:
                    self.table.free(sent.name)
            self.writing.clear()
        return msg

    async def stage(self, name: str, path: Path | str, nbytes: int | None = None) -> Any:
        """Stage one adapter and return its answer (which must carry the write's id)."""
        sent = self.request(name, path, nbytes)
        await self.send(sent)
        answer = await self.recv(AdapterStaged | AdapterFailed)
        assert answer.write_id == sent.write_id, (answer, sent)
        return answer

    def block(self, staged: AdapterStaged) -> torch.Tensor:
        return block_tensor(self.pool, staged.offset, staged.rank, self.layout, DTYPE).clone()

    def fill(self, byte: int = SENTINEL) -> bytes:
        """Fill the pool with `byte`; returns its contents."""
        self.pool.buf[:] = bytes([byte]) * self.pool.size
        return bytes(self.pool.buf)

    def close(self) -> None:
        self.out.close()
        self.inp.close()
        unlink_pool(self.pool)


def run_loader(run_dir, tiny_llama, model, body, blocks: int | None = 4, **kw: Any) -> None:
    s = Scheduler(run_dir, tiny_llama, model[1], blocks, **kw)

    async def main() -> None:
        actor = LoaderActor(s.cfg)
        task = asyncio.create_task(actor.run())
        try:
            await s.recv(LoaderStarted)
            await body(s, actor)
            assert not task.done(), "the loader stopped"
            assert not s.writing, f"writes never answered: {s.writing}"
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


def test_staged_blocks_equal_the_readers_at_the_ranges_given(run_dir, tiny_llama, model, llama_adapters):
    async def body(s: Scheduler, actor: LoaderActor) -> None:
        qv5 = await s.stage("qv5", llama_adapters["qv5"])
        assert isinstance(qv5, AdapterStaged) and qv5.offset == 0
        # full8 goes right after qv5's trimmed range: the loader writes where it is told, not at 0
        want = packed(model, llama_adapters, "full8")
        sent = s.request("full8", llama_adapters["full8"])
        assert sent.offset == aligned(qv5.nbytes) > 0
        await s.send(sent)
        staged = await s.recv(AdapterStaged)
        assert (staged.name, staged.shm_name, staged.rank) == ("full8", s.pool.name, 8)
        assert (staged.offset, staged.write_id) == (sent.offset, sent.write_id)
        assert staged.dtype == "bfloat16" and staged.load_time > 0
        assert staged.nbytes == want.nbytes and staged.layer_nbytes * model[0].num_layers == want.nbytes
        assert torch.equal(s.block(staged), want.block)  # bit for bit
        assert staged.slice_ranks == want.ranks.flatten().tolist()
        assert staged.slice_scalings == want.scalings.flatten().tolist()
        assert torch.equal(s.block(qv5), packed(model, llama_adapters, "qv5").block)  # its neighbour intact

        assert metric(actor, "lorapipe_adapter_loads_total", result="staged") == 2
        assert metric(actor, "lorapipe_adapter_load_bytes_total") == want.nbytes + qv5.nbytes
        assert metric(actor, "lorapipe_adapter_load_seconds_count") == 2
        assert metric(actor, "lorapipe_loader_writes_in_flight") == 0

    run_loader(run_dir, tiny_llama, model, body)


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
        sent = {
            "bad": s.request("bad", bad),
            "empty": s.request("empty", tmp_path),
            "qv5": s.request("qv5", llama_adapters["qv5"]),
        }
        await s.send(*sent.values())
        replies = {m.name: m for m in [await s.recv() for _ in range(3)]}
        # the adapter's own fault (stage_fault False): the scheduler marks it failed, not to be retried
        assert replies["bad"] == AdapterFailed(
            name="bad", message=str(reader.value), write_id=sent["bad"].write_id, stage_fault=False
        )
        empty = replies["empty"]
        assert isinstance(empty, AdapterFailed) and "no adapter_config" in empty.message
        assert empty.write_id == sent["empty"].write_id and not empty.stage_fault
        assert isinstance(replies["qv5"], AdapterStaged)
        assert torch.equal(s.block(replies["qv5"]), packed(model, llama_adapters, "qv5").block)
        again = await s.stage("bad", bad)  # asked again, read again: nothing of a failure is kept
        assert again == msgspec.structs.replace(replies["bad"], write_id=again.write_id)
        assert metric(actor, "lorapipe_adapter_loads_total", result="failed") == 3
        assert metric(actor, "lorapipe_adapter_loads_total", result="staged") == 1

    run_loader(run_dir, tiny_llama, model, body)


def test_a_range_outside_the_pool_is_the_loaders_fault_and_it_serves_on(
    run_dir, tiny_llama, model, llama_adapters
):
    """A range the scheduler should never send: answered as the loader's fault (stage_fault, the same
    write_id) before anything is written, even where the block itself would fit inside the pool."""
    path = llama_adapters["qv5"]
    want = packed(model, llama_adapters, "qv5")

    async def body(s: Scheduler, actor: LoaderActor) -> None:
        before = s.fill()
        size, fits = s.pool.size, aligned(want.nbytes)
        sent = [
            s.unplaced_request("qv5", path, -ALIGN, fits),  # starts before the pool
            s.unplaced_request("qv5", path, size - fits, 2 * fits),  # ends past it; the block would fit
        ]
        await s.send(*sent)
        replies = {m.write_id: m for m in [await s.recv(AdapterFailed) for _ in sent]}
        for msg in sent:
            failed = replies[msg.write_id]
            assert failed.stage_fault and failed.name == "qv5", failed
            assert f"host range {msg.offset}+{msg.capacity} is outside the pool" in failed.message
        assert bytes(s.pool.buf) == before  # nothing written anywhere
        staged = await s.stage("qv5", path)
        assert isinstance(staged, AdapterStaged) and torch.equal(s.block(staged), want.block)

    run_loader(run_dir, tiny_llama, model, body)


def test_a_handler_failure_is_answered_as_the_loaders_fault_beside_a_good_write(
    run_dir, tiny_llama, model, llama_adapters, monkeypatch
):
    """The handler raises on one StageAdapter (an injected stand-in for any bug): that write is answered
    (the scheduler frees its range and may ask again) naming the adapter and the stage, a write sent
    with it is staged, and the loader reports the failure in its health and metrics."""
    monkeypatch.setenv(faults.ENV, "loader:StageAdapter:inject-me")  # read by the actor's constructor

    async def body(s: Scheduler, actor: LoaderActor) -> None:
        doomed = s.request("inject-me", llama_adapters["full8"])
        good = s.request("qv5", llama_adapters["qv5"])
        await s.send(doomed, good)
        replies = [await s.recv() for _ in range(3)]
        kinds = [type(m) for m in replies]
        assert sorted(k.__name__ for k in kinds) == ["AdapterFailed", "AdapterStaged", "LoaderHealth"]
        failed = replies[kinds.index(AdapterFailed)]
        assert (failed.name, failed.write_id, failed.stage_fault) == ("inject-me", doomed.write_id, True)
        assert "'inject-me'" in failed.message and "adapter-loader" in failed.message
        health = replies[kinds.index(LoaderHealth)]
        assert kinds.index(LoaderHealth) > kinds.index(AdapterFailed)  # sent after the failure
        assert health.handler_failures == 1 and health.stuck_reads == 0
        staged = replies[kinds.index(AdapterStaged)]
        assert staged.write_id == good.write_id
        assert torch.equal(s.block(staged), packed(model, llama_adapters, "qv5").block)
        assert metric(actor, "lorapipe_handler_errors_total", queue="scheduler_requests") == 1
        assert metric(actor, "lorapipe_loader_writes_in_flight") == 0

    run_loader(run_dir, tiny_llama, model, body)


# The loader of the restart test, run as `python -c HANGING_LOADER CONFIG.json FD`: reads of adapters
# named "hang*" never return (a hung file system: the disk is what the test plays, not the loader); it
# writes one byte to FD when such a read began, so the test knows the write is in flight.
HANGING_LOADER = """
import os, sys, threading
from runtime.base.actor import stage_main
from stages.loader.actor import LoaderActor
from stages.loader.config import LoaderConfig

FD = int(sys.argv.pop())

class HangingLoader(LoaderActor):
    def _read(self, job, limits):
        if job.name.startswith("hang"):
            os.write(FD, b"r")
            threading.Event().wait()
        return super()._read(job, limits)

stage_main(HangingLoader, LoaderConfig)
"""


def test_a_killed_loader_restarts_on_the_same_pool(run_dir, tiny_llama, model, llama_adapters):
    s = Scheduler(run_dir, tiny_llama, model[1], blocks=2)
    cfg_path = run_dir / "loader.json"
    cfg_path.write_bytes(msgspec.json.encode(s.cfg))
    want = packed(model, llama_adapters, "rs12")
    procs: list[subprocess.Popen] = []
    began_r, began_w = os.pipe()

    def spawn(hanging: bool = False) -> subprocess.Popen:
        if hanging:
            args = ["-c", HANGING_LOADER, str(cfg_path), str(began_w)]
            try:
                procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, pass_fds=(began_w,)))
            finally:
                os.close(began_w)  # the child's copy alone: its death ends a read of began_r
        else:
            procs.append(subprocess.Popen([sys.executable, "-m", "stages.loader", str(cfg_path)], cwd=ROOT))
        return procs[-1]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = spawn(hanging=True)
        assert (await s.recv(LoaderStarted)).pid == first.pid
        staged = await s.stage("rs12", llama_adapters["rs12"])
        assert isinstance(staged, AdapterStaged)
        lost = s.request("hang", llama_adapters["qv5"])  # the range right after rs12's trimmed block
        await s.send(lost)
        began = loop.create_future()
        loop.add_reader(began_r, lambda: began.done() or began.set_result(os.read(began_r, 1)))
        try:
            assert await asyncio.wait_for(began, 20) == b"r"  # the first loader holds the write
        finally:
            loop.remove_reader(began_r)
        first.kill()
        first.wait(timeout=10)
        attached = attach_pool(s.pool.name)  # the pool and its bytes survive the loader
        assert torch.equal(block_tensor(attached, staged.offset, 12, s.layout, DTYPE), want.block)
        attached.close()

        second = spawn()
        assert (await s.recv(LoaderStarted)).pid == second.pid  # frees the lost write's range
        # asked again with a new write_id; the next answer must be that one (recv refuses an answer to
        # the lost write), and writing next to rs12 leaves rs12's block as it was
        again = await s.stage("hang", llama_adapters["qv5"])
        assert isinstance(again, AdapterStaged) and again.write_id != lost.write_id
        assert again.offset == lost.offset and again.shm_name == s.pool.name
        assert torch.equal(s.block(again), packed(model, llama_adapters, "qv5").block)
        assert torch.equal(s.block(staged), want.block)
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
        os.close(began_r)
        s.close()
