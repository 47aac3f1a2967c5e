"""The Ray Serve replica: one `lorapipe serve` (its own process group, on the GPU Ray gave this actor),
adapters multiplexed by name (loaded through the server's load op on first use, unloaded through its
unload op once Ray evicts them and their requests ended), OpenAI requests passed through to the server's
HTTP front end, and Ray's health check answered by the server's own health. Owns an httpx client and
the SDK's ZeroMQ connection to its server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
from ray import serve

from runtime.client import AdapterLoadFailed, AsyncClient, Forbidden, InvalidRequest, LorapipeError
from runtime.ray_serve.adapter_table import AdapterLease, AdapterTable
from runtime.ray_serve.config import ClusterConfig
from runtime.ray_serve.forward import Head, ServerDown, forward
from runtime.ray_serve.server_process import ServerProcess
from stages.tokenizer.http.errors import ApiError

log = logging.getLogger("lorapipe.ray_serve")
OP_TIMEOUT_S = 600.0  # an adapter load reads and checks its files
HEALTH_TIMEOUT_S = 10.0
REFUSED = (AdapterLoadFailed, InvalidRequest, Forbidden)  # the adapter, not the server, is at fault


class LorapipeReplica:
    async def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.server = ServerProcess.command(cfg.model, cfg.device, cfg.base_name, cfg.server_args)
        await self.server.start(cfg.ready_timeout_s)
        log.info("replica %s: server pid %s at %s", self.replica_id, self.server.pid, self.server.base_url)
        self.sdk = AsyncClient(self.server.endpoint, timeout=OP_TIMEOUT_S)
        await self.sdk.connect()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=_limits(cfg))
        self.table = AdapterTable(self._load, self._unload, asyncio.get_running_loop())

        async def admit(name: str) -> AdapterLease:  # a plain function: Ray keeps its LRU on it
            return await self.table.admit(name)

        # Ray's LRU bound comes from the configuration, so the multiplexed loader is made here
        self.adapter = serve.multiplexed(max_num_models_per_replica=cfg.max_adapters_per_replica)(admit)

    async def _load(self, name: str) -> None:
        path = self.cfg.catalog.path_of(name)
        if path is None:
            raise InvalidRequest(f"adapter {name!r} is not in the catalog")
        await self.sdk.load_adapter(name, path)

    async def _unload(self, name: str) -> None:
        await self.sdk.unload_adapter(name)

    # --- requests -----------------------------------------------------------------------------------
    async def forward(self, path: str, body: bytes) -> AsyncIterator[Head | bytes]:
        """Pass one OpenAI request through; the multiplexed model id (if any) is the adapter's name."""
        self._check_server()
        name = serve.get_multiplexed_model_id()
        if name:
            try:
                await self.adapter(name)
            except REFUSED as exc:
                err = ApiError(400, f"adapter {name!r} could not be loaded: {exc}", "model")
                yield Head(err.status, "application/json", self.replica_id, err.body(), self.table.loads)
                return
            except LorapipeError as exc:
                raise ServerDown(f"replica {self.replica_id}: loading {name!r} failed: {exc}") from None
            self.table.acquire(name)
        try:
            gone = self._server_gone
            async for item in forward(self.http, self.server.base_url + path, body, self.replica_id, gone):
                yield dataclasses.replace(item, loads=self.table.loads) if isinstance(item, Head) else item
        except ServerDown:
            self._check_server()
            raise
        finally:
            if name:
                self.table.release(name)

    def _server_gone(self) -> bool:
        return self.server.exit_code is not None

    def _check_server(self) -> None:
        code = self.server.exit_code
        if code is not None:
            raise ServerDown(f"replica {self.replica_id}: its lorapipe server exited with status {code}")

    # --- what tests and operators ask -------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """This replica's id, pids and adapters (Ray's view and the server operations done)."""
        return {
            "replica": self.replica_id,
            "actor_pid": os.getpid(),
            "server_pid": self.server.pid,
            "adapters": self.table.held(),
            "loads": self.table.loads,
            "unloads": self.table.unloads,
        }

    # --- Ray's hooks ---------------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Raising marks the replica unhealthy: Ray stops it and starts another."""
        self._check_server()
        reply = await self.sdk.health(timeout=HEALTH_TIMEOUT_S)
        if not reply.ok:
            bad = [f"{s.stage}: {s.status} {s.detail}" for s in reply.stages if s.status != "ok"]
            raise ServerDown(f"replica {self.replica_id}: server not healthy ({'; '.join(bad)})")

    async def __del__(self) -> None:
        """Ray's graceful shutdown: drain the server, then let go of the connections."""
        await self.server.stop(grace_s=min(40.0, self.cfg.health_check_timeout_s + 10.0))
        await self.sdk.close()
        await self.http.aclose()


def _limits(cfg: ClusterConfig) -> httpx.Limits:
    return httpx.Limits(max_connections=cfg.max_ongoing_requests, max_keepalive_connections=32)
