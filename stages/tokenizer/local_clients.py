"""In-process clients of the tokenizer actor (the HTTP front end): each has an identity, like a ROUTER
peer's, and an asyncio queue that its replies go to instead of the client socket. No serialization."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from proto.client import TokenChunks

# ZeroMQ reserves routing ids that start with a zero byte for itself, so no remote peer can take these.
PREFIX = b"\x00local:"


class LocalClients:
    def __init__(self) -> None:
        self.queues: dict[bytes, asyncio.Queue[Any]] = {}
        self._ids = itertools.count(1)

    def open(self) -> tuple[bytes, asyncio.Queue[Any]]:
        """A new client: its identity and the queue its replies arrive on. The queue is unbounded on
        purpose (the actor must never block on one slow HTTP client); a request puts at most one reply
        per output token in it, and closing the client aborts its requests."""
        identity = PREFIX + str(next(self._ids)).encode()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[identity] = queue
        return identity, queue

    def close(self, identity: bytes) -> None:
        self.queues.pop(identity, None)

    @staticmethod
    def is_local(identity: bytes) -> bool:
        return identity.startswith(PREFIX)

    def deliver(self, identity: bytes, msg: Any) -> bool:
        """Hand a reply to a local client, the chunks of a TokenChunks one by one; False when that
        client is gone."""
        queue = self.queues.get(identity)
        if queue is None:
            return False
        for one in msg.chunks if isinstance(msg, TokenChunks) else (msg,):
            queue.put_nowait(one)
        return True
