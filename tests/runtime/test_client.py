"""The client SDK against a fake tokenizer-side ROUTER: results and timings, typed exceptions with the
server's message, Abort on early stream close and on timeout, the handshake's version check."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proto.base import PROTOCOL_VERSION
from proto.client import (
    Abort,
    Ack,
    AdapterEntry,
    AdapterList,
    ClientReply,
    ClientRequest,
    ErrorReply,
    GenerateRequest,
    Health,
    HealthReply,
    Hello,
    ListAdapters,
    LoadAdapter,
    StageHealth,
    TokenChunk,
    TokenChunks,
    UnloadAdapter,
    Welcome,
)
from runtime.base.endpoints import free_port
from runtime.base.sockets import RouterSocket
from runtime.client import (
    Aborted,
    AdapterLoadFailed,
    AsyncClient,
    Client,
    InvalidRequest,
    ProtocolMismatchError,
    ServerError,
    ServerUnreachable,
    Timeout,
    UnknownAdapter,
)

pytestmark = pytest.mark.timeout(30)
Handler = Callable[[RouterSocket, bytes, Any], Awaitable[None]]


class FakeTokenizer:
    """Answers Hello itself and hands everything else to `handler`; records every message."""

    def __init__(self, addr: str, handler: Handler, version: int = PROTOCOL_VERSION) -> None:
        self.addr, self.handler, self.version = addr, handler, version
        self.seen: asyncio.Queue[Any] = asyncio.Queue()

    async def run(self) -> None:
        with RouterSocket(self.addr, ClientRequest, ClientReply) as sock:
            while True:
                identity, msg = await sock.recv()
                self.seen.put_nowait(msg)
                if isinstance(msg, Hello) and self.version == PROTOCOL_VERSION:
                    await sock.send(
                        identity, Welcome(request_id=msg.request_id, protocol_version=self.version)
                    )
                elif isinstance(msg, Hello):
                    err = ErrorReply(
                        request_id=msg.request_id, kind="protocol_mismatch", message="server speaks 99"
                    )
                    await sock.send(identity, err)
                else:
                    await self.handler(sock, identity, msg)

    async def next_of(self, kind: type) -> Any:
        while True:
            msg = await asyncio.wait_for(self.seen.get(), 10)
            if isinstance(msg, kind):
                return msg


async def _three_chunks(sock: RouterSocket, identity: bytes, msg: Any) -> None:
    if isinstance(msg, GenerateRequest):
        for i, (text, last) in enumerate([("a", False), ("b", False), ("cd", True)]):
            chunk = TokenChunk(
                request_id=msg.request_id,
                text=text,
                token_ids=[i + 1],
                finished=last,
                finish_reason="length" if last else None,
                prompt_tokens=4,
                arrival_time=10.0,
                first_token_time=10.25,
            )
            await sock.send(identity, chunk)


async def _silent(sock: RouterSocket, identity: bytes, msg: Any) -> None:
    pass


def _run(
    tmp_path, handler: Handler, body: Callable[[AsyncClient, FakeTokenizer], Awaitable[None]], **kw
) -> None:
    async def main() -> None:
        fake = FakeTokenizer(f"ipc://{tmp_path}/client.sock", handler, **kw)
        server = asyncio.create_task(fake.run())
        try:
            async with AsyncClient(fake.addr, timeout=10) as client:
                await body(client, fake)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())


def test_generate_returns_text_ids_finish_reason_and_timings(tmp_path):
    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        out = await client.generate([5, 6, 7, 8], adapter="a", max_tokens=3, temperature=0.5)
        req = await fake.next_of(GenerateRequest)
        assert req.prompt_ids.tolist() == [5, 6, 7, 8] and req.adapter == "a"
        assert req.sampling.max_tokens == 3 and req.sampling.temperature == 0.5
        assert (out.text, out.token_ids, out.finish_reason, out.prompt_tokens) == (
            "abcd",
            [1, 2, 3],
            "length",
            4,
        )
        t = out.timings
        assert len(t.token_times) == 3 and t.token_times == sorted(t.token_times)
        assert 0 < t.ttft == t.token_times[0] <= t.e2e and t.server_ttft == pytest.approx(0.25)
        assert len(t.itl) == 2

    _run(tmp_path, _three_chunks, body)


def test_chunks_of_several_requests_in_one_message_reach_each_stream(tmp_path):
    """The server packs one step's chunks for one client into a TokenChunks: each request's stream gets
    its own chunks, in order, and a chunk for a request nobody waits for is dropped."""
    prompts = {"p0": [5], "p1": [6, 7], "p2": [8]}

    async def packed(sock: RouterSocket, identity: bytes, msg: Any) -> None:
        if not isinstance(msg, GenerateRequest):
            return
        seen.append(msg.request_id)
        if len(seen) < len(prompts):
            return
        for step in range(3):  # one TokenChunks per step, the requests in a shuffled order
            order = seen[step:] + seen[:step]
            chunks = [
                TokenChunk(
                    request_id=rid,
                    text=f"{rid[-4:]}.{step}",
                    token_ids=[100 * i + step],
                    finished=step == 2,
                    finish_reason="length" if step == 2 else None,
                )
                for i, rid in enumerate(order)
            ]
            chunks.append(TokenChunk(request_id="nobody", text="x", token_ids=[1]))
            await sock.send(identity, TokenChunks(chunks=chunks))

    seen: list[str] = []

    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        outs = await asyncio.gather(*(client.generate(p, max_tokens=3) for p in prompts.values()))
        assert len(seen) == 3
        for out in outs:
            tag = out.request_id[-4:]
            assert out.text == f"{tag}.0{tag}.1{tag}.2" and out.finish_reason == "length"
            assert len(out.token_ids) == 3 and [t % 100 for t in out.token_ids] == [0, 1, 2]

    _run(tmp_path, packed, body)


@pytest.mark.parametrize(
    "kind,exc",
    [
        ("invalid_request", InvalidRequest),
        ("unknown_adapter", UnknownAdapter),
        ("adapter_load_failed", AdapterLoadFailed),
        ("server_error", ServerError),
        ("aborted", Aborted),
    ],
)
def test_error_replies_raise_typed_exceptions_with_the_server_message(tmp_path, kind, exc):
    async def reply_error(sock: RouterSocket, identity: bytes, msg: Any) -> None:
        await sock.send(
            identity, ErrorReply(request_id=msg.request_id, kind=kind, message=f"server says {kind}")
        )

    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        with pytest.raises(exc, match=f"server says {kind}"):
            await client.generate("hi")
        with pytest.raises(exc, match=f"server says {kind}"):
            await client.load_adapter("a", "/nowhere")

    _run(tmp_path, reply_error, body)


def test_closing_a_stream_early_sends_abort(tmp_path):
    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        async with contextlib.aclosing(client.stream("hello", max_tokens=3)) as chunks:
            async for chunk in chunks:
                assert chunk.text == "a" and not chunk.finished
                break
        req = await fake.next_of(GenerateRequest)
        assert (await fake.next_of(Abort)).request_id == req.request_id

    _run(tmp_path, _three_chunks, body)


def test_timeout_raises_and_aborts(tmp_path):
    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        with pytest.raises(Timeout):
            await client.generate("hello", timeout=0.2)
        req = await fake.next_of(GenerateRequest)
        assert (await fake.next_of(Abort)).request_id == req.request_id
        with pytest.raises(Timeout):
            await client.list_adapters(timeout=0.2)

    _run(tmp_path, _silent, body)


def test_closing_the_client_ends_its_open_calls_at_once(tmp_path):
    """No timeout at all: without the close ending them, these calls would wait forever."""

    async def main() -> None:
        fake = FakeTokenizer(f"ipc://{tmp_path}/client.sock", _silent)
        server = asyncio.create_task(fake.run())
        client = AsyncClient(fake.addr, timeout=None)
        try:
            await client.connect()
            gen = asyncio.ensure_future(client.generate("hello", max_tokens=3))
            ops = asyncio.ensure_future(client.list_adapters())
            await fake.next_of(GenerateRequest)
            await fake.next_of(ListAdapters)
            await client.close()
            for call in (gen, ops):
                with pytest.raises(Aborted, match="client of .* was closed while this call was open"):
                    await call
        finally:
            await client.close()
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())


def test_a_cancel_that_meets_its_reply_is_not_lost():
    """The reply lands in the call's queue, then the call is cancelled a few loop steps later: every
    cancel the task accepts ends it cancelled. (Python 3.11's asyncio.wait_for returned the reply and
    dropped such cancels; a soak's cancelled generate then waited out its whole timeout.)"""

    async def main() -> int:
        client = AsyncClient("ipc:///nonexistent", timeout=60)  # never connects: only the wait is used
        accepted = 0
        for steps in range(8):
            queue: asyncio.Queue = asyncio.Queue()
            call = asyncio.ensure_future(client._next(queue, 60))
            for _ in range(2):
                await asyncio.sleep(0)  # the call now waits on its queue
            queue.put_nowait("reply")
            for _ in range(steps):
                await asyncio.sleep(0)
            if not call.cancel():
                continue  # it had already returned the reply: nothing to cancel
            accepted += 1
            with pytest.raises(asyncio.CancelledError):
                await call
        return accepted

    assert asyncio.run(main()) >= 1


def test_protocol_mismatch_is_refused(tmp_path):
    async def main() -> None:
        fake = FakeTokenizer(f"ipc://{tmp_path}/client.sock", _silent, version=99)
        server = asyncio.create_task(fake.run())
        client = AsyncClient(fake.addr, timeout=10)
        try:
            with pytest.raises(ProtocolMismatchError, match="99"):
                await client.connect()
        finally:
            await client.close()
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())


def test_adapter_ops_and_health(tmp_path):
    entry = AdapterEntry(name="a", path="/ad/a", tier="gpu", slot=0)

    async def ops(sock: RouterSocket, identity: bytes, msg: Any) -> None:
        rid = msg.request_id
        match msg:
            case LoadAdapter():
                await sock.send(identity, Ack(request_id=rid))
            case UnloadAdapter(name=name):
                await sock.send(
                    identity, ErrorReply(request_id=rid, kind="unknown_adapter", message=f"no {name}")
                )
            case ListAdapters():
                await sock.send(identity, AdapterList(request_id=rid, adapters=[entry]))
            case Health():
                stages = [StageHealth(stage="tokenizer", status="ok")]
                await sock.send(identity, HealthReply(request_id=rid, ok=True, stages=stages))

    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        await client.load_adapter("a", "/ad/a")
        assert (await fake.next_of(LoadAdapter)).path == "/ad/a"
        with pytest.raises(UnknownAdapter, match="no b"):
            await client.unload_adapter("b")
        assert await client.list_adapters() == [entry]
        health = await client.health()
        assert health.ok and health.stages[0].stage == "tokenizer"

    _run(tmp_path, ops, body)


def test_bad_sampling_arguments_fail_locally(tmp_path):
    async def body(client: AsyncClient, fake: FakeTokenizer) -> None:
        with pytest.raises(InvalidRequest, match="sampling"):
            await client.generate("x", max_tokens="many")
        with pytest.raises(InvalidRequest, match="sampling"):
            await client.generate("x", beam_width=4)
        with pytest.raises(InvalidRequest, match="int32"):
            await client.generate([1, 2**40])

    _run(tmp_path, _silent, body)


def test_sync_client(tmp_path):
    fake = FakeTokenizer(f"ipc://{tmp_path}/client.sock", _three_chunks)
    loop = asyncio.new_event_loop()
    server = loop.create_task(fake.run())

    def serve() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(server)
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with Client(fake.addr, timeout=10) as client:
            out = client.generate("hello")
            assert out.text == "abcd" and out.token_ids == [1, 2, 3]
            stream = client.stream("hello")
            assert next(stream).text == "a"
            stream.close()  # early close: Abort goes out before close() returns
            abort = asyncio.run_coroutine_threadsafe(fake.next_of(Abort), loop).result(10)
            assert abort.request_id
    finally:
        loop.call_soon_threadsafe(server.cancel)
        thread.join(10)


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_a_refused_connection_is_reported_at_once_with_the_address_and_a_hint(where, tmp_path):
    """A refused connection (nothing listens, no socket file) is an answer: the client does not wait
    out its connect timeout for a server that cannot answer."""
    addr = f"tcp://127.0.0.1:{free_port()}" if where == "tcp" else f"ipc://{tmp_path}/none.sock"
    start = time.monotonic()
    with Client(addr, timeout=60, connect_timeout=30) as client, pytest.raises(ServerUnreachable) as exc:
        client.health()
    assert time.monotonic() - start < 5, "waited as if for a busy server"
    msg = str(exc.value)
    why = "nothing listens there (connection refused)" if where == "tcp" else "there is no socket file"
    assert addr in msg and why in msg
    assert "lorapipe serve" in msg and "--endpoint" in msg
    assert isinstance(exc.value, Timeout)  # code that caught Timeout before still does


def test_a_silent_listener_and_a_missing_socket_file_are_told_apart(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # accepts connections (the kernel's backlog) and never speaks ZMTP
        addr = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with Client(addr, timeout=60, connect_timeout=1.0) as client, pytest.raises(ServerUnreachable) as exc:
            client.health()
        assert addr in str(exc.value) and "did not answer the lorapipe handshake" in str(exc.value)
    missing = f"ipc://{tmp_path}/no-server.sock"
    with Client(missing, connect_timeout=1.0) as client, pytest.raises(ServerUnreachable) as exc:
        client.health()
    assert f"there is no socket file {tmp_path}/no-server.sock" in str(exc.value)
