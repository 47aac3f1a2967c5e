"""The one helper every ZeroMQ socket goes through: typed async PUSH/PULL/ROUTER/DEALER wrappers with
finite high-water marks, linger, one proto `Codec` each, buffers as extra frames, ProtocolError on
malformed input and ipc socket files removed on close; CURVE with a ZAP check for an endpoint that needs
the shared secret, and connection events (socket monitor)."""

from __future__ import annotations

import contextlib
import hmac
import os
import threading
from typing import Any, Generic, Self, TypeVar

import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from proto.codec import Codec, ProtocolError
from runtime.base.auth import CurveKeys, derive_curve_keys

T = TypeVar("T")
In = TypeVar("In")
Out = TypeVar("Out")

DEFAULT_HWM = 1000  # messages queued per peer before senders block (PUSH/DEALER) or drop (ROUTER)
DEFAULT_LINGER_MS = 500  # how long close() may spend flushing queued messages
MAX_CLIENT_MSG_BYTES = 16 << 20  # ROUTER facing clients: refuse absurd frames before they are buffered
MAX_CLIENT_FRAMES = 4  # a client message is a body plus at most one buffer (prompt ids); slack for growth

__all__ = [
    "ConnectionEvents",
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
        max_frames: int | None = None,
        api_key: str | None = None,
        monitor: bool = False,
    ) -> None:
        """`max_msg_bytes` > 0: zmq drops a peer that sends a bigger frame (before buffering it), and
        the codec refuses a message whose frames add up to more; `max_frames` bounds the frame count.
        `monitor`: `self.events` reports connection events from before the first connect on (a monitor
        attached later can miss a handshake refused at once)."""
        if hwm <= 0:
            raise ValueError(f"high-water mark must be a positive message count, got {hwm}")
        self.addr = addr
        self.bound = bind
        limit = max_msg_bytes if max_msg_bytes > 0 else None
        self._in = Codec(in_type, max_frames=max_frames, max_bytes=limit) if in_type is not None else None
        self._out = Codec(out_type) if out_type is not None else None
        self._zap: _ZapHandler | None = None
        self._own_ctx: zmq.Context | None = None
        keys = derive_curve_keys(api_key) if api_key else None
        if keys is not None and bind:  # ZAP is per context: a private one, its handler bound first
            ctx = self._own_ctx = self._context(None).__class__()
            self._zap = _ZapHandler(ctx, keys.client_public)
        self.sock = self._context(ctx).socket(self.kind)
        if keys is not None:
            _set_curve(self.sock, keys, server=bind)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        if max_msg_bytes > 0:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._init_kind()
        self.events = ConnectionEvents(self) if monitor else None
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
        if self._zap is not None:
            self._zap.close()
        if self._own_ctx is not None:
            self._own_ctx.term()

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

    def _init_kind(self) -> None:
        # a peer that stops answering pings (frozen, or gone without a FIN) is dropped like a closed one
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)

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


def _set_curve(sock: zmq.Socket, keys: CurveKeys, *, server: bool) -> None:
    if server:
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
    else:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


class _ZapHandler:
    """ZeroMQ's authentication hook (ZAP, RFC 27) for one context: a CURVE peer is let in only if its
    public key is the one derived from the shared secret. A thread, so a busy event loop never
    delays a handshake."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context, client_public: bytes) -> None:
        self._want = zmq.utils.z85.decode(client_public)
        self._sock = zmq.Context(ctx).socket(zmq.REP)  # a sync shadow of an asyncio context
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            request_id = frames[1] if len(frames) > 1 else b""
            ok = (
                len(frames) >= 7
                and frames[0] == b"1.0"
                and frames[5] == b"CURVE"
                and hmac.compare_digest(frames[6], self._want)
            )
            status = [b"200", b"OK", b"client"] if ok else [b"400", b"unknown client key", b""]
            self._sock.send_multipart([b"1.0", request_id, *status, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


class ConnectionEvents:
    """Connection-level events of one async socket (zmq's socket monitor): `await next()` returns
    "connected" (handshake done), "disconnected" (an established connection closed: the peer died or
    went away), "refused" (a handshake failed: wrong, missing or unexpected credentials) or "retrying"
    (a connection attempt failed, and zmq will try again)."""

    _EVENTS = {
        zmq.EVENT_HANDSHAKE_SUCCEEDED: "connected",
        zmq.EVENT_DISCONNECTED: "disconnected",
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused",
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
        zmq.EVENT_CONNECT_RETRIED: "retrying",
    }

    def __init__(self, sock: _Base[Any, Any]) -> None:
        self._owner = sock.sock
        mask = 0
        for event in self._EVENTS:
            mask |= event
        self._mon = self._owner.get_monitor_socket(mask)

    async def next(self) -> str:
        while True:
            frames = await self._mon.recv_multipart()
            what = self._EVENTS.get(parse_monitor_message(frames)["event"])
            if what is not None:
                return what

    def close(self) -> None:
        if not self._owner.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._owner.disable_monitor()
        self._mon.close(0)
