"""The replica's pass-through to its server's HTTP front end, against a real uvicorn server: an answer
that begins is a Head and then its chunks; a server that cannot serve is ServerDown (the ingress retries
it on another replica): refused connections, 503s, a stream whose first event is a service_unavailable
error, and 5xx answers once the server's launcher has exited (two CI runs of the Ray Serve kill test
caught the last two); a 5xx of a server that still runs, and a stream that fails after a token or with
another error, pass through."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime.base.endpoints import free_port
from runtime.ray_serve.forward import Head, ServerDown, forward


async def streamed(request):
    async def body():
        for part in (b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"):
            yield part

    return StreamingResponse(body(), media_type="text/event-stream")


SHUTTING_DOWN = (
    b'data: {"error": {"message": "the server is shutting down: its launcher died", '
    b'"type": "service_unavailable", "param": null, "code": null}}\n\n'
)
TOKEN = b'data: {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}\n\n'
BAD_EVENT = b'data: {"error": {"message": "stop must be a string", "type": "invalid_request_error"}}\n\n'


def events(*parts: bytes):
    async def endpoint(request):
        async def body():
            for part in parts:
                yield part

        return StreamingResponse(body(), media_type="text/event-stream")

    return endpoint


async def unavailable(request):
    return JSONResponse({"error": {"message": "the server is shutting down"}}, 503)


async def failed(request):
    return JSONResponse({"error": {"message": "internal error"}}, 500)


async def bad_request(request):
    return JSONResponse({"error": {"message": "max_tokens must be positive"}}, 400)


APP = Starlette(
    routes=[
        Route("/v1/completions", streamed, methods=["POST"]),
        Route("/unavailable", unavailable, methods=["POST"]),
        Route("/failed", failed, methods=["POST"]),
        Route("/bad", bad_request, methods=["POST"]),
        Route("/stream_down", events(SHUTTING_DOWN + b"data: [DONE]\n\n"), methods=["POST"]),
        Route("/stream_cut", events(TOKEN, SHUTTING_DOWN, b"data: [DONE]\n\n"), methods=["POST"]),
        Route("/stream_bad", events(BAD_EVENT + b"data: [DONE]\n\n"), methods=["POST"]),
    ]
)


def with_server(body):
    """Run `body(base_url, client)` against APP served by uvicorn on a free port."""

    async def main():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(APP, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
            assert not task.done(), "the test server did not start"
        try:
            async with httpx.AsyncClient() as client:
                await body(f"http://127.0.0.1:{port}", client)
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())


async def collect(client, url, gone: bool) -> list:
    return [item async for item in forward(client, url, b"{}", "r1", lambda: gone)]


def test_an_answer_that_begins_is_a_head_then_its_chunks():
    async def body(base, client):
        items = await collect(client, base + "/v1/completions", gone=False)
        head, rest = items[0], items[1:]
        assert isinstance(head, Head) and head.status == 200 and head.replica == "r1"
        assert head.content_type.startswith("text/event-stream")
        assert head.first + b"".join(rest) == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"

    with_server(body)


@pytest.mark.parametrize("gone", [False, True])
def test_a_503_is_server_down_whether_or_not_the_launcher_runs(gone):
    async def body(base, client):
        with pytest.raises(ServerDown, match="HTTP 503: .*shutting down"):
            await collect(client, base + "/unavailable", gone)

    with_server(body)


def test_a_500_passes_through_while_the_server_runs_and_is_server_down_once_its_launcher_exited():
    async def body(base, client):
        (head,) = await collect(client, base + "/failed", gone=False)
        assert isinstance(head, Head) and head.status == 500 and b"internal error" in head.first
        with pytest.raises(ServerDown, match="HTTP 500"):
            await collect(client, base + "/failed", gone=True)

    with_server(body)


def test_a_client_error_passes_through_even_after_the_launcher_exited():
    async def body(base, client):
        (head,) = await collect(client, base + "/bad", gone=True)
        assert isinstance(head, Head) and head.status == 400 and b"max_tokens" in head.first

    with_server(body)


def test_a_refused_connection_is_server_down():
    async def main():
        async with httpx.AsyncClient() as client:
            with pytest.raises(ServerDown, match="did not take the request"):
                await collect(client, f"http://127.0.0.1:{free_port()}/v1/completions", gone=False)

    asyncio.run(main())


def test_a_stream_whose_first_event_says_the_server_cannot_serve_is_server_down():
    """The front end fails a stream it had begun before any token with a service_unavailable error
    event (its launcher died): nothing was generated, so another replica may take the request."""

    async def body(base, client):
        with pytest.raises(ServerDown, match="shutting down"):
            await collect(client, base + "/stream_down", gone=False)

    with_server(body)


def test_a_stream_that_fails_after_a_token_or_with_another_error_passes_through():
    async def body(base, client):
        head, *rest = await collect(client, base + "/stream_cut", gone=True)
        assert head.status == 200
        assert head.first + b"".join(rest) == TOKEN + SHUTTING_DOWN + b"data: [DONE]\n\n"
        (head,) = await collect(client, base + "/stream_bad", gone=True)
        assert head.status == 200 and head.first.startswith(BAD_EVENT)

    with_server(body)
