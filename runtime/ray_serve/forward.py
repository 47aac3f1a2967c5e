"""Passing one OpenAI request through to the replica's own lorapipe HTTP front end and its answer back as
a stream: first a Head (status, content type, the serving replica and the first bytes of the body, so
the ingress commits to a replica only once the answer has begun), then the remaining body chunks. A
failure before the Head is ServerDown, which the ingress retries on another replica; so is an answer
that only says the server cannot serve: a 503 (draining, not ready), a stream whose first event is an
error of type service_unavailable (the server failed it before any token, e.g. its launcher died), or
any 5xx once the server's launcher has exited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import msgspec

from stages.tokenizer.http.errors import TYPE_OF_STATUS


class ServerDown(RuntimeError):
    """This replica's server cannot take the request (exited, or the connection failed before any answer);
    nothing of the request was produced, so it may be retried elsewhere."""


class StreamBroken(RuntimeError):
    """The server failed after the answer had begun: the client sees a cut stream."""


@dataclass(frozen=True)
class Head:
    status: int
    content_type: str
    replica: str
    first: bytes  # the first body bytes (the whole body when it is short)
    loads: int = 0  # adapter loads this replica's server has done so far (churn, for operators)


async def forward(
    client: httpx.AsyncClient, url: str, body: bytes, replica: str, server_gone: Callable[[], bool]
) -> AsyncIterator[Head | bytes]:
    """POST `body` to `url`; yields a Head, then body chunks. `server_gone()`: whether the server's
    launcher has exited (asked only of a 5xx answer)."""
    request = client.build_request("POST", url, content=body, headers={"content-type": "application/json"})
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise ServerDown(f"replica {replica}: its server did not take the request: {exc!r}") from None
    try:
        chunks = response.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.TransportError as exc:
            raise ServerDown(f"replica {replica}: its server failed before answering: {exc!r}") from None
        status = response.status_code
        if status == 503 or (status >= 500 and server_gone()) or _unavailable_event(first):
            said = first[:200].decode(errors="replace")
            raise ServerDown(f"replica {replica}: its server cannot serve (HTTP {status}: {said})")
        yield Head(status, response.headers.get("content-type", ""), replica, first)
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            raise StreamBroken(f"replica {replica}: its server failed mid-answer: {exc!r}") from None
    finally:
        await response.aclose()


def _unavailable_event(first: bytes) -> bool:
    """Whether a body begins with an SSE error event of type service_unavailable (what the server's
    front end streams for a request it fails before any token because it is shutting down)."""
    if not first.startswith(b'data: {"error"'):  # a token event: nothing to decode
        return False
    try:
        event = msgspec.json.decode(first[len(b"data: ") :].split(b"\n\n", 1)[0])
    except msgspec.DecodeError:  # cut mid-event: not an error event as far as can be told
        return False
    error = event.get("error") if isinstance(event, dict) else None
    return isinstance(error, dict) and error.get("type") == TYPE_OF_STATUS[503]
