"""Encode a proto message to multipart frames and back: frame 0 is the msgpack body, frames 1.. are the
large `Buffer` payloads it references by index (msgpack ext), sent and received without copies. Decoding
never raises anything but `ProtocolError`, and frame-count and size limits apply before any decoding."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from msgspec import msgpack

from proto.base import BUFFER_TYPES, Buffer

T = TypeVar("T")

INLINE_MAX = 1024
"""Buffers up to this many bytes travel inline (an extra frame costs more than copying them)."""
EXT_FRAME = 1  # msgpack ext code: payload is the little-endian uint32 index of an extra frame

Frame = bytes | memoryview | Any  # Any: zmq.Frame and other buffer-protocol objects


class ProtocolError(Exception):
    """A frame sequence that is not a valid message of the socket's union. Receivers log it and drop
    the message; `identity` is the ROUTER peer that sent it, when known."""

    def __init__(self, message: str, identity: bytes | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.identity = identity
        self.body = body  # the undecodable msgpack body, for best-effort replies (e.g. its request_id)


class Codec(Generic[T]):
    """Encoder + decoder for one union. Not thread-safe: one per socket. `max_frames` and `max_bytes`
    (None: unlimited) bound a received message's frame count and total size; a message over either is
    refused before its body is looked at."""

    def __init__(
        self,
        msg_type: Any,
        inline_max: int = INLINE_MAX,
        *,
        max_frames: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.msg_type = msg_type
        self.inline_max = inline_max
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._out: list[memoryview] = []
        self._in: list[memoryview] = []
        self._used = 0
        self._enc = msgpack.Encoder(enc_hook=self._enc_hook)
        self._dec = msgpack.Decoder(msg_type, dec_hook=self._dec_hook, ext_hook=self._ext_hook)

    # -- encode --
    def encode(self, msg: T) -> list[Frame]:
        self._out = []
        try:
            body = self._enc.encode(msg)
            return [body, *self._out]
        finally:
            self._out = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, Buffer):
            if obj.nbytes <= self.inline_max:
                return obj.data
            self._out.append(obj.data)
            return msgpack.Ext(EXT_FRAME, (len(self._out) - 1).to_bytes(4, "little"))
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")

    # -- decode --
    def decode(self, frames: list[Any], identity: bytes | None = None) -> T:
        if not frames:
            raise ProtocolError("empty message", identity)
        if self.max_frames is not None and len(frames) > self.max_frames:
            raise ProtocolError(f"{len(frames)} frames in one message (at most {self.max_frames})", identity)
        try:
            views = [_view(f) for f in frames]
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"unreadable frame: {exc}", identity) from None
        if self.max_bytes is not None:
            size = sum(v.nbytes for v in views)
            if size > self.max_bytes:
                raise ProtocolError(f"message of {size} bytes (at most {self.max_bytes})", identity)
        body, self._in = views[0], views[1:]
        self._used = 0
        try:
            msg = self._dec.decode(body)
        except ProtocolError as exc:
            raise ProtocolError(str(exc), identity, _head(body)) from None
        except Exception as exc:  # msgspec or a hook: DecodeError, ValidationError, UnicodeDecodeError, ...
            name = _type_name(self.msg_type)
            text = f"malformed {name}: {type(exc).__name__}: {exc}"
            raise ProtocolError(text[:1000], identity, _head(body)) from None
        finally:
            extra, self._in = len(self._in), []
        if self._used != extra:
            raise ProtocolError(f"{extra - self._used} unreferenced extra frame(s)", identity, _head(body))
        return msg

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != EXT_FRAME or len(data) != 4:
            raise ProtocolError(f"unknown msgpack ext code {code}")
        index = int.from_bytes(data, "little")
        if index != self._used or index >= len(self._in):
            raise ProtocolError(f"buffer reference {index} does not match the {len(self._in)} extra frame(s)")
        self._used += 1
        return self._in[index]

    @staticmethod
    def _dec_hook(typ: type, obj: Any) -> Any:
        if isinstance(typ, type) and issubclass(typ, BUFFER_TYPES) and isinstance(obj, bytes | memoryview):
            return typ(obj)
        raise TypeError(f"expected a buffer for {typ.__name__}, got {type(obj).__name__}")


def _head(body: memoryview) -> bytes:
    return body[:4096].tobytes()


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame: view its memory instead of copying it
    return buf if isinstance(buf, memoryview) else memoryview(frame)


def _type_name(t: Any) -> str:
    if getattr(t, "__origin__", None) is not None:  # a Union of the edge's messages
        return "message"
    return getattr(t, "__name__", None) or str(t).replace("proto.", "")
