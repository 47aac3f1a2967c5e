"""The OpenAI-compatible ingress: reads `model` from the body, sends the request to a replica through
Ray's multiplexed routing (the adapter's name is the model id, the base model has none), and streams
the replica's answer back. A request that no replica began answering (its server died, the replica is
being replaced) is retried on another until `retry_deadline_s`; once bytes went out it is not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime.ray_serve.config import ClusterConfig
from runtime.ray_serve.forward import Head, ServerDown
from stages.tokenizer.http.errors import ApiError

GENERATE = ("/v1/completions", "/v1/chat/completions")
RETRYABLE = (ServerDown, RayActorError, BackPressureError, ReplicaUnavailableError)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0
REPLICA_HEADER = "x-lorapipe-replica"  # which replica answered (for operators and tests)
LOADS_HEADER = "x-lorapipe-adapter-loads"  # that replica's adapter loads so far: churn at a glance


class _ModelOnly(msgspec.Struct):
    model: str


def adapter_of(model: str, base: str) -> str | None:
    """The adapter a `model` field names (None: the base model); `BASE:NAME` is NAME, as on one server."""
    if model == base:
        return None
    prefix = base + ":"
    return model[len(prefix) :] if model.startswith(prefix) else model


class OpenAIIngress:
    def __init__(self, replicas: Any, cfg: ClusterConfig) -> None:
        self.replicas = replicas  # DeploymentHandle of LorapipeReplica
        self.cfg = cfg

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except ApiError as exc:
            return Response(exc.body(), exc.status, media_type="application/json")

    async def _route(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if path == "/health" and method == "GET":
            return JSONResponse({"status": "ok"})
        if path == "/v1/models" and method == "GET":
            return JSONResponse(self._models())
        if path in GENERATE and method == "POST":
            body = await self._body(request)
            try:
                model = msgspec.json.decode(body, type=_ModelOnly).model
            except msgspec.ValidationError as exc:
                raise ApiError(400, f"invalid request: {exc}", "model") from None
            except msgspec.DecodeError as exc:
                raise ApiError(400, f"the body is not valid JSON: {exc}") from None
            adapter = adapter_of(model, self.cfg.base_name)
            if adapter is not None and self.cfg.catalog.path_of(adapter) is None:
                raise ApiError(404, f"the model {model!r} does not exist", "model", "model_not_found")
            head, rest = await self._start(path, body, adapter)
            return StreamingResponse(
                _body_of(head, rest),
                status_code=head.status,
                media_type=head.content_type or None,
                headers={REPLICA_HEADER: head.replica, LOADS_HEADER: str(head.loads)},
            )
        raise ApiError(404, f"no route {method} {path}")

    async def _body(self, request: Request) -> bytes:
        limit, chunks, size = self.cfg.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _start(self, path: str, body: bytes, adapter: str | None) -> tuple[Head, Any]:
        """The first Head of some replica's answer and the stream of the rest."""
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter or "")
        deadline = time.monotonic() + self.cfg.retry_deadline_s
        backoff = FIRST_BACKOFF_S
        while True:
            stream = handle.forward.remote(path, body)
            try:
                head = await anext(stream.__aiter__())
                assert isinstance(head, Head), f"a replica answered {type(head).__name__} before its Head"
                return head, stream
            except RETRYABLE as exc:
                stream.cancel()
                if time.monotonic() + backoff > deadline:
                    raise ApiError(503, f"no replica could take the request: {exc}") from None
            await asyncio.sleep(backoff)  # the failed replica is being replaced; Ray routes around it
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _models(self) -> dict[str, Any]:
        created = int(time.time())
        base = self.cfg.base_name
        card = {"object": "model", "created": created, "owned_by": "lorapipe"}
        cards = [{"id": base, **card, "parent": None}]
        cards += [{"id": name, **card, "parent": base} for name in self.cfg.catalog.names()]
        return {"object": "list", "data": cards}


async def _body_of(head: Head, rest: Any) -> AsyncIterator[bytes]:
    try:
        if head.first:
            yield head.first
        async for chunk in rest:
            yield chunk
    finally:
        rest.cancel()  # the client left early: stop the replica's generator too
