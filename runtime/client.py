"""Client SDK: `AsyncClient` owns one DEALER to the tokenizer's ROUTER and a reader task that routes
replies by request_id; `Client` is its blocking twin, running an AsyncClient on a private loop thread.
Every wait is bounded by `timeout` (seconds without any reply), so a client never hangs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proto.base import PROTOCOL_VERSION, TokenIds
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
    TokenChunk,
    UnloadAdapter,
    Welcome,
)
from proto.codec import ProtocolError
from proto.sampling import SamplingParams
from runtime.base.endpoints import DEFAULT_CLIENT_PORT, unreachable_reason
from runtime.base.sockets import DealerSocket

DEFAULT_ENDPOINT = f"tcp://127.0.0.1:{DEFAULT_CLIENT_PORT}"
_log = logging.getLogger("lorapipe.client")
_UNSET: Any = object()
Prompt = str | Sequence[int]  # text, or token ids used as given


class LorapipeError(Exception):
    """Base of every error the SDK raises; str(e) is the server's message."""


class InvalidRequest(LorapipeError): ...


class UnknownAdapter(LorapipeError): ...


class AdapterLoadFailed(LorapipeError): ...


class ServerError(LorapipeError): ...


class Aborted(LorapipeError): ...


class ProtocolMismatchError(LorapipeError): ...


class Timeout(LorapipeError, TimeoutError): ...


class ServerUnreachable(Timeout, ConnectionError):
    """No lorapipe server answered the connection handshake; the message names the address and why."""


_ERRORS: dict[str, type[LorapipeError]] = {
    "invalid_request": InvalidRequest,
    "unknown_adapter": UnknownAdapter,
    "adapter_load_failed": AdapterLoadFailed,
    "server_error": ServerError,
    "aborted": Aborted,
    "protocol_mismatch": ProtocolMismatchError,
}


@dataclass(frozen=True)
class Chunk:
    """Output of one request as it arrives; `time` is seconds since the request was sent (client clock)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    time: float
    prompt_tokens: int = 0
    server_ttft: float = 0.0  # tokenizer arrival → first token, server clock (0 until known)


@dataclass(frozen=True)
class Timings:
    ttft: float  # seconds from send to the first token (client clock)
    token_times: list[float]  # per output token: seconds from send to its arrival
    e2e: float  # seconds from send to the final chunk
    server_ttft: float = 0.0

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(repr=False)


def _error(reply: ErrorReply) -> LorapipeError:
    return _ERRORS.get(reply.kind, ServerError)(reply.message)


def _request(prompt: Prompt, adapter: str | None, sampling: dict[str, Any]) -> GenerateRequest:
    try:
        params = msgspec.convert(sampling, SamplingParams)
    except (msgspec.ValidationError, TypeError) as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from None
    rid = uuid.uuid4().hex
    if isinstance(prompt, str):
        return GenerateRequest(request_id=rid, prompt=prompt, adapter=adapter, sampling=params)
    try:
        ids = TokenIds.of(prompt)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequest(f"prompt token ids must be int32 integers: {exc}") from None
    return GenerateRequest(request_id=rid, prompt_ids=ids, adapter=adapter, sampling=params)


class AsyncClient:
    """Asyncio client. Connects (and checks the protocol version) on first use; `timeout` bounds
    every wait for the server and can be overridden per call."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        connect_timeout: float = 5.0,
        **socket_kw: Any,
    ):
        """`connect_timeout`: the handshake's wait for a server, then ServerUnreachable (≤ `timeout`)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.welcome: Welcome | None = None
        self._socket_kw = socket_kw
        self._sock: DealerSocket[Any, Any] | None = None
        self._pending: dict[str, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> Welcome:
        async with self._lock:
            if self.welcome is not None:
                return self.welcome
            if self._sock is None:
                self._sock = DealerSocket(self.endpoint, ClientReply, ClientRequest, **self._socket_kw)
                self._reader = asyncio.ensure_future(self._read())
            limit = self.connect_timeout if self.timeout is None else min(self.connect_timeout, self.timeout)
            hello = Hello(request_id=uuid.uuid4().hex, protocol_version=PROTOCOL_VERSION)
            try:
                reply = await self._call(hello, limit)
            except Timeout:
                why = await asyncio.to_thread(unreachable_reason, self.endpoint)
                raise ServerUnreachable(
                    f"no lorapipe server answered at {self.endpoint} within {limit:g}s: {why}. Is "
                    f"`lorapipe serve` running there (its --endpoint, default {DEFAULT_ENDPOINT})?"
                ) from None
            if not isinstance(reply, Welcome) or reply.protocol_version != PROTOCOL_VERSION:
                raise ProtocolMismatchError(f"server speaks {reply!r}, client speaks {PROTOCOL_VERSION}")
            self.welcome = reply
            return reply

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._sock is not None:
            self._sock.close()
        self._sock, self._reader, self.welcome = None, None, None

    async def stream(
        self,
        prompt: Prompt,
        adapter: str | None = None,
        *,
        timeout: float | None = _UNSET,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        """Yield chunks as they are produced. Leaving early (break, aclose, an exception, a timeout)
        aborts the request server-side; wrap in contextlib.aclosing() to make that immediate."""
        req = _request(prompt, adapter, sampling)
        await self.connect()
        rid, queue = req.request_id, self._open(req.request_id)
        done = False
        t0 = time.monotonic()
        try:
            await self._send(req, timeout)
            while not done:
                reply = await self._next(queue, timeout)
                match reply:
                    case TokenChunk():
                        done = reply.finished
                        ttft = reply.first_token_time - reply.arrival_time if reply.first_token_time else 0.0
                        yield Chunk(
                            rid, reply.text, reply.token_ids, reply.finished, reply.finish_reason,
                            time.monotonic() - t0, reply.prompt_tokens, ttft,
                        )  # fmt: skip
                    case ErrorReply():
                        done = True
                        raise _error(reply)
                    case _:
                        done = True
                        raise ServerError(f"unexpected reply {type(reply).__name__} to a generate request")
        finally:
            self._pending.pop(rid, None)
            if not done and self._sock is not None:
                with contextlib.suppress(Exception):
                    await self._send(Abort(request_id=rid), timeout)

    async def generate(
        self,
        prompt: Prompt,
        adapter: str | None = None,
        *,
        timeout: float | None = _UNSET,
        **sampling: Any,
    ) -> Completion:
        texts, ids, times, last = [], [], [], None
        async with contextlib.aclosing(self.stream(prompt, adapter, timeout=timeout, **sampling)) as chunks:
            async for last in chunks:
                texts.append(last.text)
                ids.extend(last.token_ids)
                times.extend([last.time] * len(last.token_ids))
        assert last is not None and last.finished
        timings = Timings(times[0] if times else last.time, times, last.time, last.server_ttft)
        return Completion(
            last.request_id, "".join(texts), ids, last.finish_reason, last.prompt_tokens, timings
        )

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = _UNSET) -> None:
        await self._expect(LoadAdapter(request_id=uuid.uuid4().hex, name=name, path=str(path)), Ack, timeout)

    async def unload_adapter(self, name: str, *, timeout: float | None = _UNSET) -> None:
        await self._expect(UnloadAdapter(request_id=uuid.uuid4().hex, name=name), Ack, timeout)

    async def list_adapters(self, *, timeout: float | None = _UNSET) -> list[AdapterEntry]:
        reply = await self._expect(ListAdapters(request_id=uuid.uuid4().hex), AdapterList, timeout)
        return reply.adapters

    async def health(self, *, timeout: float | None = _UNSET) -> HealthReply:
        return await self._expect(Health(request_id=uuid.uuid4().hex), HealthReply, timeout)

    # --- plumbing ---
    async def _expect(self, msg: Any, want: type, timeout: float | None) -> Any:
        await self.connect()
        reply = await self._call(msg, timeout)
        if not isinstance(reply, want):
            raise ServerError(f"unexpected reply {type(reply).__name__} to {type(msg).__name__}")
        return reply

    async def _call(self, msg: Any, timeout: float | None = _UNSET) -> Any:
        queue = self._open(msg.request_id)
        try:
            await self._send(msg, timeout)
            reply = await self._next(queue, timeout)
        finally:
            self._pending.pop(msg.request_id, None)
        if isinstance(reply, ErrorReply):
            raise _error(reply)
        return reply

    def _open(self, rid: str) -> asyncio.Queue[Any]:
        # unbounded on purpose: the reader must never block on one slow consumer; a request's
        # queue holds at most its max_tokens chunks
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[rid] = queue
        return queue

    def _limit(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is _UNSET else timeout

    async def _send(self, msg: Any, timeout: float | None) -> None:
        assert self._sock is not None, "client is closed"
        try:
            await asyncio.wait_for(self._sock.send(msg), self._limit(timeout))
        except TimeoutError:
            raise Timeout(f"could not send to {self.endpoint} within {self._limit(timeout)}s") from None

    async def _next(self, queue: asyncio.Queue[Any], timeout: float | None) -> Any:
        try:
            reply = await asyncio.wait_for(queue.get(), self._limit(timeout))
        except TimeoutError:
            raise Timeout(f"no reply from {self.endpoint} within {self._limit(timeout)}s") from None
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                reply = await self._sock.recv()
            except ProtocolError as exc:
                _log.warning("dropped a malformed reply: %s", exc)
                continue
            queue = self._pending.get(reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)
            elif isinstance(reply, ErrorReply) and not reply.request_id:
                _log.error("server could not decode a message: %s", reply.message)


class Client:
    """Blocking client: the same API as AsyncClient, backed by one on a private event-loop thread."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        connect_timeout: float = 5.0,
        **socket_kw: Any,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapipe-client", daemon=True)
        self._thread.start()
        self._client = AsyncClient(endpoint, timeout=timeout, connect_timeout=connect_timeout, **socket_kw)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def connect(self) -> Welcome:
        return self._run(self._client.connect())

    def generate(self, prompt: Prompt, adapter: str | None = None, **kw: Any) -> Completion:
        return self._run(self._client.generate(prompt, adapter, **kw))

    def stream(self, prompt: Prompt, adapter: str | None = None, **kw: Any) -> Iterator[Chunk]:
        """Closing the iterator early (break, close(), garbage collection) aborts the request."""
        agen = self._client.stream(prompt, adapter, **kw)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(agen.aclose())

    def load_adapter(self, name: str, path: str, **kw: Any) -> None:
        self._run(self._client.load_adapter(name, path, **kw))

    def unload_adapter(self, name: str, **kw: Any) -> None:
        self._run(self._client.unload_adapter(name, **kw))

    def list_adapters(self, **kw: Any) -> list[AdapterEntry]:
        return self._run(self._client.list_adapters(**kw))

    def health(self, **kw: Any) -> HealthReply:
        return self._run(self._client.health(**kw))
