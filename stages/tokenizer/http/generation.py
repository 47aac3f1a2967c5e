"""One HTTP request's choices running in the tokenizer actor: submitted as an in-process client, their
TokenChunks read from its queue, stop strings applied to the text (cut before the stop, the request
aborted), and everything still running aborted when the HTTP side closes (a disconnect included)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from proto.client import Abort, ErrorReply, TokenChunk, TokenLogprobs
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.prepare import Prepared
from stages.tokenizer.local_clients import LocalClients


class Port(Protocol):
    """What the HTTP front end needs of the tokenizer actor."""

    local: LocalClients

    async def submit(self, identity: bytes, msg: Any) -> None: ...


class StopText:
    """Finds stop strings in streamed text. It holds back the last len(longest stop) - 1 characters
    until they cannot begin a stop string, so no emitted text is ever taken back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """The text that may be emitted now, and whether a stop string ended the output there."""
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buf[:cut], True
        keep = 0 if final else min(self.hold, len(buf))
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False


@dataclass
class Choice:
    index: int
    request_id: str
    stop: StopText
    echo: str = ""
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # kept only with return_token_ids
    lp_ids: list[int] = field(default_factory=list)  # with logprobs: the tokens they are of
    lps: list[TokenLogprobs] = field(default_factory=list)
    prompt_lps: list[TokenLogprobs] | None = None  # with prompt_logprobs (non-streaming)
    tokens: int = 0
    finish_reason: str | None = None
    started: bool = False  # a streamed chunk was sent for it (chat sends the role first)
    text_offset: int = 0  # streamed completions with logprobs: where the next token's text starts


class Logprobs(NamedTuple):
    """New tokens and their log-probabilities (one each)."""

    ids: list[int]
    values: list[TokenLogprobs]


Event = tuple[Choice, str, list[int], Logprobs | None]


class Generation:
    def __init__(self, port: Port, prepared: Prepared) -> None:
        self.port = port
        self.prepared = prepared
        self.identity, self.queue = port.local.open()
        self.choices = {
            g.request_id: Choice(i, g.request_id, StopText(prepared.stops), prepared.echo[i])
            for i, g in enumerate(prepared.requests)
        }
        self.running = set(self.choices)

    async def start(self) -> None:
        for req in self.prepared.requests:
            await self.port.submit(self.identity, req)

    async def events(self) -> AsyncIterator[Event]:
        """(choice, new text, new token ids, new tokens' logprobs) whenever a choice has new text (or,
        with return_token_ids or logprobs, new tokens) or finished, until all have finished.
        An error reply for any choice raises ApiError (close() then aborts the others)."""
        while self.running:
            reply = await self.queue.get()
            rid = reply.request_id
            if rid not in self.running:
                continue  # late output of a choice cut by a stop string
            if isinstance(reply, ErrorReply):
                self.running.discard(rid)
                raise ApiError.of_kind(reply.kind, reply.message)
            if not isinstance(reply, TokenChunk):
                continue
            c = self.choices[rid]
            c.tokens = reply.num_output_tokens
            text, stopped = c.stop.feed(reply.text, final=reply.finished)
            if stopped:
                c.finish_reason = "stop"
                await self._abort(rid)
            elif reply.finished:
                c.finish_reason = reply.finish_reason or "stop"
                self.running.discard(rid)
            c.texts.append(text)
            if reply.prompt_logprobs is not None:
                c.prompt_lps = reply.prompt_logprobs
            ids = reply.token_ids if self.prepared.token_ids else []
            c.ids.extend(ids)
            lps = Logprobs(reply.token_ids, reply.logprobs) if reply.logprobs else None
            if lps is not None:
                c.lp_ids.extend(lps.ids)
                c.lps.extend(lps.values)
            if text or ids or lps or c.finish_reason is not None:
                yield c, text, ids, lps

    async def run_to_end(self) -> list[Choice]:
        async for _ in self.events():
            pass
        return sorted(self.choices.values(), key=lambda c: c.index)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())

    async def _abort(self, rid: str) -> None:
        self.running.discard(rid)
        await self.port.submit(self.identity, Abort(request_id=rid))

    async def close(self) -> None:
        """Abort what still runs (their KV pages and slot references come back) and leave."""
        try:
            for rid in list(self.running):
                await self._abort(rid)
        finally:
            self.port.local.close(self.identity)


async def until_disconnect(receive: Any) -> None:
    """Returns when the HTTP client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)
