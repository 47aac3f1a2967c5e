"""The Starlette app: OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models, vLLM's
/v1/load_lora_adapter, /v1/unload_lora_adapter, /tokenize and /detokenize), /health and /metrics. Bodies
are decoded with msgspec; with an API key, all but /health and /metrics need `Authorization: Bearer KEY`."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.generation import Generation, until_disconnect
from stages.tokenizer.http.logprobs import LogprobsFormat
from stages.tokenizer.http.output import EventStream, Formatter, events
from stages.tokenizer.http.prepare import Prepared, prepare_chat, prepare_completion
from stages.tokenizer.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
)
from stages.tokenizer.http.strict import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    TOKENIZE_UNSUPPORTED,
    Neutral,
    convert_strict,
    decode_strict,
    json_object,
)
from stages.tokenizer.http.tokenize import DetokenizeRequest, detokenize, tokenize, tokenize_type

if TYPE_CHECKING:
    from stages.tokenizer.http.front import HttpFrontEnd

B = TypeVar("B")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return Response(exc.body(), exc.status, media_type="application/json")


async def _body(request: Request, limit: int) -> bytes:
    """The body's bytes: 413 past `limit`, before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; at most {limit} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read(
    request: Request, limit: int, type_: type[B], unsupported: Mapping[str, Neutral] | None = None
) -> B:
    """The body decoded as `type_`: 413 past `limit` bytes, 400 naming the field that is wrong, unknown
    or not supported (strict.py)."""
    return decode_strict(await _body(request, limit), type_, unsupported)


def build_app(front: HttpFrontEnd) -> Starlette:
    limit = front.max_body_bytes

    async def generate(request: Request, prepared: Prepared, fmt: Formatter) -> Response:
        gen = Generation(front.port, prepared)
        try:
            await gen.start()
        except BaseException:
            await gen.close()
            raise
        if prepared.stream:
            return EventStream(events(gen, fmt))
        work = asyncio.ensure_future(gen.run_to_end())
        gone = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                t.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
            await gen.close()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # the client left; nobody reads this
        return _json(fmt.whole(gen, work.result()))

    async def completions(request: Request) -> Response:
        req = await _read(request, limit, CompletionRequest, COMPLETION_UNSUPPORTED)
        front.check_serving()
        prepared = await prepare_completion(req, front.context())
        names = LogprobsFormat(front.context().tokenizer) if req.prompt_logprobs is not None else None
        return await generate(request, prepared, Formatter(False, req.model, lps(prepared), names))

    async def chat(request: Request) -> Response:
        req = await _read(request, limit, ChatCompletionRequest, CHAT_UNSUPPORTED)
        front.check_serving()
        prepared = await prepare_chat(req, front.context())
        return await generate(request, prepared, Formatter(True, req.model, lps(prepared)))

    def lps(prepared: Prepared) -> LogprobsFormat | None:
        return LogprobsFormat(front.context().tokenizer) if prepared.logprobs else None

    async def models(request: Request) -> Response:
        return _json(await front.model_list())

    async def load_lora(request: Request) -> Response:
        req = await _read(request, limit, LoadLoraRequest)
        await front.load_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        req = await _read(request, limit, UnloadLoraRequest)
        await front.unload_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def tokenize_route(request: Request) -> Response:
        raw = json_object(await _body(request, limit))
        req = convert_strict(raw, tokenize_type(raw), TOKENIZE_UNSUPPORTED)
        return _json(await tokenize(req, front.context()))

    async def detokenize_route(request: Request) -> Response:
        req = await _read(request, limit, DetokenizeRequest)
        return _json(detokenize(req, front.context()))

    async def health(request: Request) -> Response:
        ok, detail = await front.health()
        return JSONResponse(detail, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(await front.metrics_text(), media_type=PROMETHEUS)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def on_other_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises it afterwards, so uvicorn logs the traceback
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, Exception: on_other_error})
    key = front.api_key
    if key is None:
        return app
    expected = f"Bearer {key}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        """Everything but /health and /metrics needs the key: those stay open for probes and scrapers."""
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                err = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)")
                await _error(err)(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded  # type: ignore[return-value]
