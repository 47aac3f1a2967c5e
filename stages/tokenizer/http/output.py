"""Responses of /v1/completions and /v1/chat/completions: whole bodies, and Server-Sent Events in
OpenAI's chunk format (`data: {json}` per chunk, a usage chunk when asked, `data: [DONE]` last), sent
by an ASGI response that aborts the generation as soon as the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import Response

from proto.client import TokenLogprobs
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.generation import Choice, Generation, Logprobs, until_disconnect
from stages.tokenizer.http.logprobs import ChatLogprobs, CompletionLogprobs, LogprobsFormat
from stages.tokenizer.http.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatStreamChoice,
    Completion,
    CompletionChoice,
    Message,
    PromptLogprob,
    Usage,
)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def _event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class Formatter:
    """Builds one endpoint's objects: `chat` selects chat.completion(.chunk) over text_completion."""

    def __init__(
        self,
        chat: bool,
        model: str,
        logprobs: LogprobsFormat | None = None,
        prompt_names: LogprobsFormat | None = None,
    ) -> None:
        """`logprobs`: names the tokens of requests that asked for their log-probabilities;
        `prompt_names`: those of requests that asked for their prompt's (completions)."""
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.prompt_names = prompt_names
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, gen: Generation) -> Usage:
        prompt, out = gen.prepared.distinct_prompt_tokens, gen.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=out, total_tokens=prompt + out)

    def whole(self, gen: Generation, choices: list[Choice]) -> Any:
        usage, with_ids = self.usage(gen), gen.prepared.token_ids
        if self.chat:
            out = [
                ChatChoice(
                    c.index,
                    Message("assistant", "".join(c.texts)),
                    c.finish_reason,
                    self._chat_lps(c.lp_ids, c.lps),
                    _ids(c.ids, with_ids),
                )
                for c in choices
            ]
            return ChatCompletion(self.id, self.created, self.model, out, usage)
        texts = [
            CompletionChoice(
                c.index,
                c.echo + "".join(c.texts),
                c.finish_reason,
                self._completion_lps(c.lp_ids, c.lps, len(c.echo)),
                _ids(c.ids, with_ids),
                self._prompt_lps(gen, c),
            )
            for c in choices
        ]
        return Completion(self.id, self.created, self.model, texts, usage)

    def chunk(self, c: Choice, text: str, ids: list[int], lps: Logprobs | None, with_ids: bool) -> bytes:
        lp_ids, values = lps if lps is not None else ([], [])
        if self.chat:
            out = b""
            if not c.started:  # the role comes first, in a chunk of its own (as OpenAI sends it)
                first = ChatStreamChoice(c.index, Message("assistant", ""), None)
                out = _event(ChatCompletion(self.id, self.created, self.model, [first], object=_CHUNK))
            delta = Message(content=text) if text else Message()
            lp = self._chat_lps(lp_ids, values) if lps is not None else None
            choice = ChatStreamChoice(c.index, delta, c.finish_reason, lp, _ids(ids, with_ids))
            c.started = True
            return out + _event(ChatCompletion(self.id, self.created, self.model, [choice], object=_CHUNK))
        if not c.started:
            text, c.started = c.echo + text, True
            c.text_offset = len(c.echo)
        lp = self._completion_lps(lp_ids, values, c.text_offset) if lps is not None else None
        if lp is not None:
            c.text_offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else c.text_offset
        choice = CompletionChoice(c.index, text, c.finish_reason, lp, _ids(ids, with_ids))
        return _event(Completion(self.id, self.created, self.model, [choice]))

    def _chat_lps(self, ids: list[int], values: list[TokenLogprobs]) -> ChatLogprobs | None:
        return self.logprobs.chat(ids, values) if self.logprobs is not None else None

    def _completion_lps(
        self, ids: list[int], values: list[TokenLogprobs], offset: int
    ) -> CompletionLogprobs | None:
        return self.logprobs.completion(ids, values, offset) if self.logprobs is not None else None

    def _prompt_lps(self, gen: Generation, c: Choice) -> list[dict[str, PromptLogprob] | None] | Any:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: entry}, its own entry
        first and then the likeliest tokens' (rank 1 first; a token among them is listed once)."""
        if self.prompt_names is None:
            return msgspec.UNSET
        name = self.prompt_names.text
        prompt = gen.prepared.requests[c.index].prompt_ids
        ids = prompt.tolist() if prompt is not None else []
        out: list[dict[str, PromptLogprob] | None] = [None]
        for t, lp in zip(ids[1:], c.prompt_lps or [], strict=False):
            entry = {str(t): PromptLogprob(lp.logprob, lp.rank, name(t))}
            for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                entry.setdefault(str(i), PromptLogprob(v, rank, name(i)))
            out.append(entry)
        return out

    def usage_chunk(self, gen: Generation) -> bytes:
        if self.chat:
            return _event(ChatCompletion(self.id, self.created, self.model, [], self.usage(gen), _CHUNK))
        return _event(Completion(self.id, self.created, self.model, [], self.usage(gen)))


_CHUNK = "chat.completion.chunk"


def _ids(ids: list[int], wanted: bool) -> list[int] | msgspec.UnsetType:
    return list(ids) if wanted else msgspec.UNSET


async def events(gen: Generation, fmt: Formatter) -> AsyncIterator[bytes]:
    """The SSE body; an error after the response started is sent as an `error` event before [DONE].
    Events whose output is already queued go out in one write: a stream that fell behind (a busy loop,
    a slow reader) catches up in fewer, larger sends instead of one per token."""
    pending: list[bytes] = []
    try:
        with_ids = gen.prepared.token_ids
        async for c, text, ids, lps in gen.events():
            pending.append(fmt.chunk(c, text, ids, lps, with_ids))
            if gen.queue.empty():
                yield b"".join(pending)
                pending.clear()
        if gen.prepared.include_usage:
            pending.append(fmt.usage_chunk(gen))
    except ApiError as exc:
        pending.append(b"data: " + exc.body() + b"\n\n")
    finally:
        await gen.close()
    yield b"".join(pending) + DONE


class EventStream(Response):
    """text/event-stream from an async iterator of bytes. Pumping and watching for the client's
    disconnect run side by side; whichever ends first cancels the other, and the iterator is closed
    (which aborts the generation) before this returns."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self.body_iter = body
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iter:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(until_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iter.aclose()  # type: ignore[attr-defined]
        failed = results[0]
        if isinstance(failed, Exception) and not isinstance(failed, OSError):
            raise failed  # a bug, not a disconnect: let the server log it
