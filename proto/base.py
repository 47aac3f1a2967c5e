"""Wire building blocks: the `Message`/`Record` Struct bases, out-of-band `Buffer`/`TokenIds`, and the
per-edge union registry whose naming rule is checked at import."""

from __future__ import annotations

import sys
import typing
from array import array
from collections.abc import Iterable

import msgspec

# 5: WarmupProgress; 4: host blocks placed by the scheduler; 3: TokenChunks; 2: the GPU adapter pool,
# merged metrics, LoaderHealth, forbidden
PROTOCOL_VERSION = 5
"""Bump on any change that is not "append a field with a default at the end of a Struct"."""


class Message(
    msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """A top-level message on one socket edge. The tag is the class name; array_like keeps bodies small
    (fields travel by position, so new fields go at the end with a default). gc=False is safe because
    wire values never form reference cycles."""


class Record(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """A nested value inside a Message (no tag: its position in the parent says what it is)."""


class Buffer:
    """A read-only byte payload. The codec ships it as an extra multipart frame (zero-copy) when it
    is large and inline as msgpack bin when small; receivers get a view on the received frame."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview | array) -> None:
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError("Buffer needs a C-contiguous buffer")
        self.data = view.cast("B") if view.format != "B" or view.ndim != 1 else view

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __bytes__(self) -> bytes:
        return self.data.tobytes()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.data == other.data  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(bytes(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<{self.nbytes} bytes>)"


_NATIVE_LITTLE = sys.byteorder == "little"
assert array("i").itemsize == 4, "TokenIds needs a 4-byte C int"


class TokenIds(Buffer):
    """Token ids as little-endian int32 (so long prompts cross as one frame, not a msgpack array).
    The worker reads them with `torch.frombuffer(ids.data, dtype=torch.int32)`."""

    __slots__ = ()

    def __init__(self, data: bytes | bytearray | memoryview | array) -> None:
        super().__init__(data)
        if self.nbytes % 4:
            raise ValueError(f"TokenIds payload of {self.nbytes} bytes is not a whole number of int32")

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        arr = array("i", ids)
        if not _NATIVE_LITTLE:
            arr.byteswap()
        return cls(arr)

    def tolist(self) -> list[int]:
        if _NATIVE_LITTLE:
            return self.data.cast("i").tolist()
        arr = array("i", self.data.tobytes())
        arr.byteswap()
        return arr.tolist()

    def __len__(self) -> int:
        return self.nbytes // 4

    def __repr__(self) -> str:
        ids = self.tolist()
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        return f"TokenIds([{shown}] n={len(ids)})"


BUFFER_TYPES: tuple[type[Buffer], ...] = (Buffer, TokenIds)

# edge name -> member classes; filled by `edge()` as the proto modules import.
EDGES: dict[str, tuple[type[Message], ...]] = {}
UNIONS: dict[str, typing.Any] = {}  # edge name -> the union type a Codec for that edge takes
_TAGS: dict[str, type[Message]] = {}


def edge(name: str, *members: type[Message]) -> typing.Any:
    """Declare the union carried by one socket edge and check the naming rule: every member is a frozen
    tagged Message whose tag is its class name, and no two message classes anywhere share a tag."""
    if name in EDGES:
        raise TypeError(f"edge {name!r} declared twice")
    for cls in members:
        if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
            raise TypeError(f"edge {name!r}: {cls!r} is not a proto Message")
        cfg = cls.__struct_config__
        if not cfg.frozen or cfg.tag != cls.__name__:
            raise TypeError(f"edge {name!r}: {cls.__name__} must be frozen with tag == class name")
        seen = _TAGS.setdefault(cls.__name__, cls)
        if seen is not cls:
            raise TypeError(f"tag {cls.__name__!r} used by {seen.__module__} and {cls.__module__}")
    if len({c.__name__ for c in members}) != len(members):
        raise TypeError(f"edge {name!r} lists a message twice")
    EDGES[name] = members
    UNIONS[name] = members[0] if len(members) == 1 else typing.Union[members]  # noqa: UP007
    return UNIONS[name]
