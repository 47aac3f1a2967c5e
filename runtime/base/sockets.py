"""The one helper every ZeroMQ socket goes through: typed async PUSH/PULL/ROUTER/DEALER wrappers with
finite high-water marks, linger, one proto `Codec` each, buffers as extra frames, ProtocolError on
malformed input and ipc socket files removed on close."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Generic, Self, TypeVar

import zmq
import zmq.asyncio

from proto.codec import Codec, ProtocolError

T = TypeVar("T")
In = TypeVar("In")
Out = TypeVar("Out")

DEFAULT_HWM = 1000  # messages queued per peer before senders block (PUSH/DEALER) or drop (ROUTER)
DEFAULT_LINGER_MS = 500  # how long close() may spend flushing queued messages
MAX_CLIENT_MSG_BYTES = 64 << 20  # ROUTER facing clients: refuse absurd frames before they are buffered

__all__ = [
    "DealerSocket",
    "PeerBusy",
    "PeerGone",
    "ProtocolError",
    "PullSocket",
    "PushSocket",
    "RouterSocket",
]


class PeerGone(Exception):
    """A ROUTER send to an identity that is no longer connected (the client went away)."""

    def __init__(self, identity: bytes, why: str = "is gone") -> None:
        super().__init__(f"peer {identity!r} {why}")
        self.identity = identity


class PeerBusy(PeerGone):
    """A ROUTER send to a peer that stopped reading: its queue is at the high-water mark. Raised
    instead of waiting, so one slow client never stalls replies to the others."""

    def __init__(self, identity: bytes) -> None:
        super().__init__(identity, "is not reading (queue at its high-water mark)")


class _Base(Generic[In, Out]):
    kind: int

    def __init__(
        self,
        addr: str,
        in_type: Any = None,
        out_type: Any = None,
        *,
        bind: bool,
        ctx: zmq.Context | None = None,
        hwm: int = DEFAULT_HWM,
        linger_ms: int = DEFAULT_LINGER_MS,
        identity: bytes | None = None,
        max_msg_bytes: int = -1,
    ) -> None:
        if hwm <= 0:
            raise ValueError(f"high-water mark must be a positive message count, got {hwm}")
        self.addr = addr
        self.bound = bind
        self._in = Codec(in_type) if in_type is not None else None
        self._out = Codec(out_type) if out_type is not None else None
        self.sock = self._context(ctx).socket(self.kind)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        if max_msg_bytes > 0:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._init_kind()
        if bind:
            self.sock.bind(addr)
            # tcp://host:0 picks a free port; report the one chosen
            self.addr = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self.sock.connect(addr)

    def _context(self, ctx: zmq.Context | None) -> zmq.Context:
        return ctx if ctx is not None else zmq.asyncio.Context.instance()

    def _init_kind(self) -> None:
        pass

    def _encode(self, msg: Out) -> list[Any]:
        assert self._out is not None, f"{type(self).__name__} on {self.addr} sends nothing"
        return self._out.encode(msg)

    def _decode(self, frames: list[Any], identity: bytes | None = None) -> In:
        assert self._in is not None, f"{type(self).__name__} on {self.addr} receives nothing"
        return self._in.decode(frames, identity)

    def pending(self) -> bool:
        """True when a message is waiting to be received (used to drain before exit)."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.close()
        if self.bound and self.addr.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.addr[len("ipc://") :])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PushSocket(_Base[None, T]):
    """Async PUSH: `await send(msg)` blocks (backpressure) while the peer is at its high-water mark."""

    kind = zmq.PUSH

    def __init__(self, addr: str, msg_type: Any, *, bind: bool = False, **kw: Any) -> None:
        super().__init__(addr, None, msg_type, bind=bind, **kw)

    async def send(self, msg: T) -> None:
        await self.sock.send_multipart(self._encode(msg), copy=False)

    def send_nowait(self, msg: T) -> None:
        """Raise zmq.Again instead of waiting when the peer is full."""
        # zmq.asyncio reports a NOBLOCK failure through an already-finished future, not by raising
        fut = self.sock.send_multipart(self._encode(msg), flags=zmq.NOBLOCK, copy=False)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()


class PullSocket(_Base[T, None]):
    """Async PULL; `recv()` raises ProtocolError for a malformed message (the next one still decodes)."""

    kind = zmq.PULL

    def __init__(self, addr: str, msg_type: Any, *, bind: bool = True, **kw: Any) -> None:
        super().__init__(addr, msg_type, None, bind=bind, **kw)

    async def recv(self) -> T:
        return self._decode(await self.sock.recv_multipart(copy=False))


class DealerSocket(_Base[In, Out]):
    """Async DEALER (clients, and stages on the control channel): frames carry no envelope."""

    kind = zmq.DEALER

    def __init__(self, addr: str, in_type: Any, out_type: Any, *, bind: bool = False, **kw: Any) -> None:
        super().__init__(addr, in_type, out_type, bind=bind, **kw)

    async def send(self, msg: Out) -> None:
        await self.sock.send_multipart(self._encode(msg), copy=False)

    async def recv(self) -> In:
        return self._decode(await self.sock.recv_multipart(copy=False))


class RouterSocket(_Base[In, Out]):
    """Async ROUTER: `recv()` returns (identity, msg); `send(identity, msg)` never waits: it raises
    PeerGone when that peer disconnected and PeerBusy when it is full (ROUTER_MANDATORY), instead of
    silently dropping the message."""

    kind = zmq.ROUTER

    def __init__(self, addr: str, in_type: Any, out_type: Any, *, bind: bool = True, **kw: Any) -> None:
        super().__init__(addr, in_type, out_type, bind=bind, **kw)

    def _init_kind(self) -> None:
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # tcp peers that vanish without closing (killed, unplugged) are noticed within the timeout
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)

    async def recv(self) -> tuple[bytes, In]:
        frames = await self.sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        return identity, self._decode(frames[1:], identity)

    async def send(self, identity: bytes, msg: Out) -> None:
        # NOBLOCK: with ROUTER_MANDATORY a full peer gives EAGAIN, and waiting for POLLOUT would spin
        # (POLLOUT means "some peer is writable") while blocking every other peer's replies
        fut = self.sock.send_multipart([identity, *self._encode(msg)], flags=zmq.NOBLOCK, copy=False)
        try:
            await fut
        except zmq.Again:
            raise PeerBusy(identity) from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone(identity) from None
            raise
