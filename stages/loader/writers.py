"""The adapter-loader's part-writer processes (`writer.py`), seen from the loader: started at setup, each
part of a load handed to an idle one over a ROUTER socket, answers matched to their parts. A writer that
dies or overruns the read deadline (stuck in a hung file system) is killed, waited for (it may write no
more into a block that is then freed) and started again, and its part fails with a clear reason."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from proto.loader_parts import Gap, LoaderToWriter, PartDone, WritePart, WriterReady, WriterToLoader
from runtime.base.sockets import PeerGone, RouterSocket
from runtime.common.host_pool import dtype_name
from stages.loader.adapter_config import AdapterError, LoaderFault
from stages.loader.adapter_plan import AdapterPlan
from stages.loader.writer import file_id

START_TIMEOUT_S = 120.0  # a writer imports torch before it says WriterReady
DEADLINE_GRACE_S = 5.0  # past a part's read deadline, this long for its answer before the writer is killed


class WriterGone(Exception):
    """The writer running a part died or was killed before it answered."""


@dataclass
class _Writer:
    slot: int
    proc: subprocess.Popen
    ready: bool = False
    job: int | None = None  # the part it is writing
    watcher: asyncio.Future | None = field(default=None, repr=False)


class PartWriters:
    def __init__(self, count: int, address: str, pool_name: str, log: logging.Logger) -> None:
        self.count, self.address, self.pool_name, self.log = count, address, pool_name, log
        self.sock: RouterSocket | None = None
        self.writers: dict[bytes, _Writer] = {}
        self.idle: asyncio.Queue[bytes] = asyncio.Queue()
        self.jobs: dict[int, asyncio.Future[PartDone]] = {}
        self.ids = itertools.count(1)
        self.restarts = 0
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._started = False  # every writer said WriterReady once: from then on a dead one is replaced
        self._changed = asyncio.Event()  # a writer got ready or exited (what start() waits on)

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind, start every writer and wait until each says WriterReady (RuntimeError past the timeout
        or when one exits first)."""
        self.sock = RouterSocket(self.address, WriterToLoader, LoaderToWriter, linger_ms=0)
        self._spawn_task(self._receive())
        for slot in range(self.count):
            self._spawn(slot)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(w.ready for w in self.writers.values()):
            dead = [w for w in self.writers.values() if w.proc.poll() is not None]
            if dead:
                code = dead[0].proc.returncode
                raise RuntimeError(f"an adapter writer process exited with code {code} at start")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError(f"adapter writer processes not ready after {START_TIMEOUT_S:g}s") from None
        self._started = True

    def close(self) -> None:
        """Kill every writer and wait for it (none may write after the pool goes)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for w in self.writers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self.writers.values():
            w.proc.wait()
        for fut in self.jobs.values():
            if not fut.done():
                fut.set_exception(WriterGone("the loader is stopping"))
        if self.sock is not None:
            self.sock.close()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.writers.values()]

    def _spawn(self, slot: int) -> None:
        identity = f"w{slot}".encode()
        args = [self.address, identity.decode(), self.pool_name, str(os.getpid())]
        cmd = [sys.executable, "-m", "stages.loader.writer", *args]
        # from the event loop's thread, which the writer's death signal is tied to (writer.main)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        w = self.writers[identity] = _Writer(slot, proc)
        w.watcher = self._spawn_task(self._watch(identity, w))

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watch(self, identity: bytes, w: _Writer) -> None:
        """When the process exits: fail its part, and (unless the loader stops) start a new one."""
        code = await asyncio.get_running_loop().run_in_executor(None, w.proc.wait)
        if self._closing or self.writers.get(identity) is not w:
            return
        self.log.warning(
            "adapter writer %d (pid %d) exited with code %s; starting another", w.slot, w.proc.pid, code
        )
        self._fail(w, WriterGone(f"the adapter writer process exited (code {code})"))
        self.restarts += 1
        self._spawn(w.slot)

    def _fail(self, w: _Writer, exc: Exception) -> None:
        fut = self.jobs.pop(w.job, None) if w.job is not None else None
        w.job = None
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    # --- parts --------------------------------------------------------------------------------------
    async def write(self, plan: AdapterPlan, path: str, offset: int, s: int, i: int, gaps: list[Gap]) -> None:
        """Part i of segment s of `plan` (with `gaps` zeroed first) into the block at `offset`, on an idle
        writer; its peaks land in `plan.peaks`. A failure is an AdapterError naming its reason."""
        identity = await self._idle()
        w = self.writers[identity]
        job = next(self.ids)
        fut: asyncio.Future[PartDone] = asyncio.get_running_loop().create_future()
        self.jobs[job], w.job = fut, job
        msg = WritePart(
            job=job,
            name=plan.name,
            path=path,
            file=file_id(plan.fd),
            offset=offset,
            dtype=dtype_name(plan.dtype),
            rank=plan.rank,
            num_layers=plan.num_layers,
            row_elems=plan.row_elems,
            deadline=plan.deadline,
            part=plan.segments[s].parts[i],
            gaps=gaps,
        )
        try:
            await self.sock.send(identity, msg)
        except PeerGone:
            self._fail(w, WriterGone("the adapter writer process is gone"))
        timeout = max(0.0, plan.deadline - time.monotonic()) + DEADLINE_GRACE_S
        try:
            done = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            await self._kill(identity, w)
            raise LoaderFault(
                plan.name, "reading it took longer than the read deadline (a hung file system?)"
            ) from None
        except WriterGone as e:
            raise LoaderFault(plan.name, f"its load was cut short: {e}") from None
        if done.error:
            raise AdapterError(plan.name, done.error) if done.adapter_fault else RuntimeError(done.error)
        plan.peaks.extend(done.peaks)

    async def _idle(self) -> bytes:
        while True:
            identity = await self.idle.get()
            w = self.writers.get(identity)
            if w is not None and w.ready and w.job is None and w.proc.poll() is None:
                return identity

    async def _kill(self, identity: bytes, w: _Writer) -> None:
        """Kill a writer stuck in its part and wait until it is gone; its watcher starts another."""
        self.log.warning(
            "adapter writer %d (pid %d) overran its part's deadline; killing it", w.slot, w.proc.pid
        )
        w.proc.kill()
        if w.watcher is not None:
            await asyncio.shield(w.watcher)

    async def _receive(self) -> None:
        assert self.sock is not None
        while True:
            try:
                identity, msg = await self.sock.recv()
            except Exception:  # a malformed frame: logged, dropped
                self.log.exception("bad message from an adapter writer")
                continue
            w = self.writers.get(identity)
            if w is None:
                continue
            if isinstance(msg, WriterReady):
                if w.proc.pid == msg.pid and not w.ready:
                    w.ready = True
                    self.idle.put_nowait(identity)
                    self._changed.set()
                continue
            if msg.job != w.job:
                continue  # the answer of a part already failed (its writer was replaced)
            fut = self.jobs.pop(msg.job, None)
            w.job = None
            if fut is not None and not fut.done():
                fut.set_result(msg)
            self.idle.put_nowait(identity)
