"""The SDK's asyncio client: `AsyncClient` owns one DEALER to the tokenizer's ROUTER, a reader task that
routes replies by request_id and a watcher of the connection (zmq socket monitor) that fails every open
call with ServerError once an established connection drops (the tokenizer died or the server stopped),
even calls with timeout=None. With an API key (`api_key=` or $LORAPIPE_API_KEY) the connection is
CURVE-encrypted and authenticated. Import it from `runtime.client`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

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
    TokenChunk,
    TokenChunks,
    TokenLogprobs,
    UnloadAdapter,
    Welcome,
)
from proto.codec import Codec, ProtocolError
from runtime.base.auth import API_KEY_ENV
from runtime.base.endpoints import DEFAULT_ENDPOINT, unreachable_reason
from runtime.base.sockets import ConnectionEvents, DealerSocket
from runtime.client_types import (
    Aborted,
    Chunk,
    Completion,
    InvalidRequest,
    LorapipeError,
    Prompt,
    ProtocolMismatchError,
    ServerError,
    ServerUnreachable,
    Timeout,
    Timings,
    Unauthorized,
    check_name,
    check_text,
    error_from_reply,
    make_request,
    request_size,
)

_log = logging.getLogger("lorapipe.client")
_UNSET: Any = object()


class AsyncClient:
    """Asyncio client. Connects (and checks the protocol version) on first use; `timeout` bounds
    every wait for the server and can be overridden per call. `api_key` (default: $LORAPIPE_API_KEY)
    must match the server's --api-key when it has one."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        **socket_kw: Any,
    ):
        """`connect_timeout`: the handshake's wait for a server, then ServerUnreachable (≤ `timeout`)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.welcome: Welcome | None = None
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._socket_kw = socket_kw
        self._sock: DealerSocket[Any, Any] | None = None
        self._pending: dict[str, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._refused: Unauthorized | None = None  # the last refused handshake, until one succeeds
        self._probed = False  # a failed connection attempt of this handshake was looked into
        self._events: ConnectionEvents | None = None
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
                self._sock = DealerSocket(
                    self.endpoint,
                    ClientReply,
                    ClientRequest,
                    api_key=self._api_key,
                    monitor=True,
                    **self._socket_kw,
                )
                self._events = self._sock.events
                self._reader = asyncio.ensure_future(self._read())
                self._watcher = asyncio.ensure_future(self._watch())
            limit = self.connect_timeout if self.timeout is None else min(self.connect_timeout, self.timeout)
            hello = Hello(request_id=uuid.uuid4().hex, protocol_version=PROTOCOL_VERSION)
            self._probed = False
            try:
                reply = await self._call(hello, limit)
            except ServerUnreachable:  # the address refused a connection: no use waiting out the limit
                raise
            except Timeout:
                if self._refused is not None:  # refused before the Hello waited: the key, not the address
                    raise self._refused from None
                why = await asyncio.to_thread(unreachable_reason, self.endpoint)
                raise self._unreachable(f"answered within {limit:g}s: {why}") from None
            if not isinstance(reply, Welcome) or reply.protocol_version != PROTOCOL_VERSION:
                raise ProtocolMismatchError(f"server speaks {reply!r}, client speaks {PROTOCOL_VERSION}")
            self.welcome = reply
            return reply

    def _unreachable(self, what: str) -> ServerUnreachable:
        return ServerUnreachable(
            f"no lorapipe server {what}. Is `lorapipe serve` running at {self.endpoint} (its --endpoint, "
            f"default {DEFAULT_ENDPOINT})?"
        )

    async def _check_refused(self) -> None:
        """After a failed connection attempt (zmq retries on its own): a handshake still waiting ends at
        once when the address refuses connections or has no socket file, which no wait changes."""
        why = await asyncio.to_thread(unreachable_reason, self.endpoint)
        if self.welcome is None and why.startswith(("nothing listens", "there is no socket file")):
            self._fail_all(self._unreachable(f"at {self.endpoint}: {why}"))

    async def close(self) -> None:
        """Calls still open end at once with Aborted (the reader that would answer them stops here)."""
        self._fail_all(Aborted(f"the client of {self.endpoint} was closed while this call was open"))
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._events is not None:
            self._events.close()
        if self._sock is not None:
            self._sock.close()
        self._sock, self._reader, self._watcher, self._events, self.welcome = None, None, None, None, None

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
        req = make_request(prompt, adapter, sampling)
        await self.connect()
        self._check_size(req)
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
                            time.monotonic() - t0, reply.prompt_tokens, ttft, reply.logprobs,
                            reply.prompt_logprobs,
                        )  # fmt: skip
                    case ErrorReply():
                        done = True
                        raise error_from_reply(reply)
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
        """The whole completion; with `logprobs=k` among the sampling values, each output token's
        log-probability and the k likeliest tokens' (`Completion.logprobs`)."""
        texts, ids, times, last = [], [], [], None
        logprobs: list[TokenLogprobs] = []
        asked, prompt_lps = False, None
        async with contextlib.aclosing(self.stream(prompt, adapter, timeout=timeout, **sampling)) as chunks:
            async for last in chunks:
                texts.append(last.text)
                ids.extend(last.token_ids)
                times.extend([last.time] * len(last.token_ids))
                if last.logprobs is not None:
                    asked = True
                    logprobs.extend(last.logprobs)
                prompt_lps = last.prompt_logprobs if last.prompt_logprobs is not None else prompt_lps
        assert last is not None and last.finished
        timings = Timings(times[0] if times else last.time, times, last.time, last.server_ttft)
        return Completion(
            last.request_id,
            "".join(texts),
            ids,
            last.finish_reason,
            last.prompt_tokens,
            timings,
            logprobs if asked else None,
            prompt_lps,
        )

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = _UNSET) -> None:
        check_name(name)
        check_text(str(path), "path")
        msg = LoadAdapter(request_id=uuid.uuid4().hex, name=name, path=str(path))
        await self.connect()
        self._check_size(msg)
        await self._expect(msg, Ack, timeout)

    async def unload_adapter(self, name: str, *, timeout: float | None = _UNSET) -> None:
        check_name(name)
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
            raise error_from_reply(reply)
        return reply

    def _check_size(self, req: GenerateRequest | LoadAdapter) -> None:
        """A message over the server's limit would make ZeroMQ drop the whole connection (every open
        call with it): refuse it here, by its size."""
        most = self.welcome.max_request_bytes if self.welcome is not None else 0
        if most > 0 and (size := request_size(req, most, Codec(ClientRequest).encode)) > most:
            raise InvalidRequest(
                f"the request is {size} bytes; the server at {self.endpoint} accepts at most {most} "
                "(its --max-request-bytes)"
            )

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
            async with asyncio.timeout(self._limit(timeout)):
                await self._sock.send(msg)
        except TimeoutError:
            raise Timeout(f"could not send to {self.endpoint} within {self._limit(timeout)}s") from None
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:  # not encodable
            raise InvalidRequest(f"the request cannot be encoded: {type(exc).__name__}: {exc}") from None

    async def _next(self, queue: asyncio.Queue[Any], timeout: float | None) -> Any:
        if not queue.empty():  # already here: no timer to arm (chunks of a step arrive together)
            reply = queue.get_nowait()
        else:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the reply
                async with asyncio.timeout(self._limit(timeout)):
                    reply = await queue.get()
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
            for one in reply.chunks if isinstance(reply, TokenChunks) else (reply,):
                queue = self._pending.get(one.request_id)
                if queue is not None:
                    queue.put_nowait(one)
                elif isinstance(one, ErrorReply) and not one.request_id:
                    _log.error("server could not decode a message: %s", one.message)

    async def _watch(self) -> None:
        """Turn connection events into errors for every open call: a connection that drops after its
        handshake means the server (its tokenizer) is gone; a refused handshake, the wrong key."""
        assert self._events is not None
        while True:
            match await self._events.next():
                case "connected":
                    self._refused = None
                case "retrying" if self.welcome is None and not self._probed:
                    self._probed = True  # once per handshake
                    await self._check_refused()
                case "disconnected":
                    self.welcome = None  # a server that comes back is greeted again
                    where = f"the server at {self.endpoint}"
                    self._fail_all(ServerError(f"lost the connection to {where} (it stopped or died)"))
                case "refused":
                    why = "the API key is wrong" if self._api_key else "the API key is missing or wrong"
                    self._refused = Unauthorized(
                        f"the server at {self.endpoint} refused the connection: {why}, or the server "
                        "expects none"
                    )
                    self._fail_all(self._refused)

    def _fail_all(self, exc: LorapipeError) -> None:
        for queue in self._pending.values():
            queue.put_nowait(exc)
