"""The actor base in real subprocesses: Ready handshake, metrics over the control channel, drain on
SIGTERM/Shutdown, handler errors survived, StageFatal reported, exit when the parent dies."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.control import (
    Draining,
    FatalError,
    LauncherToStage,
    MetricsQuery,
    MetricsReport,
    Ready,
    Shutdown,
    StageToLauncher,
    check_ready,
)
from proto.pipeline import TokenBatch, TokenDelta, WorkerToTokenizer
from runtime.base.actor import Mailbox
from runtime.base.sockets import PullSocket, PushSocket, RouterSocket
from tests.runtime.echo_actor import EchoConfig

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file is tests/runtime/base/)
pytestmark = pytest.mark.timeout(30)


def _cmd(step: int, command: str = "echo") -> TokenBatch:
    return TokenBatch(step=step, items=[TokenDelta(request_id=command, token_ids=[step])])


class Harness:
    """Plays the launcher (control ROUTER) and the echo stage's neighbours."""

    def __init__(self, tmp: Path) -> None:
        self.cfg = EchoConfig(
            control=f"ipc://{tmp}/control.sock",
            inbound=f"ipc://{tmp}/in.sock",
            outbound=f"ipc://{tmp}/out.sock",
        )
        self.cfg_path = tmp / "echo.json"
        self.cfg_path.write_bytes(msgspec.json.encode(self.cfg))
        self.control = RouterSocket(self.cfg.control, StageToLauncher, LauncherToStage)
        self.out = PullSocket(self.cfg.outbound, WorkerToTokenizer)
        self.inp = PushSocket(self.cfg.inbound, WorkerToTokenizer)
        self.argv = [sys.executable, "-m", "tests.runtime.echo_actor", str(self.cfg_path)]

    def spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, cwd=ROOT)

    async def ready(self) -> bytes:
        identity, msg = await asyncio.wait_for(self.control.recv(), 20)
        assert isinstance(msg, Ready) and msg.stage == "echo"
        check_ready(msg)
        return identity

    async def control_msg(self) -> object:
        return (await asyncio.wait_for(self.control.recv(), 10))[1]

    async def echo(self) -> TokenBatch:
        return await asyncio.wait_for(self.out.recv(), 10)

    def close(self) -> None:
        for sock in (self.control, self.out, self.inp):
            sock.close()


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ready_metrics_and_drain_on_sigterm(tmp_path):
    h = Harness(tmp_path)
    proc = h.spawn()

    async def main() -> None:
        identity = await h.ready()
        # "wait:19" is echoed only once the other 19 sit in the inbox, so when SIGTERM arrives all 19
        # are accepted and at 20 ms each still mostly unprocessed: only a real drain delivers them
        await h.inp.send(_cmd(0, "wait:19"))
        for i in range(1, 20):
            await h.inp.send(_cmd(i, "slow"))
        assert (await h.echo()).step == 0
        await h.control.send(identity, MetricsQuery(query_id=7))
        report = await h.control_msg()
        assert isinstance(report, MetricsReport) and report.query_id == 7 and report.stage == "echo"
        families = {f.name: f for f in text_string_to_metric_families(report.text)}
        assert all(s.labels["stage"] == "echo" for f in families.values() for s in f.samples)
        received = {s.labels["type"]: s.value for s in families["lorapipe_messages_in"].samples}
        assert received == {"TokenBatch": 20.0}
        assert "lorapipe_queue_depth" in families and "lorapipe_service_seconds" in families

        proc.send_signal(signal.SIGTERM)
        assert [(await h.echo()).step for _ in range(19)] == list(range(1, 20))
        assert await h.control_msg() == Draining(stage="echo")

    try:
        asyncio.run(main())
        assert _wait(proc) == 0
        assert not Path(h.cfg.inbound[len("ipc://") :]).exists()
    finally:
        h.close()


def test_handler_errors_are_survived_and_stage_fatal_is_reported(tmp_path):
    h = Harness(tmp_path)
    proc = h.spawn()

    async def main() -> None:
        await h.ready()
        await h.inp.send(_cmd(1, "boom"))
        await h.inp.send(_cmd(2))
        assert (await h.echo()).step == 2
        await h.inp.send(_cmd(3, "fatal"))
        msg = await h.control_msg()
        assert isinstance(msg, FatalError) and "fatal command" in msg.message

    try:
        asyncio.run(main())
        assert _wait(proc) == 1
    finally:
        h.close()


def test_shutdown_message_drains_and_exits(tmp_path):
    h = Harness(tmp_path)
    proc = h.spawn()

    async def main() -> None:
        identity = await h.ready()
        await h.control.send(identity, Shutdown(deadline_s=5))
        assert await h.control_msg() == Draining(stage="echo")

    try:
        asyncio.run(main())
        assert _wait(proc) == 0
    finally:
        h.close()


def test_exits_when_its_parent_dies(tmp_path):
    """The actor's parent is a middle process we SIGKILL; the actor must notice and exit. We learn of
    its exit through a pipe whose write end only the middle process and the actor hold (EOF)."""
    h = Harness(tmp_path)
    r, w = os.pipe()
    middle_code = (
        f"import subprocess; subprocess.Popen({h.argv!r}, pass_fds=({w},), cwd={str(ROOT)!r}).wait()"
    )
    middle = subprocess.Popen([sys.executable, "-c", middle_code], pass_fds=(w,))
    os.close(w)
    try:
        asyncio.run(h.ready())
        middle.kill()
        middle.wait(timeout=10)
        readable, _, _ = select.select([r], [], [], 15)
        assert readable and os.read(r, 1) == b"", "the actor outlived its parent"
        assert not Path(h.cfg.inbound[len("ipc://") :]).exists()
    finally:
        os.close(r)
        h.close()


def test_full_mailbox_blocks_its_producer():
    async def main() -> None:
        box: Mailbox[int] = Mailbox("requests", maxsize=2)
        box.put_nowait(1)
        box.put_nowait(2)
        with pytest.raises(asyncio.QueueFull):
            box.put_nowait(3)
        producer = asyncio.create_task(box.put(3))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not producer.done() and box.qsize() == 2
        assert await box.get() == 1
        await producer
        assert [box.get_nowait(), box.get_nowait()] == [2, 3]
        with pytest.raises(ValueError):
            Mailbox("unbounded", maxsize=0)

    asyncio.run(main())
