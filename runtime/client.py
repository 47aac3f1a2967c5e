"""Client SDK: `AsyncClient` (runtime/client_async.py) talks to a server's tokenizer over one ZeroMQ
connection; `Client` (runtime/client_sync.py) is its blocking twin. Every error the SDK raises is a
`LorapipeError` (runtime/client_types.py) that carries the server's message."""

from runtime.client_async import DEFAULT_ENDPOINT, AsyncClient
from runtime.client_sync import Client
from runtime.client_types import (
    Aborted,
    AdapterLoadFailed,
    AdapterTimeout,
    Chunk,
    Completion,
    Forbidden,
    InvalidRequest,
    LorapipeError,
    ProtocolMismatchError,
    ServerError,
    ServerUnreachable,
    StageFailed,
    Timeout,
    Timings,
    Unauthorized,
    UnknownAdapter,
)

__all__ = [
    "DEFAULT_ENDPOINT",
    "Aborted",
    "AdapterLoadFailed",
    "AdapterTimeout",
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "Forbidden",
    "InvalidRequest",
    "LorapipeError",
    "ProtocolMismatchError",
    "ServerError",
    "ServerUnreachable",
    "StageFailed",
    "Timeout",
    "Timings",
    "Unauthorized",
    "UnknownAdapter",
]
