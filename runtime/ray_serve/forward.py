"""Passing one OpenAI request through to the replica's own lorapipe HTTP front end and its answer back as
a stream: first a Head (status, content type, the serving replica and the first bytes of the body, so
the ingress commits to a replica only once the answer has begun), then the remaining body chunks. A
failure before the Head is ServerDown, which the ingress retries on another replica."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


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
    client: httpx.AsyncClient, url: str, body: bytes, replica: str
) -> AsyncIterator[Head | bytes]:
    """POST `body` to `url`; yields a Head, then body chunks."""
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
        yield Head(response.status_code, response.headers.get("content-type", ""), replica, first)
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            raise StreamBroken(f"replica {replica}: its server failed mid-answer: {exc!r}") from None
    finally:
        await response.aclose()
