"""The HTTP front end inside the tokenizer process: the app and its uvicorn server, and its narrow view
of the actor (submit a client message as an in-process client, read the adapter table, draining,
the merged metrics). Requests reach the actor's mailbox as objects: no extra serialization hop."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proto.client import (
    Ack,
    AdapterList,
    ErrorReply,
    Health,
    HealthReply,
    ListAdapters,
    LoadAdapter,
    StageHealth,
    UnloadAdapter,
)
from stages.tokenizer.http.app import build_app
from stages.tokenizer.http.chat_template import ChatTemplate
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.prepare import Context
from stages.tokenizer.http.schemas import ModelCard, ModelList
from stages.tokenizer.http.server import HttpServer

if TYPE_CHECKING:
    from stages.tokenizer.actor import TokenizerActor

OP_TIMEOUT_S = 600.0  # an adapter load reads and validates files; a health probe has its own deadline
METRICS_TIMEOUT_S = 5.0


class HttpFrontEnd:
    def __init__(self, actor: TokenizerActor) -> None:
        cfg = actor.config
        self.port = actor
        self.actor = actor
        self.api_key = cfg.api_key
        self.max_body_bytes = cfg.max_client_msg_bytes
        self.chat_template = ChatTemplate.from_model_dir(cfg.model_dir)
        self.created = int(Path(cfg.model_dir).stat().st_mtime)
        self.server = HttpServer(build_app(self), cfg.http_host, cfg.http_port, cfg.drain_timeout_s)

    async def serve(self) -> None:
        await self.server.serve()

    async def shutdown(self) -> None:
        await self.server.shutdown(self.actor.drain_timeout)

    # --- what routes ask of the actor ---------------------------------------------------------------
    def check_serving(self) -> None:
        if self.actor.draining:
            raise ApiError(503, self.actor._shutdown_message())

    def context(self) -> Context:
        a, cfg = self.actor, self.actor.config
        return Context(
            a.tokenizer,
            cfg.model_name,
            cfg.max_model_len,
            cfg.vocab_size,
            a.adapters,
            self.chat_template,
            a.max_prompt_bytes,
        )

    async def call(self, msg: Any, timeout: float = OP_TIMEOUT_S) -> Any:
        """Send one control message as an in-process client and wait for its reply."""
        local = self.actor.local
        identity, queue = local.open()
        try:
            await self.actor.submit(identity, msg)
            try:
                async with asyncio.timeout(timeout):
                    reply = await queue.get()
            except TimeoutError:
                raise ApiError(503, f"no answer from the pipeline within {timeout:g}s") from None
        finally:
            local.close(identity)
        if isinstance(reply, ErrorReply):
            raise ApiError.of_kind(reply.kind, reply.message, "lora_name")
        return reply

    async def load_adapter(self, name: str, path: str) -> None:
        self.check_serving()
        await self.call(LoadAdapter(request_id=_rid(), name=name, path=path))

    async def unload_adapter(self, name: str) -> None:
        self.check_serving()
        reply = await self.call(UnloadAdapter(request_id=_rid(), name=name))
        assert isinstance(reply, Ack)

    async def model_list(self) -> ModelList:
        cfg = self.actor.config
        listing = await self.call(ListAdapters(request_id=_rid()))
        assert isinstance(listing, AdapterList)
        base = ModelCard(cfg.model_name, self.created, cfg.model_dir, None, cfg.max_model_len)
        cards = [base]
        for e in sorted(listing.adapters, key=lambda e: e.name):
            if self.actor.adapters.get(e.name) == "registered":
                cards.append(ModelCard(e.name, self.created, e.path, cfg.model_name, cfg.max_model_len))
        return ModelList(cards)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        if self.actor.draining:
            return False, {"status": "draining", "detail": self.actor._shutdown_message()}
        try:
            reply = await self.call(Health(request_id=_rid()), self.actor.config.health_timeout_s + 1.0)
        except ApiError as exc:
            return False, {"status": "down", "detail": exc.message}
        assert isinstance(reply, HealthReply)
        stages = {s.stage: _stage(s) for s in reply.stages}
        return reply.ok, {"status": "ok" if reply.ok else "not ready", "stages": stages}

    async def metrics_text(self) -> str:
        try:
            return await self.actor.merged_metrics(METRICS_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(
                503, f"the launcher did not answer a metrics query within {METRICS_TIMEOUT_S:g}s"
            ) from None


def _stage(s: StageHealth) -> dict[str, Any]:
    """One stage of /health; the worker's kernel warm-up progress while it runs."""
    out: dict[str, Any] = {"status": s.status, "detail": s.detail}
    if s.warmup_total:
        out["warmup"] = {"done": s.warmup_done, "total": s.warmup_total}
    return out


def _rid() -> str:
    return uuid.uuid4().hex
