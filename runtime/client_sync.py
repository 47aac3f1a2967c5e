"""The SDK's blocking client: `Client` has AsyncClient's API and runs one on a private event-loop thread.
Import it from `runtime.client`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from proto.client import AdapterEntry, HealthReply, Welcome
from runtime.client_async import DEFAULT_ENDPOINT, AsyncClient
from runtime.client_types import Chunk, Completion, Prompt


class Client:
    """Blocking client: the same API as AsyncClient, backed by one on a private event-loop thread."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        **socket_kw: Any,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapipe-client", daemon=True)
        self._thread.start()
        self._client = AsyncClient(
            endpoint, timeout=timeout, api_key=api_key, connect_timeout=connect_timeout, **socket_kw
        )

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
