"""uvicorn (httptools, on the actor's uvloop) serving the app on a socket bound up front, as one task of
the tokenizer actor's TaskGroup. The actor owns SIGTERM/SIGINT, so uvicorn installs no signal handlers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

BACKLOG = 2048


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the actor drains on SIGTERM/SIGINT and then stops this server itself


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; OSError (e.g. the port is taken) surfaces at stage start-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, app: Any, host: str, port: int, graceful_s: float) -> None:
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,  # the stage's logging stays as it is
            access_log=False,
            timeout_graceful_shutdown=max(1, int(graceful_s)),
            timeout_keep_alive=30,
        )
        self.server = _Server(config)
        self._done = asyncio.Event()

    async def serve(self) -> None:
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            self._done.set()
            self.sock.close()

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting, let responses in progress finish (up to `timeout`), then return."""
        self.server.should_exit = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._done.wait()
